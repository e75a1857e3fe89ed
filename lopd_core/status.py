"""What ``lopd status`` reports: the workspace, prepared models, experience tables, registry champions, cycles.

Each part is optional: a part whose library is not installed or whose store does not exist yet says so
instead of failing, so ``lopd status`` works on a fresh workspace and on a GPU box with only torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    return {"available": True, "tracking_uri": ws.mlflow_tracking_uri, **pairs,
            "student_versions": len(reg.versions("student"))}


def _cycles(ws: Workspace) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(ws.runs_dir.glob("*/cycle.json")):
        rec = json.loads(path.read_text())
        rows.append({"cycle_id": rec["cycle_id"], "state": rec["state"], "stages": list(rec["stages"]),
                     "error": rec.get("error", "")})
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
        "cycles": _cycles(ws),
    }
