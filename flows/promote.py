"""`lopd-promote` and `lopd-rollback`: the promotion gate on @challenger vs @champion, and its undo.

Both first reap what killed processes left running (``flows.common.reap_crashed``). A rolled-back pair is
promoted again only with ``force`` (recorded on the pair). Run them: ``lopd promote [--force]`` /
``lopd rollback``, or through their deployments.
"""

from __future__ import annotations

from prefect import flow

from flows.common import claim_flow_run, config, flow_run_id, reap_crashed
from lopd_core import operations


@flow(name="lopd-promote", log_prints=True)
def promote_flow(profile: str = "demo", overrides: list[str] | None = None, force: bool = False) -> dict:
    """Promote @challenger to @champion if it passes the gate (``force``: even if it was rolled back)."""
    cfg = config(profile, overrides)
    claim_flow_run()
    reap_crashed(cfg)
    return operations.promote_challenger(cfg, flow_run_id=flow_run_id(), force=force)


@flow(name="lopd-rollback", log_prints=True)
def rollback_flow(profile: str = "demo", overrides: list[str] | None = None) -> dict:
    """Re-point @champion to the pair it replaced."""
    cfg = config(profile, overrides)
    claim_flow_run()
    reap_crashed(cfg)
    return operations.rollback(cfg, flow_run_id=flow_run_id())
