"""Records ↔ frames: Trajectory lists to contract frames and back, experience rows to retrieval records.

The encoding is the one :mod:`data_contracts.models` documents: nested structures become JSON text, per-token
arrays stay list cells, every row gets ``schema_version``. ``frame_to_trajectories(trajectories_to_frame(t))
== t`` for any well-formed list ``t`` (tested). Decoding accepts numpy arrays in list cells (LanceDB returns
them) and turns them back into plain Python lists.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import MISSING, fields
from typing import Any

import numpy as np
import pandas as pd

from data_contracts.models import (
    ABSENT,
    JSON_COLUMNS,
    SCHEMA_VERSION,
    EvaluationSchema,
    TrajectorySchema,
    contract_columns,
)
from lopd_core.records.experience import Experience
from lopd_core.records.trajectory import Trajectory

_LIST_FIELDS = ("token_ids", "assistant_mask", "sampling_logprobs")
_TRAJECTORY_JSON = JSON_COLUMNS["trajectories"]


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def trajectory_to_row(traj: Trajectory) -> dict[str, Any]:
    row = traj.to_dict()
    for name in _TRAJECTORY_JSON:
        row[name] = json.dumps(row[name], ensure_ascii=False, sort_keys=True)
    for name in _LIST_FIELDS:
        row[name] = list(row[name])
    row["schema_version"] = SCHEMA_VERSION
    return row


def trajectories_to_frame(trajectories: Iterable[Trajectory]) -> pd.DataFrame:
    """A frame in :class:`TrajectorySchema`'s column order (not yet validated)."""
    rows = [trajectory_to_row(t) for t in trajectories]
    return pd.DataFrame(rows, columns=contract_columns(TrajectorySchema))


REQUIRED_RECORD_FIELDS = ("policy_version",)
"""Fields with a default in :class:`Trajectory` that a loose record must still carry: which policy produced an
episode is provenance, and a guess ('base') would be a silent lie."""


def _encode_json(value: Any) -> Any:
    """A record's structured value as JSON text. A value that is already a string is encoded as a JSON
    string, so the contract's "JSON list/object" check refuses it instead of it being taken for JSON; a value
    JSON cannot hold (NaN, a set, an object) is left as it is, and the contract refuses it."""
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        return value


def records_to_trajectory_frame(records: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """A frame from loose dicts (e.g. JSONL lines), nothing converted: the record's defaults fill optional
    fields (never :data:`REQUIRED_RECORD_FIELDS`), nested values are JSON-encoded, and a missing required
    field holds :data:`~data_contracts.models.ABSENT` so validation quarantines that row and names the field.
    Unknown keys are kept as columns (:data:`ABSENT` in the rows without them), so validation quarantines
    exactly the rows that carry one, naming the key, instead of losing it."""
    defaults: dict[str, Any] = {}
    for f in fields(Trajectory):
        if f.name in REQUIRED_RECORD_FIELDS or f.name == "episode_id":
            continue
        if f.default is not MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not MISSING:
            defaults[f.name] = f.default_factory()
    rows = []
    for record in records:
        row = {**defaults, **record}
        if not row.get("trajectory_id") and row.get("episode_id"):
            row["trajectory_id"] = row["episode_id"]
        for name in _TRAJECTORY_JSON:
            if name in row:
                row[name] = _encode_json(row[name])
        row.setdefault("schema_version", SCHEMA_VERSION)
        rows.append(row)
    columns = contract_columns(TrajectorySchema)
    extra = sorted({k for r in rows for k in r} - set(columns), key=str)
    names = columns + extra
    return pd.DataFrame([[r.get(c, ABSENT) for c in names] for r in rows], columns=names, dtype=object)


def row_to_trajectory(row: dict[str, Any]) -> Trajectory:
    data = {k: _plain(v) for k, v in row.items()}
    for name in _TRAJECTORY_JSON:
        if isinstance(data.get(name), str):
            data[name] = json.loads(data[name])
    for name in _LIST_FIELDS:
        if name in data:
            data[name] = [_plain(x) for x in data[name]]
    names = {f.name for f in fields(Trajectory)}
    return Trajectory(**{k: v for k, v in data.items() if k in names})


def frame_to_trajectories(frame: pd.DataFrame) -> list[Trajectory]:
    """Decode a trajectories frame (as validated, or as read back from LanceDB)."""
    return [row_to_trajectory(row) for row in frame.to_dict(orient="records")]


def row_to_experience(row: dict[str, Any], *, score: float = 0.0) -> Experience:
    """A retrieval record (:class:`lopd_core.records.experience.Experience`) from an experiences row."""
    messages = row.get("messages", "[]")
    return Experience(
        experience_id=str(row["experience_id"]),
        episode_id=str(row["episode_id"]),
        task_id=str(row["task_id"]),
        suite=str(row.get("suite", "")),
        family=str(row.get("family", "")),
        instruction=str(row["instruction"]),
        text=str(row.get("text", "")),
        messages=json.loads(messages) if isinstance(messages, str) else list(messages or []),
        reward=float(row.get("reward", 1.0)),
        step=int(row.get("step", -1)),
        split=str(row.get("split", "train")),
        score=float(score),
    )


def frame_to_experiences(frame: pd.DataFrame) -> list[Experience]:
    return [row_to_experience(row) for row in frame.to_dict(orient="records")]


def evaluation_frame(trajectories: Iterable[Trajectory], *, eval_run_id: str, role: str, probe: str = "heldout",
                     cycle_id: str = "", composer_version: str = "none",
                     extra: dict[str, Any] | None = None) -> pd.DataFrame:
    """Evaluation rows (:class:`EvaluationSchema`, unvalidated) for scored episodes, one per trajectory.

    ``eval_row_id`` is ``{eval_run_id}/{probe}/{task_id}``, so re-scoring the same run is an idempotent upsert.
    Prompt-NLL rows (``probe='prompt_nll'``) have no trajectory; build those dicts directly.
    """
    rows = []
    for t in trajectories:
        rows.append({
            "eval_row_id": f"{eval_run_id}/{probe}/{t.task_id}", "eval_run_id": eval_run_id,
            "cycle_id": cycle_id or t.cycle_id, "role": role, "policy_version": t.policy_version,
            "composer_version": composer_version, "probe": probe, "suite": t.suite, "split": t.split,
            "task_id": t.task_id, "family": t.family, "status": t.status, "reward": float(t.reward),
            "success": bool(t.success), "response_tokens": int(t.n_generated), "n_tool_calls": int(t.n_tool_calls),
            "n_invalid_tool_calls": int(t.n_invalid_tool_calls), "nll": float("nan"),
            "trajectory_id": t.trajectory_id, "extra": json.dumps(extra or {}, sort_keys=True),
            "schema_version": SCHEMA_VERSION,
        })
    return pd.DataFrame(rows, columns=contract_columns(EvaluationSchema))
