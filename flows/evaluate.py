"""`lopd-evaluate`: score one registered student version on the held-out tasks (and the forgetting probe).

Run it: ``lopd evaluate --version champion`` or ``prefect deployment run lopd-evaluate/lopd-evaluate``.
"""

from __future__ import annotations

from prefect import flow

from flows.common import config
from lopd_core import operations


@flow(name="lopd-evaluate", log_prints=True)
def evaluate_flow(profile: str = "demo", overrides: list[str] | None = None, version: str = "champion") -> dict:
    """``version``: 'champion', 'challenger' or a student version number."""
    return operations.evaluate_version(config(profile, overrides), version)
