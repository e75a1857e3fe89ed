"""What ``lopd status`` reports: the workspace, prepared models, experience tables, registry champions.

Each part is optional: a part whose library is not installed or whose store does not exist yet says so
instead of failing, so ``lopd status`` works on a fresh workspace and on a GPU box with only torch.
"""

from __future__ import annotations

import json
from typing import Any

from lopd_core.workspace import Workspace


def prepared_models(ws: Workspace) -> list[dict[str, Any]]:
    from lopd_core.models.default import MANIFEST

    rows = []
    for d in sorted(p for p in ws.models_dir.glob("*") if (p / "config.json").exists()):
        info = json.loads((d / MANIFEST).read_text()) if (d / MANIFEST).exists() else {}
        rows.append({"name": d.name, "path": str(d), "parameters": info.get("parameters")})
    return rows


def workspace_status(cfg, ws: Workspace) -> dict[str, Any]:
    return {"workspace": str(ws.home), "profile": cfg.name, "models": prepared_models(ws)}
