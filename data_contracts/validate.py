"""Validation at a stage boundary: split a frame into valid rows and quarantine rows, never dropping one.

:func:`validate_frame` runs the pandera model lazily (all checks, all rows), attributes every failure to
its row and turns each failing row into a quarantine row (``reason`` = the failed checks, ``payload`` = the
row as JSON). Failures pandera cannot attribute to a row (a missing or unknown column, a dtype the whole
column fails) make *every* row invalid with that frame-level reason — the producer is broken, and the
bad-share limit then fails the stage. Rows that repeat an earlier row's idempotency key are quarantined
with ``duplicate_key`` (the first occurrence stays valid).

``len(valid) + len(quarantine) == len(frame)`` always holds. :class:`StageQualityError` is raised only when
the bad share exceeds the configured limit (``cfg.curation.max_bad_row_fraction``); it carries both frames
so the caller can persist the quarantine rows before failing.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd
import pandera.pandas as pa

from data_contracts.models import SCHEMA_VERSION, QuarantineSchema, contract_key, contract_name

_MAX_PASSES = 3


class StageQualityError(RuntimeError):
    """Too many rows of a stage failed their contract. ``quarantine`` holds them (with reasons)."""

    def __init__(self, message: str, *, valid: pd.DataFrame, quarantine: pd.DataFrame, bad_fraction: float):
        super().__init__(message)
        self.valid = valid
        self.quarantine = quarantine
        self.bad_fraction = bad_fraction


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return repr(value)


def row_payload(row: pd.Series) -> str:
    """The row as canonical JSON (sorted keys), safe for any cell content."""
    return json.dumps({str(k): _jsonable(v) for k, v in row.items()}, sort_keys=True)


def _failure_label(case: pd.Series) -> str:
    column = case.get("column")
    check = str(case.get("check"))
    if case.get("schema_context") == "DataFrameSchema" or column is None or column != column:
        return check
    return f"{column}: {check}"


def _attribute_failures(err: pa.errors.SchemaErrors) -> tuple[dict[Any, set[str]], set[str]]:
    """Failed checks per row index, and the frame-level failures that name no row."""
    per_row: dict[Any, set[str]] = defaultdict(set)
    frame_level: set[str] = set()
    cases = err.failure_cases
    for _, case in cases.iterrows():
        idx = case.get("index")
        label = _failure_label(case)
        if idx is None or (isinstance(idx, float) and math.isnan(idx)):
            if case.get("check") in ("column_in_schema", "column_in_dataframe"):
                what = "unknown column" if case["check"] == "column_in_schema" else "missing column"
                label = f"{what} '{case['failure_case']}'"
            frame_level.add(label)
        else:
            per_row[idx].add(label)
    return per_row, frame_level


def _duplicate_keys(frame: pd.DataFrame, key: str) -> dict[Any, set[str]]:
    if key not in frame.columns:
        return {}
    dup = frame[key].map(lambda v: v if isinstance(v, str) else repr(v)).duplicated(keep="first")
    return {idx: {f"duplicate_key: {key} repeats an earlier row"} for idx in frame.index[dup]}


def validate_frame(frame: pd.DataFrame, model: type[pa.DataFrameModel], *, stage: str = "", cycle_id: str = "",
                   max_bad_fraction: float | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Split ``frame`` into (valid rows, coerced by the model; quarantine rows in :class:`QuarantineSchema`).

    ``max_bad_fraction``: when given and ``len(quarantine) / len(frame)`` exceeds it, raise
    :class:`StageQualityError` (carrying both frames). The frame's index is reset.
    """
    frame = frame.reset_index(drop=True)
    key = contract_key(model)
    reasons: dict[Any, set[str]] = defaultdict(set)
    for idx, why in _duplicate_keys(frame, key).items():
        reasons[idx] |= why
    valid = pd.DataFrame(columns=frame.columns)
    remaining = frame.drop(index=list(reasons))
    for _ in range(_MAX_PASSES):
        if remaining.empty:
            valid = remaining
            break
        try:
            valid = model.validate(remaining, lazy=True)
            break
        except pa.errors.SchemaErrors as err:
            per_row, frame_level = _attribute_failures(err)
            if not per_row:
                # Nothing row-specific: the frame as a whole breaks the contract.
                for idx in remaining.index:
                    reasons[idx] |= frame_level or {"schema_error: the frame does not satisfy the contract"}
                remaining = remaining.iloc[0:0]
                continue
            for idx, why in per_row.items():
                reasons[idx] |= why
            remaining = remaining.drop(index=[i for i in per_row if i in remaining.index])
    else:
        for idx in remaining.index:
            reasons[idx].add("schema_error: validation did not converge")
        valid = remaining.iloc[0:0]
    quarantine = quarantine_rows(frame.loc[sorted(reasons)], reasons, contract=contract_name(model), key=key,
                                 stage=stage, cycle_id=cycle_id)
    if max_bad_fraction is not None:
        enforce_bad_share(n_total=len(frame), n_bad=len(quarantine), limit=max_bad_fraction, stage=stage,
                          contract=contract_name(model), valid=valid, quarantine=quarantine)
    return valid.reset_index(drop=True), quarantine


def quarantine_rows(bad: pd.DataFrame, reasons: dict[Any, set[str]], *, contract: str, key: str = "",
                    stage: str = "", cycle_id: str = "") -> pd.DataFrame:
    """Quarantine rows for ``bad`` (its index looks up ``reasons``), valid under :class:`QuarantineSchema`."""
    now = datetime.now(UTC).isoformat(timespec="seconds")
    rows = []
    for idx, row in bad.iterrows():
        payload = row_payload(row)
        checks = sorted(reasons.get(idx, {"unspecified"}))
        row_key = row.get(key) if key else ""
        rows.append({
            "quarantine_id": hashlib.sha256(f"{contract}\n{payload}".encode()).hexdigest()[:32],
            "contract": contract,
            "stage": stage,
            "cycle_id": cycle_id,
            "row_key": row_key if isinstance(row_key, str) else "",
            "reason": "; ".join(checks),
            "failed_checks": json.dumps(checks),
            "payload": payload,
            "created_at": now,
            "schema_version": SCHEMA_VERSION,
        })
    columns = list(QuarantineSchema.to_schema().columns)
    out = pd.DataFrame(rows, columns=columns)
    return QuarantineSchema.validate(out) if len(out) else out


def enforce_bad_share(*, n_total: int, n_bad: int, limit: float, stage: str = "", contract: str = "",
                      valid: pd.DataFrame | None = None, quarantine: pd.DataFrame | None = None) -> float:
    """Return the bad share; raise :class:`StageQualityError` when it exceeds ``limit``."""
    share = n_bad / n_total if n_total else 0.0
    if share > limit:
        examples = []
        if quarantine is not None and len(quarantine):
            examples = [f"{r.row_key or '?'}: {r.reason}" for r in quarantine.head(3).itertuples()]
        seen = f" (e.g. {'; '.join(examples)})" if examples else ""
        raise StageQualityError(
            f"stage '{stage or '?'}': {n_bad} of {n_total} {contract} rows ({share:.0%}) failed their contract, "
            f"more than curation.max_bad_row_fraction={limit:g}. The rows are in the quarantine table with the "
            f"failed checks{seen}; fix the producer, or raise the limit with --set curation.max_bad_row_fraction=…",
            valid=valid if valid is not None else pd.DataFrame(),
            quarantine=quarantine if quarantine is not None else pd.DataFrame(),
            bad_fraction=share,
        )
    return share
