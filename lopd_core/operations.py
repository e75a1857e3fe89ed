"""Manual operations on a workspace: evaluate a registered version, run the gate, roll back, backfill.

These back the ``lopd-evaluate``, ``lopd-promote``, ``lopd-rollback`` and ``lopd-backfill`` deployments
and the matching CLI commands. Like the cycle stages they return small dicts and are idempotent:

- ``evaluate_version`` stores its episodes in the ``evaluations`` table keyed by the version and tags the
  student version with ``eval_summary`` (re-running overwrites the same rows and tag);
- ``promote_challenger`` re-uses the ``eval_summary`` tags (evaluating a version that has none) and only
  moves ``@champion`` when the gate passes;
- ``backfill`` re-curates and re-indexes the trajectories of a window of past cycles (e.g. after a new
  curation rule or embedder); rows that do not change are not rewritten, so running it twice is a no-op.
"""

from __future__ import annotations

import json
from typing import Any

from lopd_core.config import Config
from lopd_core.cycle import CycleContext, _evaluate_student, _policies
from lopd_core.memory.curation import curate_store
from lopd_core.memory.indexing import index_store
from lopd_core.registry import ModelRegistry, PairVersion, decide_promotion, is_base_marker
from lopd_core.workspace import Workspace


def _ops_context(cfg: Config, name: str) -> CycleContext:
    return CycleContext(cfg, name)


def resolve_version(registry, ref: str) -> tuple[str, str]:
    """'champion' / 'challenger' / '3' → (student version, composer version)."""
    if ref in ("champion", "challenger"):
        pair = registry.champion() if ref == "champion" else registry.challenger()
        if pair is None:
            raise ValueError(f"there is no @{ref} yet; run a cycle first")
        return pair.student, pair.composer
    versions = {v["version"]: v for v in registry.versions("student")}
    if ref not in versions:
        raise ValueError(f"student version {ref!r} is not registered (have: {', '.join(sorted(versions, key=int))})")
    return ref, versions[ref]["tags"].get("paired_with", "")


def evaluate_version(cfg: Config, ref: str = "champion") -> dict[str, Any]:
    """Held-out evaluation of one registered student version (tags it with ``eval_summary``)."""

    ctx = _ops_context(cfg, f"eval-{ref}")
    ctx.champion()  # bootstraps the registry on a fresh workspace
    student, composer = resolve_version(ctx.registry, ref)
    source = ctx.registry.download("student", student)

    policies = _policies(ctx, None if is_base_marker(source) else student)
    metrics = _evaluate_student(ctx, policies, f"student-v{student}", f"student-v{student}",
                                use_base_weights=is_base_marker(source))
    ctx.registry.set_version_tag("student", student, "eval_summary",
                                 json.dumps({k: round(v, 4) for k, v in metrics.items()}))
    run_id = ctx.registry.cycle_run(f"eval-student-v{student}")
    ctx.registry.log_metrics(run_id, metrics)
    return {"student_version": student, "composer_version": composer, "metrics": metrics, "mlflow_run_id": run_id}


def _summary(registry: ModelRegistry, cfg: Config, student: str) -> dict[str, float]:
    tags = registry.version_tags("student", student)
    if "eval_summary" in tags:
        return json.loads(tags["eval_summary"])
    return evaluate_version(cfg, student)["metrics"]


def promote_challenger(cfg: Config, *, flow_run_id: str = "") -> dict[str, Any]:
    """The gate on @challenger vs @champion (evaluating whichever has no stored summary)."""

    ctx = _ops_context(cfg, "promote")
    champion, challenger = ctx.champion(), ctx.registry.challenger()
    if challenger is None:
        raise ValueError("there is no @challenger to promote; run a cycle (or its distill stage) first")
    if challenger.student == champion.student:
        return {"promoted": False, "decision": "challenger is already the champion", "champion": champion.student}
    decision = decide_promotion(_summary(ctx.registry, cfg, challenger.student),
                                _summary(ctx.registry, cfg, champion.student), cfg.registry)
    if decision.promote:
        ctx.registry.promote(PairVersion(challenger.student, challenger.composer), decision=decision,
                             flow_run_id=flow_run_id)
    return {"promoted": decision.promote, "decision": decision.summary(), "challenger": challenger.student,
            "champion": ctx.registry.champion().student}


def rollback(cfg: Config) -> dict[str, Any]:
    ctx = _ops_context(cfg, "rollback")
    old, new = ctx.registry.rollback()
    return {"rolled_back": {"student": old.student, "composer": old.composer},
            "champion": {"student": new.student, "composer": new.composer}}


def list_cycles(cfg: Config) -> list[str]:
    ws = Workspace.from_config(cfg.workspace).ensure()
    return sorted(p.parent.name for p in ws.runs_dir.glob("*/cycle.json"))


def backfill(cfg: Config, *, cycle_ids: list[str] | None = None, since: str = "", until: str = "",
             rebuild_index: bool = False, reevaluate: list[str] | None = None) -> dict[str, Any]:
    """Re-curate + re-index the window of cycles (ids, or ``since ≤ id ≤ until``); optionally re-evaluate versions."""

    window = list(cycle_ids or [])
    if not window and (since or until):
        window = [c for c in list_cycles(cfg) if (not since or c >= since) and (not until or c <= until)]
        if not window:
            raise ValueError(f"no recorded cycle between {since or '…'} and {until or '…'}")
    ctx = _ops_context(cfg, "backfill")
    report = curate_store(ctx.store, cfg, cycle_ids=window or None, stage="backfill")
    indexed = index_store(ctx.store, cycle_ids=window or None, rebuild=rebuild_index,
                          max_bad_fraction=cfg.curation.max_bad_row_fraction, stage="backfill")
    out: dict[str, Any] = {"window": window or "all", "curated_kept": report.n_kept, "curation_changes": report.changes,
                           "experiences_version": indexed.experiences_version,
                           "index_changes": {"inserted": indexed.n_inserted, "updated": indexed.n_updated,
                                             "deleted": indexed.n_deleted}}
    if reevaluate:
        out["evaluations"] = {ref: evaluate_version(cfg, ref)["metrics"] for ref in reevaluate}
    return out
