"""`lopd rollout`."""

from __future__ import annotations

from lopd_core.commands.common import Overrides, Profile, not_built


def rollout(profile: Profile = "demo", set_: Overrides = None):
    """Generate episodes on a task suite and print success rate, reward and tokens/s."""
    not_built("rollout")
