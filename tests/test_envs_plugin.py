"""Plug-in suites: the shipped example loads by path, scores its oracles, and bad files give clear errors."""

from __future__ import annotations

import json
import shutil

import pytest

from lopd_core.envs import get_suite
from lopd_core.envs.plugin import EXAMPLE_SUITE, PluginError, apply_patch, load_plugin_suite


def _play(suite, task, turns):
    env = suite.make_env(task)
    env.reset(task)
    for text in turns:
        if env.step(text).done:
            break
    return env.result()


def test_example_suite_loads_by_path_and_oracles_score_one():
    suite = get_suite(str(EXAMPLE_SUITE))
    assert suite.name == "library" and suite.kind == "tool"
    assert [s["function"]["name"] for s in suite.spec.schemas] == ["find_book", "borrow_book", "return_book", "member_loans"]
    for split in ("train", "test"):
        for level in (1, 2):
            tasks = suite.tasks(split, 100, level=level)
            assert tasks and all(t.split == split and t.level == level for t in tasks)
            for task in tasks:
                result = _play(suite, task, task.oracle.split("\n"))
                assert result.reward == 1.0 and result.success, (task.task_id, result.feedback)
    train = {t.instruction for lv in (1, 2) for t in suite.tasks("train", 100, level=lv)}
    test = {t.instruction for lv in (1, 2) for t in suite.tasks("test", 100, level=lv)}
    assert not train & test


def test_example_state_checker_catches_the_wrong_member():
    suite = load_plugin_suite(EXAMPLE_SUITE)
    task = suite.tasks("train", 1, level=2)[0]
    wrong = task.oracle.replace('"member_id": "M-1"', '"member_id": "M-2"').replace('"member_id": "M-3"', '"member_id": "M-2"')
    result = _play(suite, task, wrong.split("\n"))
    assert result.reward < 1 and "unmet state" in result.feedback and "unmet call" in result.feedback


def _copy_example(tmp_path):
    for name in ("suite.yaml", "tools.py", "tasks.jsonl"):
        shutil.copy(EXAMPLE_SUITE.parent / name, tmp_path / name)
    return tmp_path / "suite.yaml"


def test_bad_files_give_errors_that_name_the_problem(tmp_path):
    path = _copy_example(tmp_path)
    with pytest.raises(PluginError, match="not found"):
        load_plugin_suite(tmp_path / "missing.yaml")
    text = path.read_text()
    path.write_text(text.replace("tasks: tasks.jsonl", "tasks: nope.jsonl"))
    with pytest.raises(PluginError, match="tasks file .*nope.jsonl not found"):
        load_plugin_suite(path)
    path.write_text(text + "\ncolour: blue\n")
    with pytest.raises(PluginError, match="unknown keys \\['colour'\\]"):
        load_plugin_suite(path)
    path.write_text(text.replace("class: LibraryTools", "class: Nope"))
    with pytest.raises(PluginError, match="'Nope' is not a class"):
        load_plugin_suite(path)
    path.write_text(text)
    (tmp_path / "tasks.jsonl").write_text('{"id": "a", "instruction": "x", "expected_answer": ["y"]}\n{"id": "a"\n')
    with pytest.raises(PluginError, match="tasks.jsonl:2: not valid JSON"):
        load_plugin_suite(path)
    (tmp_path / "tasks.jsonl").write_text('{"id": "a", "instruction": "x"}\n')
    with pytest.raises(PluginError, match="at least one of expected_state"):
        load_plugin_suite(path)
    (tmp_path / "tasks.jsonl").write_text('{"id": "a", "instruction": "x", "expected_answer": ["y"], "split": "dev"}\n')
    with pytest.raises(PluginError, match="split must be"):
        load_plugin_suite(path)
    (tmp_path / "tools.py").write_text("class LibraryTools:\n    def find_book(self, title):\n        return 1\n")
    (tmp_path / "tasks.jsonl").write_text((EXAMPLE_SUITE.parent / "tasks.jsonl").read_text())
    with pytest.raises(PluginError, match="type hint"):
        load_plugin_suite(path)
    suite_ok = load_plugin_suite(EXAMPLE_SUITE)
    with pytest.raises(ValueError, match="no tasks with split='test' and level=5"):
        suite_ok.tasks("test", 3, level=5)


def test_stateless_functions_and_custom_checker(tmp_path):
    (tmp_path / "mathtools.py").write_text(
        'def add(a: int, b: int) -> int:\n    """Add two integers.\n\n    Args:\n        a: First.\n        b: Second.\n    """\n'
        "    return a + b\n\n"
        "def check(task, calls, final_answer, final_state):\n"
        "    ok = any(c['name'] == 'add' for c in calls) and final_answer is not None and '5' in final_answer\n"
        "    return {'reward': 1.0 if ok else 0.0, 'feedback': 'ok' if ok else 'call add and say the sum'}\n")
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "t1", "instruction": "What is 2 + 3?",
                                                      "expected_answer": [5]}) + "\n")
    (tmp_path / "s.yaml").write_text("name: adder\ntools: {module: mathtools.py}\ntasks: tasks.jsonl\n"
                                     "checker: mathtools.py:check\n")
    suite = load_plugin_suite(tmp_path / "s.yaml")
    assert [s["function"]["name"] for s in suite.spec.schemas] == ["add"]  # `check` has no Args: not a tool
    task = suite.tasks("train", 5)[0]
    good = _play(suite, task, ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "It is 5."])
    assert good.reward == 1.0 and good.success
    bad = _play(suite, task, ["It is 5."])
    assert bad.reward == 0.0 and bad.feedback == "call add and say the sum"


def test_apply_patch_replaces_and_deletes_records():
    initial = {"books": {"a": {"x": 1}, "b": {"x": 2}}, "count": 2}
    assert apply_patch(initial, {"books": {"a": {"x": 5}, "b": None}, "count": 1}) == {"books": {"a": {"x": 5}}, "count": 1}
    assert initial["books"]["b"] == {"x": 2}


def test_worked_examples_are_played_as_turns():
    suite = load_plugin_suite(EXAMPLE_SUITE)
    task = suite.tasks("test", 1)[0]
    messages = suite.make_env(task).reset(task)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert messages[2]["content"].startswith("<tool_call>") and "Moby Dick" not in task.instruction


def _one_task_suite(tmp_path, instruction: str, expected: dict, tool: str):
    """A plug-in suite of one task with one tool (``tool``: its Python source), loaded from ``tmp_path``."""
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "t1", "instruction": instruction,
                                                      "expected_answer": [expected]}) + "\n")
    (tmp_path / "tool.py").write_text(tool)
    (tmp_path / "s.yaml").write_text("name: one\ntools: {module: tool.py}\ntasks: tasks.jsonl\n")
    suite = load_plugin_suite(tmp_path / "s.yaml")
    return suite, suite.tasks("train", 5)[0]


def test_a_plugin_count_can_refuse_hedged_answers(tmp_path):
    suite, task = _one_task_suite(tmp_path, "How many books are out?", {"number": 2, "only": True},
                                  'def books_out() -> int:\n    """How many books are out."""\n    return 2\n')
    assert _play(suite, task, ["Two books (BK-10 and BK-12) are out since 2026-05-01."]).success
    assert not _play(suite, task, ["1, 2 or 3 books are out."]).success


def test_a_plugin_temperature_refuses_a_contradicting_one_and_a_bad_unit_is_named(tmp_path):
    tool = 'def room_celsius() -> float:\n    """The room temperature in °C."""\n    return 20.0\n'
    reading = {"number": 68, "tolerance": 0.6, "unit": "F", "other": 20}
    suite, task = _one_task_suite(tmp_path, "How warm is the reading room, in °F?", reading, tool)
    assert _play(suite, task, ["It is 68 °F (20 °C)."]).success
    assert not _play(suite, task, ["68 °C, that is 154.4 °F."]).success
    with pytest.raises(PluginError, match="unit 'C' or 'F'"):
        _one_task_suite(tmp_path, "How warm is it, in kelvin?", {**reading, "unit": "K"}, tool)


def test_a_malformed_answer_item_is_named_with_every_form_it_may_take(tmp_path):
    tool = 'def room_celsius() -> float:\n    """The room temperature in °C."""\n    return 20.0\n'
    with pytest.raises(PluginError, match=r"\"unit\": \"C\"\|\"F\" and \"other\".*got \{'value': 20\}"):
        _one_task_suite(tmp_path, "How warm is the room?", {"value": 20}, tool)
