"""toolworld: determinism, the train/test split, oracle replays, the checklist reward and its feedback."""

from __future__ import annotations

import json

import pytest

from lopd_core.envs import get_suite
from lopd_core.envs.base import Environment, Suite
from lopd_core.envs.toolworld.domain import CITIES, PEOPLE, PRODUCTS, TITLES


@pytest.fixture(scope="module")
def suite():
    return get_suite("toolworld")


def _play(suite, task, turns):
    env = suite.make_env(task)
    env.reset(task)
    steps = []
    for text in turns:
        step = env.step(text)
        steps.append(step)
        if step.done:
            break
    return env.result(), steps


def test_protocols_and_determinism(suite):
    assert isinstance(suite, Suite) and suite.kind == "tool"
    a = suite.tasks("train", 12, level=2, seed=3)
    b = suite.tasks("train", 12, level=2, seed=3)
    assert [t.task_id for t in a] == [t.task_id for t in b]
    assert [t.instruction for t in a] == [t.instruction for t in b]
    assert [json.dumps(t.payload, sort_keys=True) for t in a] == [json.dumps(t.payload, sort_keys=True) for t in b]
    assert suite.tasks("train", 4, level=2, seed=3)[2].instruction == a[2].instruction  # prefix-stable
    assert suite.tasks("train", 12, level=2, seed=4)[0].instruction != a[0].instruction or \
        suite.tasks("train", 12, level=2, seed=4)[1].instruction != a[1].instruction
    assert isinstance(suite.make_env(a[0]), Environment)
    assert {t.family.split("/")[0] for t in a} == {"shop", "calendar", "weather", "bank"}


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_oracle_scores_one_on_every_domain(suite, level):
    for split in ("train", "test"):
        for task in suite.tasks(split, 16, level=level, seed=1):
            result, steps = _play(suite, task, task.oracle_turns)
            assert result.reward == 1.0 and result.success, (task.task_id, result.feedback)
            assert steps[-1].done and sum(s.tool_calls for s in steps) == len(task.oracle_turns) - 1
            assert task.oracle and task.oracle.endswith(task.oracle_turns[-1])
            calls_needed = len(task.payload["checklist"]["calls"])
            assert 1 <= calls_needed <= 4


def test_levels_need_more_calls(suite):
    def mean_calls(level):
        tasks = suite.tasks("train", 32, level=level)
        return sum(len(t.oracle_turns) - 1 for t in tasks) / len(tasks)

    means = [mean_calls(level) for level in (1, 2, 3, 4)]
    assert means == sorted(means) and means[0] == 1 and means[3] >= 3.5


def test_train_and_test_share_no_wording_or_entity(suite):
    train = suite.tasks("train", 200, level=1) + suite.tasks("train", 200, level=3)
    test = suite.tasks("test", 120, level=1) + suite.tasks("test", 120, level=3)
    assert not {t.instruction for t in train} & {t.instruction for t in test}
    for pools in (PEOPLE, CITIES, PRODUCTS, TITLES):
        assert not set(pools["train"]) & set(pools["test"])
    test_entities = PEOPLE["test"] + CITIES["test"] + PRODUCTS["test"] + TITLES["test"]
    for task in train:
        assert not any(e in task.instruction for e in test_entities), task.instruction
    # Templates: strip entities → the phrasing skeletons differ too.
    assert not {t.payload["kind"] + "|" + _skeleton(t) for t in train} & {t.payload["kind"] + "|" + _skeleton(t) for t in test}


def _skeleton(task) -> str:
    import re

    text = task.instruction
    for pools in (PEOPLE, CITIES, PRODUCTS, TITLES):
        for e in pools["train"] + pools["test"]:
            text = text.replace(e, "<E>")
    return re.sub(r"[A-Z]\d{3}|\d[\d:.-]*", "<N>", text)


def test_partial_credit_and_feedback_list_unmet_items(suite):
    task = next(t for t in suite.tasks("train", 40, level=3) if t.payload["domain"] == "bank")
    first_call = task.oracle_turns[0]
    result, _ = _play(suite, task, [first_call, "Sorry, I could not finish."])
    assert 0 < result.reward < 1 and not result.success
    assert "unmet call" in result.feedback and "transfer" in result.feedback
    assert result.checklist["total"] >= 4
    # Doing nothing earns nothing, not even the "no other record changed" item.
    result, _ = _play(suite, task, ["I won't do that."])
    assert result.reward == 0.0


def test_invalid_calls_become_observations(suite):
    task = suite.tasks("train", 4, level=1)[0]
    env = suite.make_env(task)
    env.reset(task)
    step = env.step('<tool_call>{"name": "no_such_tool", "arguments": {}}</tool_call>')
    assert not step.done and step.invalid_tool_calls == 1 and "unknown function" in step.observation
    step = env.step("<tool_call>{oops</tool_call>")
    assert step.invalid_tool_calls == 1 and "not valid JSON" in step.observation
    assert step.observation.startswith("<tool_response>") and step.role == "tool"
    step = env.step('<tool_call>{"name": "get_balance", "arguments": {"account": 5}}</tool_call>')
    assert step.invalid_tool_calls == 1 and "missing required argument" in step.observation
    result = env.result()
    assert result.reward == 0.0 and "no final answer" in result.feedback


def test_unintended_change_is_penalised(suite):
    task = next(t for t in suite.tasks("train", 40, level=1) if t.payload["kind"] == "order_status")
    oid = next(iter(task.payload["initial_state"]["orders"]))
    wrong = [o for o, rec in task.payload["initial_state"]["orders"].items() if rec["status"] == "processing"]
    turns = list(task.oracle_turns)
    if wrong:
        turns.insert(1, f'<tool_call>{{"name": "cancel_order", "arguments": {{"order_id": "{wrong[0]}"}}}}</tool_call>')
        result, _ = _play(suite, task, turns)
        assert result.reward == 0.5 and result.checklist["unintended_changes"]
    assert oid


def test_prompt_renders_compactly_with_the_tiny_tokenizer(suite, tiny_tokenizer):
    from lopd_core.records.chat import render_prompt_ids

    for task in suite.tasks("train", 8, level=1):
        messages = suite.make_env(task).reset(task)
        # Worked examples as real turns: user request, call, tool response, answer (twice), then the task.
        assert [m["role"] for m in messages] == ["system"] + ["user", "assistant", "tool", "assistant"] * suite.n_shots + ["user"]
        assert messages[2]["content"].startswith("<tool_call>") and messages[-1]["content"] == task.instruction
        ids = render_prompt_ids(tiny_tokenizer, messages, task.tools)
        assert 150 < len(ids) < 900, len(ids)


def test_bad_arguments_are_clear_errors(suite):
    with pytest.raises(ValueError, match="level"):
        suite.tasks("train", 2, level=9)
    with pytest.raises(ValueError, match="split"):
        suite.tasks("dev", 2)
    with pytest.raises(ValueError, match="unknown suite"):
        get_suite("nonsense")


def test_worked_examples_use_entities_of_neither_split(suite):
    pools = [e for p in (PEOPLE, CITIES, PRODUCTS, TITLES) for split in ("train", "test") for e in p[split]]
    for domain in suite.domains.values():
        assert len(domain.shots) >= 2
        for shot in domain.shots:
            text = json.dumps([m["content"] for m in shot.messages()])
            assert not any(e in text for e in pools), (domain.name, shot.request)


def test_tasks_are_recreated_from_their_ids_and_fingerprinted_by_content(suite):
    from lopd_core.envs.base import task_fingerprint, tasks_by_id

    made = suite.tasks("train", 12, level=1, seed=7) + suite.tasks("test", 3, level=2, seed=9)
    back = tasks_by_id(suite, [t.task_id for t in made] + ["not/an/id", "codegen/train/L1/s7/00001"])
    assert set(back) == {t.task_id for t in made}  # another suite's id names none of these tasks
    assert all(task_fingerprint(back[t.task_id]) == task_fingerprint(t) for t in made)
    # the same request in another world is another task
    same_text = [(a, b) for a in made for b in made if a is not b and a.instruction == b.instruction]
    assert all(task_fingerprint(a) != task_fingerprint(b) for a, b in same_text)


def test_validation_split_covers_every_family_and_leaves_out_what_training_saw(suite):
    from lopd_core.config import load_config
    from lopd_core.envs.base import task_fingerprint
    from lopd_core.evaluation import VALIDATION_SEED, validation_tasks
    from lopd_core.training import task_order

    cfg = load_config("demo", {"distill.steps": 20})
    seen = {task_fingerprint(t) for t in task_order(suite, cfg, n_tasks=160)}
    valid = validation_tasks(suite, 64, level=1, exclude=seen)
    assert len(valid) == 64 and not {task_fingerprint(t) for t in valid} & seen
    assert all(f"/s{VALIDATION_SEED}/" in t.task_id and t.split == "train" for t in valid)
    families = {t.family for t in suite.tasks("train", 200, level=1, seed=0)}
    assert {t.family for t in valid} == families  # few distinct requests (count_meetings) do not empty a family
    dropped = validation_tasks(suite, 64, level=1, exclude={task_fingerprint(valid[0])})
    assert valid[0].task_id not in {t.task_id for t in dropped}


@pytest.mark.parametrize("family", ["calendar/count_meetings", "shop/count_orders"])
def test_a_count_is_credited_only_when_stated_alone(suite, family):
    """The bank's sampled successes held "There are 23 meetings (2 events in total)." and "This order has 1,
    and all other orders have 2.": a count answer that also states another whole number is a hedge."""
    task = next(t for t in suite.tasks("train", 200, level=1) if t.family == family)
    item, = task.payload["checklist"]["answer"]
    assert item["only"] is True
    n = int(item["number"])
    call = task.oracle_turns[0]
    for answer, credited in [(f"You have {n} of them on 2026-06-03 (B7777, F790; the 1:1 at 09:30).", True),
                             (f"There are {n}, 45.20 EUR in all.", True),  # an amount with decimals is no count
                             (f"There are {n + 21} ({n} in total).", False),
                             (f"It is {', '.join(str(k) for k in range(1, n + 3))}.", False),
                             (f"There are {n + 1}.", False),
                             (f"One is B114, and there are {n + 1} in all.", False),  # a number word counts too
                             (f"There are {['zero', 'one', 'two', 'three', 'four'][n]}.", True)]:
        result, _ = _play(suite, task, [call, answer])
        assert result.success is credited, answer


@pytest.mark.parametrize("family,level", [("weather/convert_only", 1), ("weather/temp_celsius", 1),
                                          ("weather/temp_fahrenheit", 2)])
def test_a_temperature_is_credited_only_without_a_contradicting_one(suite, family, level):
    """The bank's sampled conversions held "48.2 °C is 159.78 °F." (for 9 °C) and the students answered
    "44.6 °F is 44.6 °C.": the right number beside a temperature that contradicts it earns no credit."""
    task = next(t for t in suite.tasks("train", 200, level=level) if t.family == family)
    item, = task.payload["checklist"]["answer"]
    value, other, unit = item["number"], item["other"], item["unit"]
    mark, other_mark = ("°C", "°F") if unit == "C" else ("°F", "°C")
    for answer, credited in [(f"It is {value:g} {mark}.", True),
                             (f"It is {value:g} {mark} ({other:g} {other_mark}), humidity 45%, at 09:30.", True),
                             (f"{other:g} is {value:g} degrees.", True),  # unmarked: either reading
                             (f"{value:g}.", True),
                             (f"{value:g} {other_mark} is {value + 100:g} {mark}.", False),
                             (f"{value:g} {mark} is {value:g} {other_mark}.", False),
                             (f"It is {value:g} {mark}, or {value + 30:g}°.", False)]:
        result, _ = _play(suite, task, [*task.oracle_turns[:-1], answer])
        assert result.success is credited, answer
    assert f"the answer states {value:g} °{unit} and no temperature that contradicts it" in result.feedback
    # the other families keep their items (and their content fingerprints) as they were
    plain = next(t for t in suite.tasks("train", 200, level=1) if t.family == "bank/balance_by_id")
    assert "unit" not in plain.payload["checklist"]["answer"][0]


def test_a_temperature_item_names_what_it_lacks():
    from lopd_core.envs.tool_env import AnswerItem

    with pytest.raises(ValueError, match="unit 'C' or 'F'.*got unit='K'"):
        AnswerItem(number=280.0, unit="K", other=7.0)
    with pytest.raises(ValueError, match="other=None"):
        AnswerItem(number=53.6, unit="F")
