"""Validation at a stage boundary: split a frame into valid rows and quarantine rows, never dropping one.

:func:`validate_frame` works in three passes, each charging a failure to its own row only:

1. the strict cell rules (:func:`cell_reasons`, rules in :mod:`data_contracts.models`) on the raw cells,
   before any coercion: an unknown field quarantines the rows that carry it (the reason names the field),
   a missing field, a wrong scalar type (``"False"`` for a boolean, ``1.7`` for an integer, ``true`` for a
   reward), an integer out of its column's range, text over its size limit;
2. the pandera model, lazily (all checks, all rows) on the rows that passed; failures pandera cannot
   attribute to a row make every remaining row invalid with that frame-level reason;
3. repeated idempotency keys among the valid rows (``duplicate_key``; the first occurrence stays valid).

Each failing row becomes a quarantine row (``reason`` = the failed checks, prefixed with the row's label such
as ``line 7`` when the caller gives one; ``payload`` = the row as JSON). Identical bad rows get distinct
quarantine ids (a counter of identical payloads), so they never collide.

``len(valid) + len(quarantine) == len(frame)`` always holds. :class:`StageQualityError` is raised only when
the bad share exceeds the configured limit (``cfg.curation.max_bad_row_fraction``); it carries both frames
so the caller can persist the quarantine rows before failing.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd
import pandera.pandas as pa

from data_contracts.models import (
    ABSENT,
    MAX_MESSAGES_BYTES,
    MAX_TEXT_BYTES,
    SCHEMA_VERSION,
    QuarantineSchema,
    cell_problem,
    contract_key,
    contract_name,
    missing_problem,
    preview,
    scalar_columns,
)

_MAX_PASSES = 3


class StageQualityError(RuntimeError):
    """Too many rows of a stage failed their contract. ``quarantine`` holds them (with reasons)."""

    def __init__(self, message: str, *, valid: pd.DataFrame, quarantine: pd.DataFrame, bad_fraction: float):
        super().__init__(message)
        self.valid = valid
        self.quarantine = quarantine
        self.bad_fraction = bad_fraction


PAYLOAD_CELL_BYTES = MAX_MESSAGES_BYTES
"""A quarantine payload keeps each cell whole up to this many UTF-8 bytes of JSON; a larger cell (a 20 MB
instruction, a huge unknown field) is kept as its first :data:`MAX_TEXT_BYTES` characters followed by a
marker with its full size and sha256, so a hostile row cannot fill the quarantine table either."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return [_jsonable(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return _jsonable(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return repr(value)


def _capped(value: Any) -> Any:
    """``value`` as JSON-able data, or a cut string with a marker when its JSON is over PAYLOAD_CELL_BYTES."""
    data = _jsonable(value)
    if isinstance(data, str):
        if len(data) * 4 <= PAYLOAD_CELL_BYTES:
            return data
        raw = data.encode("utf-8", "surrogatepass")
        text = data
    elif isinstance(data, list | dict):
        if isinstance(data, list) and len(data) * 24 <= PAYLOAD_CELL_BYTES and all(
                not isinstance(x, list | dict | str) for x in data):
            return data  # a short flat list (per-token arrays) is always small enough
        text = json.dumps(data, sort_keys=True)
        raw = text.encode("utf-8", "surrogatepass")
    else:
        return data
    if len(raw) <= PAYLOAD_CELL_BYTES:
        return data
    digest = hashlib.sha256(raw).hexdigest()
    return f"{text[:MAX_TEXT_BYTES]}…[cut in quarantine: {len(raw)} bytes in all, sha256 {digest}]"


def row_payload(row: pd.Series) -> str:
    """The row as canonical JSON (sorted keys), safe for any cell content (fields the record lacked are left out,
    oversized cells are cut with a marker, see :data:`PAYLOAD_CELL_BYTES`)."""
    return json.dumps({str(k): _capped(v) for k, v in row.items() if v is not ABSENT}, sort_keys=True)


def _failure_label(case: pd.Series) -> str:
    column = case.get("column")
    check = str(case.get("check"))
    if case.get("schema_context") == "DataFrameSchema" or column is None or column != column:
        return check
    got = case.get("failure_case")
    if isinstance(got, int | float | bool | np.generic) or (isinstance(got, str) and len(got) <= 80):
        return f"{column}: {check} (got {preview(got)})"
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
                label = f"{what} {preview(case['failure_case'])}"
            frame_level.add(label)
        else:
            per_row[idx].add(label)
    return per_row, frame_level


def _unknown_field(name: Any, contract: str) -> str:
    return f"unknown field {preview(str(name))}: not in the {contract} contract (remove it, or fix its spelling)"


def cell_reasons(frame: pd.DataFrame, model: type[pa.DataFrameModel]) -> dict[Any, set[str]]:
    """Per row index, the problems the strict cell rules of :mod:`data_contracts.models` find before any
    coercion: unknown fields (only rows that have a value there), missing fields, wrong scalar types, values
    out of a column's range, text over its size limit."""
    reasons: dict[Any, set[str]] = defaultdict(set)
    columns = model.to_schema().columns
    scalars = scalar_columns(model)
    contract = contract_name(model)
    for name in frame.columns:
        if name in columns:
            continue
        for idx, value in frame[name].items():
            if value is not ABSENT and not (isinstance(value, float) and math.isnan(value)):
                reasons[idx].add(_unknown_field(name, contract))
    for name in columns:
        if name not in frame.columns:
            for idx in frame.index:
                reasons[idx].add(missing_problem(name))
            continue
        series = frame[name]
        kind, nullable = scalars.get(name, (None, False))
        dtype = series.dtype
        if kind == "int" and pd.api.types.is_signed_integer_dtype(dtype):
            continue  # an int64 (or narrower) column holds integers in range by construction
        if kind == "bool" and pd.api.types.is_bool_dtype(dtype):
            continue
        if kind == "float" and (pd.api.types.is_float_dtype(dtype) or pd.api.types.is_signed_integer_dtype(dtype)):
            values = series.to_numpy(dtype=np.float64)
            bad = ~np.isfinite(values) if not nullable else np.isinf(values)
            series = series[bad]
        if kind is None and not pd.api.types.is_object_dtype(dtype):
            continue
        for idx, value in zip(series.index, series.tolist(), strict=True):
            problem = cell_problem(name, kind, value, nullable=nullable)
            if problem:
                reasons[idx].add(problem)
    return reasons


def _duplicate_keys(frame: pd.DataFrame, key: str) -> dict[Any, set[str]]:
    if key not in frame.columns:
        return {}
    keys = frame[key]
    is_str = np.array([isinstance(v, str) for v in keys.tolist()], dtype=bool)
    dup = is_str & keys.duplicated(keep="first").to_numpy(dtype=bool)
    return {idx: {f"duplicate_key: {key} repeats an earlier row (the first one is kept)"} for idx in frame.index[dup]}


def validate_frame(frame: pd.DataFrame, model: type[pa.DataFrameModel], *, stage: str = "", cycle_id: str = "",
                   max_bad_fraction: float | None = None,
                   row_labels: Sequence[str] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Split ``frame`` into (valid rows, coerced by the model; quarantine rows in :class:`QuarantineSchema`).

    First the strict cell rules (:func:`cell_reasons`), then the model's checks on the rows that passed, then
    repeated keys among the valid rows: every failure is charged to its own row only. ``row_labels`` (one per
    row, e.g. ``"line 7"``) prefix the quarantine ``reason``. ``max_bad_fraction``: when given and
    ``len(quarantine) / len(frame)`` exceeds it, raise :class:`StageQualityError` (carrying both frames).
    The frame's index is reset.
    """
    frame = frame.reset_index(drop=True)
    if row_labels is not None and len(row_labels) != len(frame):
        raise ValueError(f"row_labels has {len(row_labels)} labels for {len(frame)} rows")
    key = contract_key(model)
    columns = list(model.to_schema().columns)
    reasons: dict[Any, set[str]] = defaultdict(set)
    for idx, why in cell_reasons(frame, model).items():
        reasons[idx] |= why
    remaining = frame.drop(index=list(reasons))
    remaining = remaining[[c for c in remaining.columns if c in columns]]
    valid = remaining.iloc[0:0]
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
    duplicates = _duplicate_keys(valid, key)
    for idx, why in duplicates.items():
        reasons[idx] |= why
    valid = valid.drop(index=list(duplicates))
    labels = dict(enumerate(row_labels)) if row_labels is not None else None
    quarantine = quarantine_rows(frame.loc[sorted(reasons)], reasons, contract=contract_name(model), key=key,
                                 stage=stage, cycle_id=cycle_id, labels=labels)
    if max_bad_fraction is not None:
        enforce_bad_share(n_total=len(frame), n_bad=len(quarantine), limit=max_bad_fraction, stage=stage,
                          contract=contract_name(model), valid=valid, quarantine=quarantine)
    return valid.reset_index(drop=True), quarantine


def _row_key(row: pd.Series, key: str) -> str:
    value = row.get(key) if key else None
    ok = isinstance(value, str) and cell_problem(key, "str", value) is None
    return value if ok else ""


def quarantine_rows(bad: pd.DataFrame, reasons: dict[Any, set[str]], *, contract: str, key: str = "",
                    stage: str = "", cycle_id: str = "", labels: dict[Any, str] | None = None) -> pd.DataFrame:
    """Quarantine rows for ``bad`` (its index looks up ``reasons`` and ``labels``), valid under
    :class:`QuarantineSchema`. ``quarantine_id`` hashes (contract, payload, n), n = how many identical payloads
    came earlier in ``bad``: identical bad rows are kept apart, and writing the same rows again is idempotent."""
    now = datetime.now(UTC).isoformat(timespec="seconds")
    rows = []
    seen: dict[str, int] = defaultdict(int)
    for idx, row in bad.iterrows():
        payload = row_payload(row)
        checks = sorted(reasons.get(idx, {"unspecified"}))
        digest = hashlib.sha256(f"{contract}\n{payload}".encode()).hexdigest()
        occurrence = seen[digest]
        seen[digest] += 1
        quarantine_id = digest[:32] if not occurrence else \
            hashlib.sha256(f"{digest}\n{occurrence}".encode()).hexdigest()[:32]
        label = (labels or {}).get(idx)
        reason = "; ".join(checks)
        rows.append({
            "quarantine_id": quarantine_id,
            "contract": contract,
            "stage": stage,
            "cycle_id": cycle_id,
            "row_key": _row_key(row, key),
            "reason": f"{label}: {reason}" if label else reason,
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
