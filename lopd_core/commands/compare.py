"""`lopd compare`: LOPD against the baselines under one rollout budget."""

from __future__ import annotations

from lopd_core.commands.common import Overrides, Profile, not_built


def compare(profile: Profile = "demo", set_: Overrides = None):
    """Compare LOPD against the baselines under one rollout budget."""
    not_built("compare")
