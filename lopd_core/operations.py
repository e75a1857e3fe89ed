"""Manual operations on a workspace: evaluate a registered version, run the gate, roll back, export, backfill.

These back the ``lopd-evaluate``, ``lopd-promote``, ``lopd-rollback`` and ``lopd-backfill`` deployments
and the matching CLI commands. Like the cycle stages they return small dicts and are idempotent:

- ``evaluate_version`` stores its episodes in the ``evaluations`` table keyed by the version and tags the
  student version with ``eval_summary`` (re-running overwrites the same rows and tag);
- ``promote_challenger`` re-uses the ``eval_summary`` tags (evaluating a version that has none) and only
  moves ``@champion`` when the gate passes against the champion of that moment (compare-and-set under the
  registry lock); a rolled-back challenger needs ``force``;
- ``rollback`` re-points ``@champion`` under the same lock and marks the old champion rolled back;
- ``export_version`` writes a registered student as one merged Hugging Face folder (for ``vllm serve``,
  ``from_pretrained`` or a hub upload);
- ``reap`` marks crashed what a killed process left running (MLflow runs, cycle records) and repairs a
  lagging composer alias; ``flows.common.reap_crashed`` adds the Prefect side;
- ``backfill`` re-curates and re-indexes the trajectories of a window of past cycles (e.g. after a new
  curation rule or embedder); rows that do not change are not rewritten, so running it twice is a no-op.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lopd_core.config import Config
from lopd_core.cycle import CycleContext, _evaluate_student, _policies, gate_metrics, reap_cycle_records
from lopd_core.memory.curation import curate_store
from lopd_core.memory.indexing import index_store
from lopd_core.registry import ModelRegistry, PairVersion, is_base_marker, run_gate
from lopd_core.serving import export_merged
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
    ctx.registry.end_run(run_id)
    return {"student_version": student, "composer_version": composer, "metrics": metrics, "mlflow_run_id": run_id}


def _summary(registry: ModelRegistry, cfg: Config, student: str) -> dict[str, float]:
    tags = registry.version_tags("student", student)
    if "eval_summary" in tags:
        return json.loads(tags["eval_summary"])
    return evaluate_version(cfg, student)["metrics"]


def promote_challenger(cfg: Config, *, flow_run_id: str = "", force: bool = False) -> dict[str, Any]:
    """The gate on @challenger vs @champion (evaluating whichever has no stored summary).

    ``force`` promotes a challenger that was rolled back (still through the gate); it is recorded on the pair.
    """

    ctx = _ops_context(cfg, "promote")
    ctx.champion()  # bootstraps a fresh registry
    challenger = ctx.registry.challenger()
    if challenger is None:
        raise ValueError("there is no @challenger to promote; run a cycle (or its distill stage) first")
    outcome = run_gate(ctx.registry, PairVersion(challenger.student, challenger.composer),
                       _summary(ctx.registry, cfg, challenger.student),
                       lambda champion: _summary(ctx.registry, cfg, champion.student),
                       required=gate_metrics(ctx.cfg), flow_run_id=flow_run_id, force=force)
    ctx.registry.tag_pair(challenger, {"gate": outcome.decision.summary()[:4000]})
    after = outcome.champion_after or ctx.registry.champion()
    return {"promoted": outcome.promoted, "decision": outcome.decision.summary(), "challenger": challenger.student,
            "compared_with": outcome.champion_before.student if outcome.champion_before else None,
            "forced": force, "champion": after.student if after else None}


def rollback(cfg: Config, *, flow_run_id: str = "") -> dict[str, Any]:
    """Re-point @champion to the pair it replaced; the old champion is marked rolled back."""
    ctx = _ops_context(cfg, "rollback")
    old, new = ctx.registry.rollback(flow_run_id=flow_run_id)
    return {"rolled_back": {"student": old.student, "composer": old.composer},
            "champion": {"student": new.student, "composer": new.composer}}


def export_version(cfg: Config, ref: str, out: Path) -> dict[str, Any]:
    """Write registered student ``ref`` ('champion', 'challenger' or a version) as one merged Hugging Face
    folder at ``out`` (:func:`lopd_core.serving.export_merged`), with its provenance in ``lopd_export.json``."""
    ws = Workspace.from_config(cfg.workspace).ensure()
    registry = ModelRegistry.from_workspace(ws, cfg.registry)
    student, composer = resolve_version(registry, ref)
    tags = registry.version_tags("student", student)
    provenance = {"registered_model": cfg.registry.student_model, "version": student, "ref": ref,
                  "paired_composer": composer, **{k: tags[k] for k in ("cycle_id", "base_model", "config_hash")
                                                  if k in tags}}
    path = export_merged(registry.download("student", student), Path(out), provenance=provenance)
    return {"student_version": student, "out": str(path), "base": is_base_marker(registry.download("student", student))}


def reap(cfg: Config) -> dict[str, Any]:
    """What killed processes left behind, marked crashed: MLflow runs (KILLED), cycle records (crashed);
    a composer alias lagging its pair record is repaired. Returns what was found, with the Prefect flow
    runs they belonged to."""
    ws = Workspace.from_config(cfg.workspace).ensure()
    registry = ModelRegistry.from_workspace(ws, cfg.registry)
    runs = registry.reap_runs()
    cycles = reap_cycle_records(ws, stale_after=cfg.registry.stale_after_seconds)
    repaired = registry.repair_aliases()
    flow_run_ids = sorted({r["flow_run_id"] for r in runs + cycles if r.get("flow_run_id")})
    return {"mlflow_runs": runs, "cycles": cycles, "aliases_repaired": repaired, "flow_run_ids": flow_run_ids}


def list_cycles(cfg: Config) -> list[str]:
    """Every cycle with a record (with ``workspace.state_uri``: every worker's, pulled first)."""
    from lopd_core.state_mirror import mirror_of

    ws = Workspace.from_config(cfg.workspace).ensure()
    if (mirror := mirror_of(ws)) is not None:
        mirror.pull_records()
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
