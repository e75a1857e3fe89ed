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

Models are ``strict`` (an unknown column is an error, a missing one too) and ``coerce`` scalar dtypes.
Cross-column rules are ``dataframe_check``s that answer per row, so a failure names the rows and the rule
(the rule's ``name`` is what lands in the quarantine ``reason``). Each model names its idempotency key
in ``Config.metadata["key"]``; :func:`data_contracts.validate.validate_frame` also rejects repeated keys.
``Config.metadata["volatile"]`` lists columns a re-write does not count as a change (the quarantine time).

This module is the contract only: validation with quarantine is :mod:`data_contracts.validate`.
"""

from __future__ import annotations

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

SPLITS = ("train", "test")
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
    return all(_is_real(x) and math.isfinite(x) for x in vec)


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

    @pa.check("messages", name="messages_json_list_of_chat_messages")
    def _messages(cls, s: pd.Series) -> pd.Series:
        return s.map(_messages_ok)

    @pa.check("messages_lite", name="messages_lite_json_list_of_chat_messages")
    def _messages_lite(cls, s: pd.Series) -> pd.Series:
        return s.map(_messages_ok)

    @pa.check("tools", name="tools_json_list")
    def _tools(cls, s: pd.Series) -> pd.Series:
        return s.map(lambda v: _json_is(v, list))

    @pa.check("checklist", "sampling", "timings", name="json_object")
    def _json_objects(cls, s: pd.Series) -> pd.Series:
        return s.map(lambda v: _json_is(v, dict))

    @pa.check("token_ids", name="token_ids_list_of_non_negative_ints")
    def _token_ids(cls, s: pd.Series) -> pd.Series:
        return s.map(lambda v: (ids := as_list(v)) is not None and all(_is_int(x) and x >= 0 for x in ids))

    @pa.check("assistant_mask", name="assistant_mask_list_of_0_1")
    def _mask(cls, s: pd.Series) -> pd.Series:
        return s.map(lambda v: (m := as_list(v)) is not None and all(_is_int(x) and x in (0, 1) for x in m))

    @pa.check("sampling_logprobs", name="sampling_logprobs_finite_and_le_0")
    def _logprobs(cls, s: pd.Series) -> pd.Series:
        return s.map(
            lambda v: (lp := as_list(v)) is not None and all(_is_real(x) and math.isfinite(x) and x <= 0.0 for x in lp)
        )

    @pa.dataframe_check(name="mask_length_matches_token_ids")
    def _mask_len(cls, df: pd.DataFrame) -> pd.Series:
        return _rowwise(df, _safe(lambda r: len(as_list(r.assistant_mask)) == len(as_list(r.token_ids))))

    @pa.dataframe_check(name="logprobs_length_matches_token_ids")
    def _lp_len(cls, df: pd.DataFrame) -> pd.Series:
        return _rowwise(df, _safe(lambda r: len(as_list(r.sampling_logprobs)) == len(as_list(r.token_ids))))

    @pa.dataframe_check(name="prompt_len_within_token_ids_and_prompt_unmasked")
    def _prompt_len(cls, df: pd.DataFrame) -> pd.Series:
        def ok(r):
            mask = as_list(r.assistant_mask)
            return int(r.prompt_len) <= len(as_list(r.token_ids)) and not any(mask[: int(r.prompt_len)])

        return _rowwise(df, _safe(ok))

    @pa.dataframe_check(name="logprobs_zero_outside_assistant_mask")
    def _lp_outside(cls, df: pd.DataFrame) -> pd.Series:
        def ok(r):
            pairs = zip(as_list(r.assistant_mask), as_list(r.sampling_logprobs), strict=True)
            return all(lp == 0.0 for m, lp in pairs if m == 0)

        return _rowwise(df, _safe(ok))

    @pa.dataframe_check(name="ok_status_has_assistant_tokens")
    def _ok_has_tokens(cls, df: pd.DataFrame) -> pd.Series:
        return _rowwise(df, _safe(lambda r: r.status != "ok" or sum(as_list(r.assistant_mask)) > 0))

    @pa.dataframe_check(name="error_status_has_error_message")
    def _error_message(cls, df: pd.DataFrame) -> pd.Series:
        return _rowwise(df, _safe(lambda r: r.status != "error" or bool(str(r.error).strip())))

    @pa.dataframe_check(name="initial_messages_within_messages")
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

    @pa.check("messages", name="messages_json_list_of_chat_messages")
    def _messages(cls, s: pd.Series) -> pd.Series:
        return s.map(_messages_ok)

    @pa.check("content_vector", name="content_vector_finite_of_content_dim")
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

    @pa.check("vector", name="vector_finite_and_unit_norm")
    def _vector(cls, s: pd.Series) -> pd.Series:
        def ok(v):
            return _vector_ok(v) and abs(float(np.linalg.norm(np.asarray(v, dtype=np.float64))) - 1.0) < 1e-3

        return s.map(ok)

    @pa.dataframe_check(name="vectors_share_one_dimension")
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

    @pa.check("extra", name="json_object")
    def _extra(cls, s: pd.Series) -> pd.Series:
        return s.map(lambda v: _json_is(v, dict))

    @pa.dataframe_check(name="eval_split_is_test_for_heldout_and_forgetting")
    def _heldout(cls, df: pd.DataFrame) -> pd.Series:
        return _rowwise(df, _safe(lambda r: r.probe == "prompt_nll" or r.split == "test"))

    @pa.dataframe_check(name="nll_finite_non_negative_for_prompt_nll")
    def _nll(cls, df: pd.DataFrame) -> pd.Series:
        return _rowwise(df, _safe(lambda r: r.probe != "prompt_nll" or (math.isfinite(r.nll) and r.nll >= 0)))


# --------------------------------------------------------------------------------------------------
class QuarantineSchema(pa.DataFrameModel):
    """A rejected row, kept whole (``payload``) with the checks it failed."""

    quarantine_id: Series[str] = pa.Field(str_length={"min_value": 1})
    """Hash of (contract, payload): the same bad row quarantined twice is one row."""
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

    @pa.check("failed_checks", name="json_list")
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
