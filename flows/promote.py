"""`lopd-promote` and `lopd-rollback`: the promotion gate on @challenger vs @champion, and its undo.

Run them: ``lopd promote`` / ``lopd rollback``, or through their deployments.
"""

from __future__ import annotations

from prefect import flow

from flows.common import config, flow_run_id
from lopd_core import operations


@flow(name="lopd-promote", log_prints=True)
def promote_flow(profile: str = "demo", overrides: list[str] | None = None) -> dict:
    """Promote @challenger to @champion if it passes the gate."""
    return operations.promote_challenger(config(profile, overrides), flow_run_id=flow_run_id())


@flow(name="lopd-rollback", log_prints=True)
def rollback_flow(profile: str = "demo", overrides: list[str] | None = None) -> dict:
    """Re-point @champion to the pair it replaced."""
    return operations.rollback(config(profile, overrides))
