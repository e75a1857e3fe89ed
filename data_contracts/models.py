"""The pandera models: one strict DataFrameModel per frame that crosses a stage boundary.

What a frame looks like (the *representation* choice, used by every stage and by the LanceDB tables):

- one row per record, one column per field of the record, plus ``schema_version`` (= :data:`SCHEMA_VERSION`,
  written into every row so a stored table says which contract its rows were checked against);
- **per-token arrays** (``token_ids``, ``assistant_mask``, ``sampling_logprobs``) and **vectors** are list
  cells (Python lists; numpy arrays are accepted too, e.g. when a frame comes back from LanceDB). In
  LanceDB they are Arrow list columns (see :data:`ARROW_LIST_TYPES`), so the trainer can read them without
  parsing;
- **nested, free-form structures** (``messages``, ``tools``, ``checklist``, ``sampling``, ``timings``,
  ``messages_lite``, evaluation ``extra``, quarantine ``payload``/``failed_checks``) are **JSON text**
  (:data:`JSON_COLUMNS`): their shape differs between suites, and a JSON string survives every storage
  layer unchanged. :mod:`data_contracts.convert` does the encoding.

Models are ``strict`` (an unknown column is an error, a missing one too). Scalar cells are checked **before**
any dtype coercion by :func:`cell_problem` (run per row by :func:`data_contracts.validate.validate_frame`):
an integer column takes integers only (an integral float such as ``3.0`` is exact and accepted; ``1.7``,
``True`` and ``"3"`` are refused), a float column takes finite numbers but never a boolean, a boolean column
takes ``True``/``False`` only (never ``"False"``, ``"no"`` or ``1``), a text column takes strings only, at most
:func:`text_limit` UTF-8 bytes (:data:`MAX_TEXT_BYTES`, :data:`MAX_MESSAGES_BYTES`, :data:`MAX_JSON_BYTES`).
Only what passes is ``coerce``d to the column dtype, so coercion normalises a type and never changes a value.
Per-token arrays are bounded by their storage types (:data:`MAX_TOKEN_ID`: token ids are int32 in LanceDB)
and by :data:`MAX_TOKENS`. A cell holding :data:`ABSENT` is a field the record did not have.
Cross-column rules are ``dataframe_check``s that answer per row, so a failure names the rows and the rule
(the rule's ``name`` is what lands in the quarantine ``reason``). Each model names its idempotency key
in ``Config.metadata["key"]``; :func:`data_contracts.validate.validate_frame` also rejects repeated keys.
``Config.metadata["volatile"]`` lists columns a re-write does not count as a change (the quarantine time).

This module is the contract only: validation with quarantine is :mod:`data_contracts.validate`.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import numpy as np
import pandas as pd
import pandera.pandas as pa
from pandera.typing import Series

from lopd_core.records.experience import CONTENT_DIM

SCHEMA_VERSION = 1
"""Bumped whenever a model below changes incompatibly; stored in every row and tagged on model versions."""

SPLITS = ("train", "validation", "test")
STATUSES = ("ok", "truncated", "error")
SUITE_KINDS = ("tool", "code")
ROLES = ("system", "user", "assistant", "tool")

JSON_COLUMNS = {
    "trajectories": ("messages", "tools", "checklist", "sampling", "timings", "messages_lite"),
    "experiences": ("messages",),
    "evaluations": ("extra",),
    "quarantine": ("failed_checks", "payload"),
}
ARROW_LIST_TYPES = {
    "token_ids": "int32",
    "assistant_mask": "int8",
    "sampling_logprobs": "float64",
    "content_vector": "float32",
    "vector": "float32",
}
"""Element type of each list column in LanceDB (``vector`` is a fixed-size list of the embedder's dim)."""

# --------------------------------------------------------------------------------------------------
# Limits: what one cell may hold. A row over a limit is quarantined with the limit named (stored data is never
# cut; only a quarantine payload's oversized cells are, see data_contracts.validate.PAYLOAD_CELL_BYTES).
MAX_TEXT_BYTES = 64 * 1024
"""UTF-8 bytes of one plain text cell (instruction, feedback, error, observation_lite, ids, names, …)."""
MAX_MESSAGES_BYTES = 4 * 1024 * 1024
"""UTF-8 bytes of a chat-messages JSON cell (``messages``, ``messages_lite``)."""
MAX_JSON_BYTES = 1024 * 1024
"""UTF-8 bytes of the other JSON cells (``tools``, ``checklist``, ``sampling``, ``timings``, ``extra``) and of a
quarantine ``reason``."""
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
"""UTF-8 bytes of a quarantine ``payload`` (built by lopd; each of its cells is capped, see validate.py)."""
MAX_TOKENS = 262_144
"""Length of a trajectory's per-token arrays (``token_ids``, ``assistant_mask``, ``sampling_logprobs``)."""
MAX_TOKEN_ID = 2**31 - 1
"""Largest token id: ``token_ids`` are stored as int32 (:data:`ARROW_LIST_TYPES`)."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Range of an integer column (int64 in pandas and LanceDB)."""
FLOAT32_MAX = float(np.finfo(np.float32).max)
"""Largest magnitude of an element of a float32 vector column."""

_TEXT_LIMITS = {
    "messages": MAX_MESSAGES_BYTES, "messages_lite": MAX_MESSAGES_BYTES,
    "tools": MAX_JSON_BYTES, "checklist": MAX_JSON_BYTES, "sampling": MAX_JSON_BYTES, "timings": MAX_JSON_BYTES,
    "extra": MAX_JSON_BYTES, "failed_checks": MAX_JSON_BYTES, "reason": MAX_JSON_BYTES,
    "payload": MAX_PAYLOAD_BYTES,
}


def text_limit(column: str) -> int:
    """The UTF-8 byte limit of a text cell of ``column`` (the same in every contract)."""
    return _TEXT_LIMITS.get(column, MAX_TEXT_BYTES)


class _Absent:
    """The marker of a field a record did not have (distinct from ``None``, an explicit null)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ABSENT"

    def __reduce__(self):
        return (_Absent, ())


ABSENT = _Absent()
"""Cell value of a field missing from its record (see :func:`data_contracts.convert.records_to_trajectory_frame`)."""


# --------------------------------------------------------------------------------------------------
# helpers for checks: they answer False for a malformed cell instead of raising, so one bad row can
# never hide the verdict on the others.
def as_list(value: Any) -> list | None:
    if isinstance(value, list):
        return value
    if isinstance(value, tuple | np.ndarray):
        return list(value)
    return None


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def _is_real(x: Any) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool | np.bool_)


def _json_is(value: Any, kind: type) -> bool:
    if not isinstance(value, str):
        return False
    try:
        return isinstance(json.loads(value), kind)
    except ValueError:
        return False


def _json_len(value: Any) -> int | None:
    try:
        parsed = json.loads(value) if isinstance(value, str) else None
    except ValueError:
        return None
    return len(parsed) if isinstance(parsed, list) else None


def _messages_ok(value: Any) -> bool:
    try:
        parsed = json.loads(value) if isinstance(value, str) else None
    except ValueError:
        return False
    return isinstance(parsed, list) and all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content", ""), str | type(None))
        for m in parsed
    )


def _rowwise(df: pd.DataFrame, fn) -> pd.Series:
    return pd.Series([bool(fn(row)) for row in df.itertuples(index=False)], index=df.index, dtype=bool)


def _safe(fn):
    def wrapped(row):
        try:
            return fn(row)
        except (TypeError, ValueError, AttributeError, KeyError, IndexError):
            return False

    return wrapped


def _non_empty(s: pd.Series) -> pd.Series:
    return s.map(lambda v: isinstance(v, str) and v.strip() != "")


def _vector_ok(value: Any, dim: int | None = None) -> bool:
    vec = as_list(value)
    if vec is None or not vec or (dim is not None and len(vec) != dim):
        return False
    return all(_is_real(x) and math.isfinite(x) and abs(x) <= FLOAT32_MAX for x in vec)


def _suite_name_ok(value: Any) -> bool:
    """A stored suite is a name (plug-in suites record their ``name``), never a path: stages look suites up by
    this value (:func:`lopd_core.envs.suite_kind`), and a path would import a plug-in's Python from a data row."""
    return isinstance(value, str) and not any(c in value for c in "/\\") and \
        not value.lower().endswith((".yaml", ".yml"))


def _token_ids_ok(value: Any) -> bool:
    ids = as_list(value)
    return ids is not None and all(_is_int(x) and 0 <= x <= MAX_TOKEN_ID for x in ids)


def _length_at_most(value: Any, limit: int) -> bool:
    items = as_list(value)
    return items is not None and len(items) <= limit


def _check(*columns: str, name: str):
    """``pa.check`` whose name survives inheritance: pandera (0.35) pops ``name`` the first time a model's
    schema is built, so a subclass built later (IndexedExperienceSchema) would name the check after its
    function (``_content_vector``) in quarantine reasons; the function's own name is the fallback it uses."""
    def wrap(fn):
        fn.__name__ = name
        return pa.check(*columns, name=name)(fn)
    return wrap


def _dataframe_check(*, name: str):
    """``pa.dataframe_check`` with the same fix as :func:`_check`."""
    def wrap(fn):
        fn.__name__ = name
        return pa.dataframe_check(name=name)(fn)
    return wrap


# --------------------------------------------------------------------------------------------------
class TrajectorySchema(pa.DataFrameModel):
    """Every rollout, errored ones included: the fields of :class:`lopd_core.records.trajectory.Trajectory`."""

    trajectory_id: Series[str] = pa.Field(str_length={"min_value": 1})
    episode_id: Series[str] = pa.Field(str_length={"min_value": 1})
    task_id: Series[str] = pa.Field(str_length={"min_value": 1})
    suite: Series[str] = pa.Field(str_length={"min_value": 1})
    family: Series[str]
    split: Series[str] = pa.Field(isin=SPLITS)
    level: Series[int] = pa.Field(ge=0)
    instruction: Series[str]
    messages: Series[str]
    initial_messages: Series[int] = pa.Field(ge=0)
    tools: Series[str]
    token_ids: Series[object]
    prompt_len: Series[int] = pa.Field(ge=0)
    assistant_mask: Series[object]
    sampling_logprobs: Series[object]
    reward: Series[float] = pa.Field(in_range={"min_value": 0.0, "max_value": 1.0})
    success: Series[bool]
    feedback: Series[str]
    checklist: Series[str]
    status: Series[str] = pa.Field(isin=STATUSES)
    error: Series[str]
    policy_version: Series[str] = pa.Field(str_length={"min_value": 1})
    composer_version: Series[str] = pa.Field(str_length={"min_value": 1})
    engine: Series[str]
    sampling: Series[str]
    timings: Series[str]
    n_turns: Series[int] = pa.Field(ge=0)
    n_tool_calls: Series[int] = pa.Field(ge=0)
    n_invalid_tool_calls: Series[int] = pa.Field(ge=0)
    observation_lite: Series[str]
    messages_lite: Series[str]
    cycle_id: Series[str]
    step: Series[int] = pa.Field(ge=-1)
    schema_version: Series[int] = pa.Field(isin=[SCHEMA_VERSION])

    class Config:
        strict = True
        coerce = True
        name = "trajectories"
        metadata = {"key": "trajectory_id"}

    @_check("messages", name="messages_json_list_of_chat_messages")
    def _messages(cls, s: pd.Series) -> pd.Series:
        return s.map(_messages_ok)

    @_check("suite", name="suite_is_a_name_not_a_path")
    def _suite_name(cls, s: pd.Series) -> pd.Series:
        return s.map(_suite_name_ok)

    @_check("messages_lite", name="messages_lite_json_list_of_chat_messages")
    def _messages_lite(cls, s: pd.Series) -> pd.Series:
        return s.map(_messages_ok)

    @_check("tools", name="tools_json_list")
    def _tools(cls, s: pd.Series) -> pd.Series:
        return s.map(lambda v: _json_is(v, list))

    @_check("checklist", "sampling", "timings", name="json_object")
    def _json_objects(cls, s: pd.Series) -> pd.Series:
        return s.map(lambda v: _json_is(v, dict))

    @_check("token_ids", name=f"token_ids_list_of_ints_in_0_to_{MAX_TOKEN_ID}")
    def _token_ids(cls, s: pd.Series) -> pd.Series:
        return s.map(_token_ids_ok)

    @_check("token_ids", name=f"token_ids_at_most_{MAX_TOKENS}_tokens")
    def _n_tokens(cls, s: pd.Series) -> pd.Series:
        return s.map(lambda v: _length_at_most(v, MAX_TOKENS))

    @_check("assistant_mask", name="assistant_mask_list_of_0_1")
    def _mask(cls, s: pd.Series) -> pd.Series:
        return s.map(lambda v: (m := as_list(v)) is not None and all(_is_int(x) and x in (0, 1) for x in m))

    @_check("sampling_logprobs", name="sampling_logprobs_finite_and_le_0")
    def _logprobs(cls, s: pd.Series) -> pd.Series:
        return s.map(
            lambda v: (lp := as_list(v)) is not None and all(_is_real(x) and math.isfinite(x) and x <= 0.0 for x in lp)
        )

    @_dataframe_check(name="mask_length_matches_token_ids")
    def _mask_len(cls, df: pd.DataFrame) -> pd.Series:
        return _rowwise(df, _safe(lambda r: len(as_list(r.assistant_mask)) == len(as_list(r.token_ids))))

    @_dataframe_check(name="logprobs_length_matches_token_ids")
    def _lp_len(cls, df: pd.DataFrame) -> pd.Series:
        return _rowwise(df, _safe(lambda r: len(as_list(r.sampling_logprobs)) == len(as_list(r.token_ids))))

    @_dataframe_check(name="prompt_len_within_token_ids_and_prompt_unmasked")
    def _prompt_len(cls, df: pd.DataFrame) -> pd.Series:
        def ok(r):
            mask = as_list(r.assistant_mask)
            return int(r.prompt_len) <= len(as_list(r.token_ids)) and not any(mask[: int(r.prompt_len)])

        return _rowwise(df, _safe(ok))

    @_dataframe_check(name="logprobs_zero_outside_assistant_mask")
    def _lp_outside(cls, df: pd.DataFrame) -> pd.Series:
        def ok(r):
            pairs = zip(as_list(r.assistant_mask), as_list(r.sampling_logprobs), strict=True)
            return all(lp == 0.0 for m, lp in pairs if m == 0)

        return _rowwise(df, _safe(ok))

    @_dataframe_check(name="ok_status_has_assistant_tokens")
    def _ok_has_tokens(cls, df: pd.DataFrame) -> pd.Series:
        return _rowwise(df, _safe(lambda r: r.status != "ok" or sum(as_list(r.assistant_mask)) > 0))

    @_dataframe_check(name="error_status_has_error_message")
    def _error_message(cls, df: pd.DataFrame) -> pd.Series:
        return _rowwise(df, _safe(lambda r: r.status != "error" or bool(str(r.error).strip())))

    @_dataframe_check(name="initial_messages_within_messages")
    def _initial(cls, df: pd.DataFrame) -> pd.Series:
        return _rowwise(df, _safe(lambda r: int(r.initial_messages) <= _json_len(r.messages)))


# --------------------------------------------------------------------------------------------------
class ExperienceSchema(pa.DataFrameModel):
    """A curated success (the ``curated`` table): train split only, observation-lite text, no embedding yet."""

    experience_id: Series[str] = pa.Field(str_length={"min_value": 1})
    trajectory_id: Series[str] = pa.Field(str_length={"min_value": 1})
    episode_id: Series[str] = pa.Field(str_length={"min_value": 1})
    task_id: Series[str] = pa.Field(str_length={"min_value": 1})
    suite: Series[str] = pa.Field(str_length={"min_value": 1})
    suite_kind: Series[str] = pa.Field(isin=SUITE_KINDS)
    family: Series[str]
    split: Series[str] = pa.Field(isin=["train"])
    level: Series[int] = pa.Field(ge=0)
    instruction: Series[str] = pa.Field(str_length={"min_value": 1})
    text: Series[str] = pa.Field(str_length={"min_value": 1})
    messages: Series[str]
    reward: Series[float] = pa.Field(in_range={"min_value": 0.0, "max_value": 1.0})
    step: Series[int] = pa.Field(ge=-1)
    cycle_id: Series[str]
    policy_version: Series[str] = pa.Field(str_length={"min_value": 1})
    n_tokens: Series[int] = pa.Field(ge=0)
    content_vector: Series[object]
    schema_version: Series[int] = pa.Field(isin=[SCHEMA_VERSION])

    class Config:
        strict = True
        coerce = True
        name = "experiences"
        metadata = {"key": "experience_id"}

    @_check("messages", name="messages_json_list_of_chat_messages")
    def _messages(cls, s: pd.Series) -> pd.Series:
        return s.map(_messages_ok)

    @_check("content_vector", name="content_vector_finite_float32_of_content_dim")
    def _content_vector(cls, s: pd.Series) -> pd.Series:
        return s.map(lambda v: _vector_ok(v, CONTENT_DIM))


class IndexedExperienceSchema(ExperienceSchema):
    """An experience in the ``experiences`` table: the curated row plus its retrieval embedding."""

    vector: Series[object]
    embedder: Series[str] = pa.Field(str_length={"min_value": 1})
    embed_field: Series[str] = pa.Field(isin=["task", "task_and_trajectory"])

    class Config:
        strict = True
        coerce = True
        name = "indexed_experiences"
        metadata = {"key": "experience_id"}

    @_check("vector", name="vector_finite_float32_and_unit_norm")
    def _vector(cls, s: pd.Series) -> pd.Series:
        def ok(v):
            return _vector_ok(v) and abs(float(np.linalg.norm(np.asarray(v, dtype=np.float64))) - 1.0) < 1e-3

        return s.map(ok)

    @_dataframe_check(name="vectors_share_one_dimension")
    def _one_dim(cls, df: pd.DataFrame) -> pd.Series:
        lengths = df["vector"].map(lambda v: len(as_list(v) or []))
        common = lengths.mode().iloc[0] if len(lengths) else 0
        return lengths == common


# --------------------------------------------------------------------------------------------------
class EvaluationSchema(pa.DataFrameModel):
    """One scored item of an evaluation run: a held-out episode, a probe episode or a general-prompt NLL."""

    eval_row_id: Series[str] = pa.Field(str_length={"min_value": 1})
    """Idempotency key, e.g. ``{eval_run_id}/{probe}/{task_id}``."""
    eval_run_id: Series[str] = pa.Field(str_length={"min_value": 1})
    cycle_id: Series[str]
    role: Series[str] = pa.Field(isin=["base", "champion", "challenger", "candidate"])
    policy_version: Series[str] = pa.Field(str_length={"min_value": 1})
    composer_version: Series[str]
    probe: Series[str] = pa.Field(isin=["heldout", "forgetting", "prompt_nll"])
    suite: Series[str]
    split: Series[str] = pa.Field(isin=SPLITS)
    task_id: Series[str] = pa.Field(str_length={"min_value": 1})
    family: Series[str]
    status: Series[str] = pa.Field(isin=STATUSES)
    reward: Series[float] = pa.Field(in_range={"min_value": 0.0, "max_value": 1.0})
    success: Series[bool]
    response_tokens: Series[int] = pa.Field(ge=0)
    n_tool_calls: Series[int] = pa.Field(ge=0)
    n_invalid_tool_calls: Series[int] = pa.Field(ge=0)
    nll: Series[float] = pa.Field(nullable=True)
    """Mean NLL in nats/token (prompt_nll probe); NaN for episode rows."""
    trajectory_id: Series[str]
    """The evaluated episode in the trajectories table ('' for prompt_nll rows)."""
    extra: Series[str]
    schema_version: Series[int] = pa.Field(isin=[SCHEMA_VERSION])

    class Config:
        strict = True
        coerce = True
        name = "evaluations"
        metadata = {"key": "eval_row_id"}

    @_check("extra", name="json_object")
    def _extra(cls, s: pd.Series) -> pd.Series:
        return s.map(lambda v: _json_is(v, dict))

    @_dataframe_check(name="eval_split_is_test_for_heldout_and_forgetting")
    def _heldout(cls, df: pd.DataFrame) -> pd.Series:
        return _rowwise(df, _safe(lambda r: r.probe == "prompt_nll" or r.split == "test"))

    @_dataframe_check(name="nll_finite_non_negative_for_prompt_nll")
    def _nll(cls, df: pd.DataFrame) -> pd.Series:
        return _rowwise(df, _safe(lambda r: r.probe != "prompt_nll" or (math.isfinite(r.nll) and r.nll >= 0)))


# --------------------------------------------------------------------------------------------------
class QuarantineSchema(pa.DataFrameModel):
    """A rejected row, kept whole (``payload``) with the checks it failed."""

    quarantine_id: Series[str] = pa.Field(str_length={"min_value": 1})
    """Hash of (contract, payload, n): n counts identical payloads earlier in the same write, so the same bad
    row written again is one row, and two identical bad rows of one write are two rows."""
    contract: Series[str] = pa.Field(str_length={"min_value": 1})
    stage: Series[str]
    cycle_id: Series[str]
    row_key: Series[str]
    """The row's idempotency key when it had one ('' otherwise)."""
    reason: Series[str] = pa.Field(str_length={"min_value": 1})
    failed_checks: Series[str]
    payload: Series[str]
    created_at: Series[str]
    schema_version: Series[int] = pa.Field(isin=[SCHEMA_VERSION])

    class Config:
        strict = True
        coerce = True
        name = "quarantine"
        metadata = {"key": "quarantine_id", "volatile": ["created_at"]}

    @_check("failed_checks", name="json_list")
    def _checks(cls, s: pd.Series) -> pd.Series:
        return s.map(lambda v: _json_is(v, list))


CONTRACTS: dict[str, type[pa.DataFrameModel]] = {
    "trajectories": TrajectorySchema,
    "curated": ExperienceSchema,
    "experiences": IndexedExperienceSchema,
    "evaluations": EvaluationSchema,
    "quarantine": QuarantineSchema,
}
"""LanceDB table name → the contract its rows satisfy."""


def contract_key(model: type[pa.DataFrameModel]) -> str:
    return model.Config.metadata["key"]


def contract_volatile(model: type[pa.DataFrameModel]) -> list[str]:
    """Columns left out of the stored content hash (re-writing a row that differs only there is a no-op)."""
    return list(model.Config.metadata.get("volatile", []))


def contract_name(model: type[pa.DataFrameModel]) -> str:
    return model.Config.name


def contract_columns(model: type[pa.DataFrameModel]) -> list[str]:
    return list(model.to_schema().columns)


# --------------------------------------------------------------------------------------------------
# Strict scalar cells: checked before any coercion (validate_frame runs them per row).
_SCALAR_KINDS = {"int64": "int", "float64": "float", "bool": "bool", "str": "str", "string": "str",
                 "string[python]": "str", "string[pyarrow]": "str"}
_LIMIT_NAMES = {MAX_TEXT_BYTES: "MAX_TEXT_BYTES", MAX_MESSAGES_BYTES: "MAX_MESSAGES_BYTES",
                MAX_JSON_BYTES: "MAX_JSON_BYTES", MAX_PAYLOAD_BYTES: "MAX_PAYLOAD_BYTES"}


@functools.cache
def scalar_columns(model: type[pa.DataFrameModel]) -> dict[str, tuple[str, bool]]:
    """Column → (kind, nullable) for the scalar columns of a contract; kind is int, float, bool or str."""
    out = {}
    for name, column in model.to_schema().columns.items():
        kind = _SCALAR_KINDS.get(str(column.dtype))
        if kind:
            out[name] = (kind, bool(column.nullable))
    return out


def preview(value: Any, width: int = 60) -> str:
    """A short, ASCII-only rendering of a value for a message (safe to store whatever the value holds)."""
    text = ascii(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def describe(value: Any) -> str:
    """What a value is, for a message: 'the string \'False\'', 'the float 1.7', 'the boolean true', …"""
    if isinstance(value, bool | np.bool_):
        return f"the boolean {'true' if value else 'false'}"
    if isinstance(value, str):
        return f"the string {preview(value)}"
    if isinstance(value, int | np.integer):
        return f"the integer {preview(int(value))}"
    if isinstance(value, float | np.floating):
        return f"the float {float(value)!r}"
    if isinstance(value, list | tuple | np.ndarray):
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def _is_nan(value: Any) -> bool:
    return isinstance(value, float | np.floating) and math.isnan(value)


def missing_problem(column: str) -> str:
    return f"{column}: missing; it is a required field (set it on every record)"


def cell_problem(column: str, kind: str | None, value: Any, *, nullable: bool = False) -> str | None:
    """Why ``value`` cannot be a cell of ``column`` (``kind`` from :func:`scalar_columns`, None for list and
    object columns, which only get the missing-field rule here); None when it can. Never converts."""
    if value is ABSENT:
        return missing_problem(column)
    if kind is None:
        return None
    if value is None:
        return f"{column}: null; a value is required"
    if _is_nan(value) and kind != "str":
        if nullable:
            return None
        wanted = {"float": "a finite number", "int": "an integer", "bool": "true or false"}[kind]
        return f"{column}: NaN or missing; {wanted} is required"
    if kind == "bool":
        if isinstance(value, bool | np.bool_):
            return None
        return f"{column}: expected true or false, got {describe(value)} (strings and numbers are not converted)"
    if kind == "str":
        if not isinstance(value, str):
            if _is_nan(value):
                return f"{column}: null; a value is required"
            return f"{column}: expected a string, got {describe(value)} (it is not converted)"
        limit = text_limit(column)
        if value.isascii():
            size = len(value)
        else:
            try:
                size = len(value.encode("utf-8"))
            except UnicodeEncodeError as err:
                return (f"{column}: not valid Unicode text ({err.reason} at character {err.start}); "
                        "the producer must write UTF-8")
        if size > limit:
            return (f"{column}: {size} bytes, over the {limit}-byte limit for this column "
                    f"({_LIMIT_NAMES.get(limit, 'limit')}); shorten it at the source")
        return None
    if isinstance(value, bool | np.bool_):
        what = "an integer" if kind == "int" else "a number"
        return f"{column}: expected {what}, got {describe(value)} (a boolean is not a number)"
    if kind == "int":
        if isinstance(value, int | np.integer):
            number = int(value)
        elif isinstance(value, float | np.floating) and math.isfinite(value) and float(value).is_integer():
            number = int(value)  # 3.0 is exactly 3
        elif isinstance(value, float | np.floating):
            return f"{column}: expected an integer, got {describe(value)} (it is not truncated or rounded)"
        else:
            return f"{column}: expected an integer, got {describe(value)} (it is not converted)"
        if not INT64_MIN <= number <= INT64_MAX:
            return f"{column}: {preview(number)} is outside the int64 range of the column"
        return None
    # kind == "float"
    if not isinstance(value, int | float | np.integer | np.floating):
        return f"{column}: expected a number, got {describe(value)} (it is not converted)"
    try:
        number = float(value)
    except OverflowError:
        return f"{column}: {preview(value)} is too large for a float column"
    if not math.isfinite(number):
        return f"{column}: {number!r} is not a finite number"
    return None
