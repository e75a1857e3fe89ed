"""What ``lopd status`` reports: the workspace, prepared models, experience tables, registry champions, cycles.

Each part is optional: a part whose library is not installed or whose store does not exist yet says so
instead of failing, so ``lopd status`` works on a fresh workspace and on a GPU box with only torch.
It only reads: what it flags (a composer alias that disagrees with the champion record, runs or cycles
whose process is gone) is repaired or marked crashed by the next cycle, promote or rollback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lopd_core import liveness
from lopd_core.config import Config
from lopd_core.memory.store import store_status
from lopd_core.models.default import MANIFEST
from lopd_core.registry import ModelRegistry
from lopd_core.workspace import Workspace, _local_path


def prepared_models(ws: Workspace) -> list[dict[str, Any]]:
    rows = []
    for d in sorted(p for p in ws.models_dir.glob("*") if (p / "config.json").exists()):
        info = json.loads((d / MANIFEST).read_text()) if (d / MANIFEST).exists() else {}
        rows.append({"name": d.name, "path": str(d), "parameters": info.get("parameters")})
    return rows


def _experience_store(ws: Workspace) -> dict[str, Any]:
    try:
        info = store_status(ws.lance_uri)
    except ImportError as e:
        return {"available": False, "reason": str(e)}
    if info.get("available"):
        info["tables"] = {k: {"rows": v["rows"], "version": v["version"]} for k, v in info["tables"].items()}
    return info


def _registry(cfg: Config, ws: Workspace) -> dict[str, Any]:
    local = ws.mlflow_tracking_uri.removeprefix("sqlite:///")
    if ws.mlflow_tracking_uri.startswith("sqlite:///") and not Path(local).exists():
        return {"available": False, "reason": "no MLflow store yet (run a cycle)"}
    try:
        reg = ModelRegistry.from_workspace(ws, cfg.registry)
    except ImportError as e:
        return {"available": False, "reason": str(e)}
    pairs = {}
    for alias, pair in (("champion", reg.champion()), ("challenger", reg.challenger())):
        pairs[alias] = None if pair is None else {"student": pair.student, "composer": pair.composer,
                                                  "cycle_id": pair.tags.get("cycle_id", "")}
    students, composers = reg.versions("student"), reg.versions("composer")
    problems = reg.alias_mismatches()
    unpaired = [f"{role} v{v['version']} (cycle {v['tags'].get('cycle_id', '?')}) has no paired version"
                for role, versions in (("student", students), ("composer", composers))
                for v in versions if not v["tags"].get("paired_with")]
    stale = [f"MLflow run {r['run_name'] or r['run_id']} is RUNNING but {r['reason']}" for r in reg.reap_runs(dry_run=True)]
    return {"available": True, "tracking_uri": ws.mlflow_tracking_uri, **pairs,
            "champion_pair": "MISMATCH: " + "; ".join(problems) if problems else "ok",
            "student_versions": len(students), "composer_versions": len(composers),
            "problems": problems + unpaired + stale}


def _cycles(cfg: Config, ws: Workspace) -> list[dict[str, Any]]:
    rows = []
    from lopd_core.state_mirror import mirror_of

    if (mirror := mirror_of(ws)) is not None:  # every worker's cycles
        mirror.pull_records()
    for path in sorted(ws.runs_dir.glob("*/cycle.json")):
        rec = json.loads(path.read_text())
        row = {"cycle_id": rec["cycle_id"], "state": rec["state"], "stages": list(rec["stages"]),
               "error": rec.get("error", "")}
        if rec["state"] == "running" and rec.get("owner"):
            gone = liveness.dead_reason(rec["owner"], stale_after=cfg.registry.stale_after_seconds)
            if gone:
                row["state"], row["error"] = "crashed (not yet marked)", gone
        rows.append(row)
    return rows


def workspace_status(cfg: Config, ws: Workspace) -> dict[str, Any]:
    lance_local = _local_path(ws.lance_uri)
    return {
        "workspace": str(ws.home),
        "profile": cfg.name,
        "models": prepared_models(ws),
        "experience_store": _experience_store(ws) if lance_local is None or lance_local.exists()
        else {"available": False, "reason": "no LanceDB directory yet"},
        "registry": _registry(cfg, ws),
        "cycles": _cycles(cfg, ws),
    }
