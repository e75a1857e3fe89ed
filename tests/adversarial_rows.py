"""Malformed trajectory records and JSONL lines, each with the reason its quarantine row must give.

Used by the contract tests (record by record, in process) and the ingest test (all of them in one file with
400 good rows, through the real CLI). Every case is built from a valid record (``make_trajectory``) with one
thing broken, so the reason can only come from that one thing. ``BAD_RECORDS``: (name, record, reason
substring). ``BAD_LINES``: (name, raw line bytes, reason substring), lines that are not a JSON object at all.
"""

from __future__ import annotations

import json

from test_memory_support import make_trajectory

from data_contracts.models import MAX_MESSAGES_BYTES, MAX_TEXT_BYTES, MAX_TOKENS

BAD_RECORD_BASE = 5000
"""Bad record k is built from ``make_trajectory(BAD_RECORD_BASE + k)`` (ids distinct from the good rows)."""


def good_record(i: int) -> dict:
    return make_trajectory(i).to_dict()


def _broken(k: int, **changes) -> dict:
    record = good_record(BAD_RECORD_BASE + k)
    for name, value in changes.items():
        if value is _DROP:
            record.pop(name)
        else:
            record[name] = value
    return record


_DROP = object()


def _cases() -> list[tuple[str, dict, str]]:
    n = len(good_record(0)["token_ids"])  # 8: 4 prompt tokens, 3 generated, 1 end of turn
    spec: list[tuple[str, dict, str]] = [
        # strict booleans, integers and numbers: nothing is converted
        ("success as the string 'False'", {"success": "False"}, "success: expected true or false, got the string 'False'"),
        ("success as the string 'no'", {"success": "no"}, "success: expected true or false, got the string 'no'"),
        ("success as the integer 1", {"success": 1}, "success: expected true or false, got the integer 1"),
        ("success null", {"success": None}, "success: null"),
        ("reward true", {"reward": True}, "reward: expected a number, got the boolean true"),
        ("reward as the string '0.5'", {"reward": "0.5"}, "reward: expected a number, got the string '0.5'"),
        ("reward above 1", {"reward": 1.5}, "reward: in_range(0.0, 1.0)"),
        ("reward below 0", {"reward": -0.1}, "reward: in_range(0.0, 1.0)"),
        ("reward 1e400 (a JSON number that reads as infinity)", {"reward": float("inf")},
         "reward: inf is not a finite number"),
        ("level 1.7", {"level": 1.7}, "level: expected an integer, got the float 1.7 (it is not truncated"),
        ("level as the string '2'", {"level": "2"}, "level: expected an integer, got the string '2'"),
        ("level true", {"level": True}, "level: expected an integer, got the boolean true"),
        ("level -1", {"level": -1}, "level: greater_than_or_equal_to(0)"),
        ("step beyond int64", {"step": 2**70}, "step: 1180591620717411303424 is outside the int64 range"),
        ("prompt_len 4.5", {"prompt_len": 4.5}, "prompt_len: expected an integer, got the float 4.5"),
        ("n_turns as the string '3'", {"n_turns": "3"}, "n_turns: expected an integer, got the string '3'"),
        ("schema_version 2", {"schema_version": 2}, "schema_version: isin([1])"),
        ("cycle_id as a number", {"cycle_id": 5}, "cycle_id: expected a string, got the integer 5"),
        # required fields are required
        ("policy_version missing", {"policy_version": _DROP}, "policy_version: missing; it is a required field"),
        ("policy_version empty", {"policy_version": ""}, "policy_version: str_length"),
        ("policy_version as a number", {"policy_version": 3}, "policy_version: expected a string, got the integer 3"),
        ("task_id missing", {"task_id": _DROP}, "task_id: missing; it is a required field"),
        ("messages missing", {"messages": _DROP}, "messages: missing; it is a required field"),
        ("reward missing", {"reward": _DROP}, "reward: missing; it is a required field"),
        ("episode and trajectory id missing", {"episode_id": _DROP, "trajectory_id": _DROP},
         "episode_id: missing; it is a required field"),
        # size limits
        ("a 20 MB instruction", {"instruction": "x" * (20 * 1024 * 1024)},
         f"instruction: 20971520 bytes, over the {MAX_TEXT_BYTES}-byte limit"),
        ("feedback one byte over the text limit", {"feedback": "é" * (MAX_TEXT_BYTES // 2) + "x"},
         f"feedback: {MAX_TEXT_BYTES + 1} bytes, over the {MAX_TEXT_BYTES}-byte limit"),
        ("messages JSON over 4 MiB", {"messages": [{"role": "user", "content": "y" * MAX_MESSAGES_BYTES}]},
         f"messages: 4194337 bytes, over the {MAX_MESSAGES_BYTES}-byte limit for this column (MAX_MESSAGES_BYTES)"),
        ("more tokens than MAX_TOKENS", {"token_ids": [1] * (MAX_TOKENS + 1), "assistant_mask": [0] * (MAX_TOKENS + 1),
                                         "sampling_logprobs": [0.0] * (MAX_TOKENS + 1), "status": "truncated"},
         f"token_ids_at_most_{MAX_TOKENS}_tokens"),
        ("an instruction with a lone surrogate", {"instruction": "caf\ud800"},
         "instruction: not valid Unicode text (surrogates not allowed at character 3)"),
        # per-token arrays: bounded by the storage type, aligned
        ("token id 2**31 (int32 overflow)", {"token_ids": [11, 12, 13, 14, 2**31, 101, 102, 7]},
         "token_ids_list_of_ints_in_0_to_2147483647"),
        ("negative token id", {"token_ids": [11, 12, 13, -14, 100, 101, 102, 7]}, "token_ids_list_of_ints_in_0_to_2147483647"),
        ("token id as a float", {"token_ids": [11, 12, 13, 14, 100.0, 101, 102, 7]},
         "token_ids_list_of_ints_in_0_to_2147483647"),
        ("token_ids as a string", {"token_ids": "11,12,13"}, "token_ids_list_of_ints_in_0_to_2147483647"),
        ("assistant_mask shorter than token_ids", {"assistant_mask": [0] * (n - 2)}, "mask_length_matches_token_ids"),
        ("assistant_mask value 2", {"assistant_mask": [0, 0, 0, 0, 2, 1, 1, 0]}, "assistant_mask_list_of_0_1"),
        ("assistant_mask of booleans", {"assistant_mask": [False] * 4 + [True] * 3 + [False]}, "assistant_mask_list_of_0_1"),
        ("positive log-prob", {"sampling_logprobs": [0.0] * 4 + [-0.2, 0.3, -0.1, 0.0]}, "sampling_logprobs_finite_and_le_0"),
        ("log-probs longer than token_ids", {"sampling_logprobs": [0.0] * (n + 1)}, "logprobs_length_matches_token_ids"),
        ("prompt_len past the tokens", {"prompt_len": 99}, "prompt_len_within_token_ids_and_prompt_unmasked"),
        ("initial_messages past the messages", {"initial_messages": 9}, "initial_messages_within_messages"),
        # choices, JSON shapes, cross-field rules
        ("split 'dev'", {"split": "dev"}, "split: isin"),
        ("status 'crashed'", {"status": "crashed"}, "status: isin"),
        ("error status without an error", {"status": "error", "error": ""}, "error_status_has_error_message"),
        ("messages as JSON text instead of a list", {"messages": "[]"}, "messages_json_list_of_chat_messages"),
        ("a message with an unknown role", {"messages": [{"role": "wizard", "content": "hi"}], "initial_messages": 1},
         "messages_json_list_of_chat_messages"),
        ("tools as an object", {"tools": {"name": "lookup"}}, "tools: tools_json_list"),
        ("checklist as a list", {"checklist": [1, 2]}, "checklist: json_object"),
        ("a plug-in suite path as the suite", {"suite": "/tmp/suites/evil/suite.yaml"},
         "suite: suite_is_a_name_not_a_path"),
        # unknown keys: only this row, and the key is named
        ("an unknown key", {"surprise": 1}, "unknown field 'surprise': not in the trajectories contract"),
        ("an unknown key set to null", {"nothing": None}, "unknown field 'nothing'"),
        ("a misspelt key (and so a missing one)", {"rewrd": 1.0, "reward": _DROP},
         "unknown field 'rewrd': not in the trajectories contract (remove it, or fix its spelling)"),
    ]
    return [(name, _broken(k, **changes), reason) for k, (name, changes, reason) in enumerate(spec)]


BAD_RECORDS: list[tuple[str, dict, str]] = _cases()

BAD_LINES: list[tuple[str, bytes, str]] = [
    ("broken JSON", b'{"task_id": "x", ', "not valid JSON"),
    ("a JSON array", b"[1, 2, 3]", "not a JSON object (a list)"),
    ("a bare string", b'"hello"', "not a JSON object (a str)"),
    ("a NaN literal", json.dumps(good_record(9001)).replace('"reward": 1.0', '"reward": NaN').encode(),
     "NaN is not JSON"),
    ("a repeated key", json.dumps(good_record(9002)).replace('"reward": 1.0', '"reward": 1.0, "reward": 0.0').encode(),
     "key 'reward' appears twice in one object"),
    ("bytes that are not UTF-8", b'{"task_id": "caf\xe9"}', "not valid UTF-8 (byte 0xe9"),
    ("JSON nested 100000 deep", b"[" * 100_000 + b"]" * 100_000, "JSON nested too deeply"),
]


def jsonl_line(record: dict) -> bytes:
    """The record as one JSON line; an infinite float is written as ``1e400`` (valid JSON that reads as inf)."""
    return json.dumps(record).replace("Infinity", "1e400").encode()
