"""`lopd distill` (and `--cold-start`)."""

from __future__ import annotations

from lopd_core.commands.common import Overrides, Profile, not_built


def distill(profile: Profile = "demo", set_: Overrides = None):
    """Run N training steps (LOPD or a baseline); --cold-start trains the composer first."""
    not_built("distill")
