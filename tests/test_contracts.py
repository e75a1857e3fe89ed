"""The pandera contracts with real validation: every cross-column rule, quarantine reasons, the bad-share limit."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from adversarial_rows import BAD_RECORDS, good_record
from test_memory_support import make_trajectory

from data_contracts import (
    SCHEMA_VERSION,
    EvaluationSchema,
    IndexedExperienceSchema,
    QuarantineSchema,
    StageQualityError,
    TrajectorySchema,
    evaluation_frame,
    frame_to_trajectories,
    records_to_trajectory_frame,
    trajectories_to_frame,
    validate_frame,
)
from lopd_core.records.experience import CONTENT_DIM


def _frame(*trajs):
    return trajectories_to_frame(trajs)


def _reasons(quarantine: pd.DataFrame) -> dict[str, str]:
    return dict(zip(quarantine["row_key"], quarantine["reason"], strict=True))


def test_round_trip_trajectories_frame_is_lossless():
    trajs = [make_trajectory(i, status=s, feedback=f"fb {i}", checklist={"a": [1, 2]}, timings={"gen": 0.5},
                             messages_lite=[{"role": "user", "content": "x"}], observation_lite="x")
             for i, s in enumerate(["ok", "error"])]
    frame = _frame(*trajs)
    assert (frame["schema_version"] == SCHEMA_VERSION).all()
    assert isinstance(frame.loc[0, "messages"], str) and isinstance(frame.loc[0, "token_ids"], list)
    valid, quarantine = validate_frame(frame, TrajectorySchema)
    assert quarantine.empty
    assert frame_to_trajectories(valid) == trajs
    # numpy list cells (as LanceDB returns them) decode to the same records
    as_numpy = valid.copy()
    as_numpy["token_ids"] = as_numpy["token_ids"].map(np.asarray)
    assert frame_to_trajectories(as_numpy) == trajs


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"reward": 1.5}, "reward: in_range(0.0, 1.0)"),
    ({"reward": -0.1}, "reward: in_range(0.0, 1.0)"),
    ({"split": "dev"}, "split: isin"),
    ({"status": "crashed"}, "status: isin"),
    ({"policy_version": ""}, "policy_version: str_length"),
    ({"assistant_mask": [0, 0, 0, 0, 1, 1]}, "mask_length_matches_token_ids"),
    ({"sampling_logprobs": [0.0] * 4}, "logprobs_length_matches_token_ids"),
    ({"sampling_logprobs": [0.0] * 4 + [-0.2, 0.3, -0.1, 0.0]}, "sampling_logprobs_finite_and_le_0"),
    ({"sampling_logprobs": [0.0] * 4 + [-0.2, float("nan"), -0.1, 0.0]}, "sampling_logprobs_finite_and_le_0"),
    ({"sampling_logprobs": [-0.1] + [0.0] * 3 + [-0.2] * 3 + [0.0]}, "logprobs_zero_outside_assistant_mask"),
    ({"prompt_len": 99}, "prompt_len_within_token_ids_and_prompt_unmasked"),
    ({"prompt_len": 5}, "prompt_len_within_token_ids_and_prompt_unmasked"),
    ({"assistant_mask": [0, 0, 0, 0, 2, 1, 1, 0]}, "assistant_mask_list_of_0_1"),
    ({"token_ids": [1, 2, -3, 4, 5, 6, 7, 8]}, "token_ids_list_of_ints_in_0_to_2147483647"),
    ({"assistant_mask": [0] * 8, "sampling_logprobs": [0.0] * 8}, "ok_status_has_assistant_tokens"),
    ({"status": "error", "error": ""}, "error_status_has_error_message"),
    ({"initial_messages": 9}, "initial_messages_within_messages"),
])
def test_each_rule_quarantines_its_row_with_the_failed_check(overrides, expected):
    good, bad = make_trajectory(0), make_trajectory(1, **overrides)
    valid, quarantine = validate_frame(_frame(good, bad), TrajectorySchema, stage="rollouts", cycle_id="c1")
    assert valid["trajectory_id"].tolist() == [good.trajectory_id]
    assert len(quarantine) == 1
    row = quarantine.iloc[0]
    assert row["row_key"] == bad.trajectory_id and expected in row["reason"], row["reason"]
    assert row["contract"] == "trajectories" and row["stage"] == "rollouts" and row["cycle_id"] == "c1"
    assert expected.split(":")[0] in " ".join(json.loads(row["failed_checks"]))
    payload = json.loads(row["payload"])
    assert payload["trajectory_id"] == bad.trajectory_id  # the whole row is kept
    QuarantineSchema.validate(quarantine)


def test_nothing_is_dropped_silently_with_many_kinds_of_bad_rows():
    trajs = [make_trajectory(i) for i in range(6)]
    trajs += [make_trajectory(10, reward=3.0), make_trajectory(11, split="x"), make_trajectory(12, prompt_len=50)]
    dup = make_trajectory(13)
    dup.trajectory_id = trajs[0].trajectory_id
    frame = _frame(*trajs, dup)
    frame["reward"] = frame["reward"].astype(object)
    frame.loc[1, "reward"] = "not a number"
    valid, quarantine = validate_frame(frame, TrajectorySchema)
    assert len(valid) + len(quarantine) == len(frame)
    reasons = quarantine["reason"].tolist()
    assert any("reward: expected a number, got the string 'not a number'" in r for r in reasons)
    assert any("duplicate_key" in r for r in reasons)
    assert len(valid) == 5 and valid["reward"].dtype == np.float64
    # the duplicate's first occurrence stays valid
    assert trajs[0].trajectory_id in set(valid["trajectory_id"])


def test_frame_level_failures_quarantine_every_row_and_trip_the_limit():
    frame = _frame(make_trajectory(0), make_trajectory(1)).drop(columns=["policy_version"])
    valid, quarantine = validate_frame(frame, TrajectorySchema)
    assert valid.empty and len(quarantine) == 2
    assert (quarantine["reason"] == "policy_version: missing; it is a required field (set it on every record)").all()

    extra = _frame(make_trajectory(0)).assign(surprise=1)
    _, quarantine = validate_frame(extra, TrajectorySchema)
    assert quarantine["reason"].tolist() == [
        "unknown field 'surprise': not in the trajectories contract (remove it, or fix its spelling)"]

    with pytest.raises(StageQualityError) as info:
        validate_frame(frame, TrajectorySchema, stage="rollouts", max_bad_fraction=0.2)
    assert "curation.max_bad_row_fraction" in str(info.value) and len(info.value.quarantine) == 2


def test_bad_share_limit_is_a_strict_threshold():
    trajs = [make_trajectory(i) for i in range(4)] + [make_trajectory(9, reward=2.0)]
    valid, quarantine = validate_frame(_frame(*trajs), TrajectorySchema, max_bad_fraction=0.2)
    assert len(valid) == 4 and len(quarantine) == 1  # 20% is allowed at a 0.2 limit
    with pytest.raises(StageQualityError) as info:
        validate_frame(_frame(*trajs), TrajectorySchema, max_bad_fraction=0.19)
    assert info.value.bad_fraction == pytest.approx(0.2) and len(info.value.valid) == 4


def test_empty_frame_is_valid_and_quarantines_nothing():
    valid, quarantine = validate_frame(_frame(), TrajectorySchema, max_bad_fraction=0.0)
    assert valid.empty and quarantine.empty


def test_loose_records_fill_defaults_and_quarantine_missing_required_fields():
    full = make_trajectory(0).to_dict()
    minimal = {k: v for k, v in full.items() if k not in ("feedback", "checklist", "timings", "engine")}
    missing = {k: v for k, v in full.items() if k != "reward"} | {"trajectory_id": "no-reward", "episode_id": "e2"}
    frame = records_to_trajectory_frame([minimal, missing])
    valid, quarantine = validate_frame(frame, TrajectorySchema)
    assert valid["trajectory_id"].tolist() == [full["trajectory_id"]]
    assert quarantine["row_key"].tolist() == ["no-reward"] and "reward" in quarantine["reason"].iloc[0]


def _indexed_row(i, **overrides):
    from lopd_core.records.experience import CONTENT_DIM

    vec = np.zeros(8, dtype=np.float32)
    vec[i % 8] = 1.0
    row = {
        "experience_id": f"x{i}", "trajectory_id": f"x{i}", "episode_id": f"e{i}", "task_id": f"t{i}",
        "suite": "toolworld", "suite_kind": "tool", "family": "shop", "split": "train", "level": 1,
        "instruction": "do it", "text": "user: do it", "messages": "[]", "reward": 1.0, "step": 0, "cycle_id": "c1",
        "policy_version": "base", "n_tokens": 10, "content_vector": [1.0] + [0.0] * (CONTENT_DIM - 1),
        "schema_version": SCHEMA_VERSION, "vector": vec.tolist(), "embedder": "hash-8", "embed_field": "task",
    }
    return {**row, **overrides}


def test_experience_contract_rejects_test_split_and_unnormalised_vectors():
    rows = [_indexed_row(0), _indexed_row(1, split="test"), _indexed_row(2, vector=[2.0] + [0.0] * 7),
            _indexed_row(3, vector=[1.0, 0.0]), _indexed_row(4, suite_kind="chat")]
    valid, quarantine = validate_frame(pd.DataFrame(rows), IndexedExperienceSchema)
    assert valid["experience_id"].tolist() == ["x0"]
    reasons = _reasons(quarantine)
    assert "split: isin" in reasons["x1"]
    assert "vector_finite_float32_and_unit_norm" in reasons["x2"]
    assert "vectors_share_one_dimension" in reasons["x3"]
    assert "suite_kind: isin" in reasons["x4"]


def test_evaluation_contract():
    base = {"eval_row_id": "r0", "eval_run_id": "run", "cycle_id": "c1", "role": "challenger", "policy_version": "3",
            "composer_version": "3", "probe": "heldout", "suite": "toolworld", "split": "test", "task_id": "t",
            "family": "shop", "status": "ok", "reward": 0.5, "success": False, "response_tokens": 40,
            "n_tool_calls": 2, "n_invalid_tool_calls": 0, "nll": float("nan"), "trajectory_id": "tr",
            "extra": "{}", "schema_version": SCHEMA_VERSION}
    rows = [base, {**base, "eval_row_id": "r1", "split": "train"},
            {**base, "eval_row_id": "r2", "probe": "prompt_nll", "split": "train", "nll": 1.2},
            {**base, "eval_row_id": "r3", "probe": "prompt_nll", "nll": float("nan")},
            {**base, "eval_row_id": "r4", "reward": 2.0}]
    valid, quarantine = validate_frame(pd.DataFrame(rows), EvaluationSchema)
    assert sorted(valid["eval_row_id"]) == ["r0", "r2"]
    reasons = _reasons(quarantine)
    assert "eval_split_is_test_for_heldout_and_forgetting" in reasons["r1"]
    assert "nll_finite_non_negative_for_prompt_nll" in reasons["r3"]
    assert "reward: in_range" in reasons["r4"]


def test_quarantine_ids_are_stable_for_the_same_bad_row():
    bad = make_trajectory(1, reward=5.0)
    _, q1 = validate_frame(_frame(bad), TrajectorySchema)
    _, q2 = validate_frame(_frame(make_trajectory(0), bad), TrajectorySchema)
    assert q1["quarantine_id"].tolist() == q2["quarantine_id"].tolist()


def test_evaluation_frame_from_scored_episodes_is_contract_valid():
    episodes = [make_trajectory(i, split="test", reward=r) for i, r in enumerate([1.0, 0.25])]
    frame = evaluation_frame(episodes, eval_run_id="run-7", role="challenger", cycle_id="c3")
    valid, quarantine = validate_frame(frame, EvaluationSchema)
    assert quarantine.empty and valid["eval_row_id"].tolist() == ["run-7/heldout/task-0", "run-7/heldout/task-1"]
    assert valid["response_tokens"].tolist() == [3, 3] and valid["success"].tolist() == [True, False]
    train_episode = evaluation_frame([make_trajectory(5)], eval_run_id="run-7", role="challenger")
    _, quarantine = validate_frame(train_episode, EvaluationSchema)
    assert "eval_split_is_test_for_heldout_and_forgetting" in quarantine["reason"].iloc[0]


# --------------------------------------------------------------------------------------------------
# Adversarial records (tests/adversarial_rows.py): each one quarantined with its reason, the good row kept.
@pytest.mark.parametrize(("name", "record", "expected"), BAD_RECORDS, ids=[c[0] for c in BAD_RECORDS])
def test_each_malformed_record_is_quarantined_with_its_reason_and_costs_no_good_row(name, record, expected):
    good = good_record(0)
    frame = records_to_trajectory_frame([good, record, good_record(1)])
    valid, quarantine = validate_frame(frame, TrajectorySchema, stage="ingest", row_labels=["a", "b", "c"])
    assert valid["trajectory_id"].tolist() == [good["trajectory_id"], good_record(1)["trajectory_id"]], name
    assert len(quarantine) == 1, quarantine["reason"].tolist()
    row = quarantine.iloc[0]
    assert row["reason"].startswith("b: ") and expected in row["reason"], row["reason"]
    QuarantineSchema.validate(quarantine)
    assert len(row["payload"]) < 5 * 1024 * 1024  # a huge cell is cut in the payload, with a marker
    assert row["payload"].isascii()  # whatever the row held, the quarantine row is storable


def test_nothing_is_coerced_on_the_way_in():
    """What used to be converted silently: "False" → True, 1.7 → 1, reward true → 1.0, no policy → 'base'."""
    frame = records_to_trajectory_frame([good_record(0) | {"level": 3.0}])  # 3.0 is exactly 3: kept
    valid, quarantine = validate_frame(frame, TrajectorySchema)
    assert quarantine.empty and valid["level"].tolist() == [3] and valid["level"].dtype == np.int64
    assert valid["success"].tolist() == [True] and valid["policy_version"].tolist() == ["base"]
    back = frame_to_trajectories(valid)[0]
    assert back.to_dict() == good_record(0) | {"level": 3}


def test_unknown_keys_quarantine_only_the_rows_that_carry_them():
    rows = [good_record(i) for i in range(5)]
    rows[2] = rows[2] | {"surprise": {"nested": [1, 2]}, "other": "x"}
    valid, quarantine = validate_frame(records_to_trajectory_frame(rows), TrajectorySchema)
    assert len(valid) == 4 and "surprise" not in valid.columns
    reason = quarantine["reason"].iloc[0]
    assert "unknown field 'surprise'" in reason and "unknown field 'other'" in reason
    assert json.loads(quarantine["payload"].iloc[0])["surprise"] == {"nested": [1, 2]}  # the value is kept
    assert json.loads(quarantine["payload"].iloc[0])["other"] == "x"
    assert len(quarantine) == 1


def test_identical_bad_rows_get_distinct_quarantine_ids_that_are_stable():
    bad = good_record(7) | {"success": "False"}
    frame = records_to_trajectory_frame([bad, good_record(1), dict(bad)])
    _, q1 = validate_frame(frame, TrajectorySchema)
    _, q2 = validate_frame(frame, TrajectorySchema)
    assert len(q1) == 2 and q1["quarantine_id"].nunique() == 2
    assert q1["quarantine_id"].tolist() == q2["quarantine_id"].tolist()


def test_a_key_repeated_after_a_bad_first_row_keeps_the_good_row():
    """The first row with a key is broken, the second is fine: the fine one is stored, not called a duplicate."""
    first = good_record(3) | {"level": "one"}
    valid, quarantine = validate_frame(records_to_trajectory_frame([first, good_record(3)]), TrajectorySchema)
    assert valid["trajectory_id"].tolist() == [good_record(3)["trajectory_id"]]
    assert "level: expected an integer" in quarantine["reason"].iloc[0]


def test_cells_are_bounded_by_their_storage_types():
    rows = [_indexed_row(0), _indexed_row(1, content_vector=[1e39] + [0.0] * 7 + [0.0] * (CONTENT_DIM - 8)),
            _indexed_row(2, n_tokens=True), _indexed_row(3, embedder=7)]
    valid, quarantine = validate_frame(pd.DataFrame(rows, dtype=object), IndexedExperienceSchema)
    assert valid["experience_id"].tolist() == ["x0"]
    reasons = _reasons(quarantine)
    assert "content_vector_finite_float32_of_content_dim" in reasons["x1"]
    assert "n_tokens: expected an integer, got the boolean true" in reasons["x2"]
    assert "embedder: expected a string, got the integer 7" in reasons["x3"]


def test_check_names_survive_inheritance_whatever_schema_is_built_first():
    """pandera pops a check's name when a schema is first built; the experiences contract inherits the curated
    one's checks, so its reasons used to say `_content_vector` when the curated schema came first."""
    import subprocess
    import sys

    code = ("from data_contracts import ExperienceSchema as E, IndexedExperienceSchema as I\n"
            "E.to_schema()\n"
            "print(sorted(c.name for col in I.to_schema().columns.values() for c in col.checks))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    names = out.stdout.strip()
    assert "content_vector_finite_float32_of_content_dim" in names and "messages_json_list_of_chat_messages" in names
    assert "'_" not in names, names
