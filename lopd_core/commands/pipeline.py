"""`lopd cycle|serve|backfill|evaluate|promote|rollback`: the continual-learning cycle and its registry."""

from __future__ import annotations

from lopd_core.commands.common import Overrides, Profile, not_built


def cycle(profile: Profile = "demo", set_: Overrides = None):
    """Run one continual-learning cycle as a Prefect flow run."""
    not_built("cycle")


def serve(profile: Profile = "demo", set_: Overrides = None):
    """Register and serve the Prefect deployments (lopd-cycle on its schedule, backfill, evaluate, promote, rollback)."""
    not_built("serve")


def backfill(profile: Profile = "demo", set_: Overrides = None):
    """Re-curate and re-index (optionally re-evaluate) a window of past cycles."""
    not_built("backfill")


def evaluate(profile: Profile = "demo", set_: Overrides = None):
    """Evaluate a registered model pair on held-out tasks."""
    not_built("evaluate")


def promote(profile: Profile = "demo", set_: Overrides = None):
    """Run the promotion gate on @challenger vs @champion."""
    not_built("promote")


def rollback(profile: Profile = "demo", set_: Overrides = None):
    """Re-point @champion to the previous pair."""
    not_built("rollback")
