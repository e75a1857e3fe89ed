"""codegen: every template's reference solution passes its hidden tests in the sandbox, partial credit,
feedback, code extraction, the template split, a real (tiny-model) episode, and the reward hacks that
model-written code tried against the verifier (each scores 0)."""

from __future__ import annotations

import collections
import json

import pytest

from lopd_core.envs import get_suite
from lopd_core.envs.codegen import harness
from lopd_core.envs.codegen.harness import (
    ProtocolError,
    extract_code,
    parse_channel,
    run_tests,
    run_tests_batch,
)
from lopd_core.envs.codegen.templates import TEMPLATES


@pytest.fixture(scope="module")
def suite():
    return get_suite("codegen")


def test_template_inventory():
    assert len(TEMPLATES) >= 40
    counts = collections.Counter((t.split, t.level) for t in TEMPLATES)
    for level in (1, 2, 3, 4):
        assert counts[("train", level)] >= 8 and counts[("test", level)] >= 3


def test_every_reference_solution_passes_in_the_sandbox(suite):
    tasks = [t for split in ("train", "test") for level in (1, 2, 3, 4)
             for t in suite.tasks(split, len(suite.templates_for(split, level)), level=level, seed=7)]
    assert len({t.payload["template"] for t in tasks}) == len(TEMPLATES)
    reports = run_tests_batch([(extract_code(t.oracle), t.payload["function"], t.payload["tests"]) for t in tasks])
    failures = [(t.family, r.feedback) for t, r in zip(tasks, reports, strict=True) if not r.all_passed]
    assert failures == []
    assert all(5 <= len(t.payload["tests"]) <= 8 for t in tasks)


def test_split_is_by_template_and_deterministic(suite):
    train = {t.payload["template"] for level in (1, 2, 3, 4) for t in suite.tasks("train", 40, level=level)}
    test = {t.payload["template"] for level in (1, 2, 3, 4) for t in suite.tasks("test", 40, level=level)}
    assert train and test and not train & test
    a, b = suite.tasks("test", 6, level=3, seed=2), suite.tasks("test", 6, level=3, seed=2)
    assert [(t.task_id, t.instruction, t.payload) for t in a] == [(t.task_id, t.instruction, t.payload) for t in b]


def test_partial_credit_and_first_failing_test_feedback(suite):
    task = next(t for t in suite.tasks("train", 8, level=1) if t.payload["function"] == "sum_above")
    env = suite.make_env(task)
    env.reset(task)
    assert env.step("```python\ndef sum_above(nums):\n    return sum(x for x in nums if x > 0)\n```").done
    result = env.result()
    assert 0 <= result.reward < 1 and not result.success
    assert result.feedback.startswith("test ") and "expected" in result.feedback
    assert result.checklist["total"] == len(task.payload["tests"])
    env.reset(task)
    env.step(task.oracle)
    assert env.result().reward == 1.0 and env.result().success


def test_errors_timeouts_and_missing_function_are_feedback_not_crashes(suite):
    tests = [{"args": [[1, 2]], "expected": 3}, {"args": [[]], "expected": 0}]
    report = run_tests("def f(xs):\n    while True:\n        pass\n", "f", tests, per_test_s=0.3)
    assert report.passed == 0 and "TimeoutError" in report.feedback
    report = run_tests("def g(xs):\n    return 1\n", "f", tests)
    assert report.passed == 0 and "no function named f" in report.feedback
    report = run_tests("def f(xs)\n    return 1\n", "f", tests)
    assert "could not be loaded: SyntaxError" in report.feedback
    report = run_tests("print('noise ' * 5000)\ndef f(xs):\n    print('more')\n    return sum(xs)\n", "f", tests)
    assert report.all_passed  # the program's own prints do not disturb the harness
    report = run_tests("import os\ndef f(xs):\n    os._exit(0)\n", "f", tests)
    assert report.passed == 0 and "did not finish" in report.feedback


@pytest.mark.parametrize("answer", [
    "Here you go:\n```python\ndef f(x):\n    return x + 1\n```\nThis adds one.",
    "```\ndef f(x):\n    return x + 1\n```",
    "def f(x):\n    return x + 1\n\nThis function adds one to x.",
    "Sure! def is a keyword.\ndef f(x):\n    return x + 1",
    "```python\nimport math\n```\n```python\ndef f(x):\n    return x + 1\n```",
])
def test_extract_code(answer):
    code = extract_code(answer, "f")
    namespace = {}
    exec(code, namespace)
    assert namespace["f"](1) == 2


def test_tiny_model_episode_scores_without_crashing(suite, tiny_model, tiny_tokenizer):
    import torch

    from lopd_core.records.chat import render_prompt_ids

    task = suite.tasks("train", 1, level=1)[0]
    env = suite.make_env(task)
    ids = render_prompt_ids(tiny_tokenizer, env.reset(task))
    with torch.no_grad():
        out = tiny_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                  pad_token_id=tiny_tokenizer.pad_token_id)
    text = tiny_tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    assert env.step(text).done
    result = env.result()
    assert result.reward == 0.0 and not result.success and result.feedback


# ------------------------------------------------------------------ reward hacks: each must score 0
def _sum_above_task(suite):
    return next(t for t in suite.tasks("train", 8, level=1) if t.payload["function"] == "sum_above")


def _score(suite, task, code):
    env = suite.make_env(task)
    env.reset(task)
    env.step(f"```python\n{code}\n```")
    result = env.result()
    assert 0.0 <= result.reward <= 1.0
    return result


def test_hack_reading_expected_values_from_files_scores_zero(suite):
    # The old harness kept the expected values in tests.json in the working directory. Now only the inputs
    # enter the sandbox: this answer searches every file it can read and finds no expected value.
    code = ("import json, os\n"
            "def sum_above(nums):\n"
            "    seen = []\n"
            "    for top in ('.', '/tmp', '/sandbox', '/var/tmp', '/dev/shm'):\n"
            "        for folder, _, names in os.walk(top):\n"
            "            for name in names:\n"
            "                try:\n"
            "                    text = open(os.path.join(folder, name)).read()\n"
            "                except OSError:\n"
            "                    continue\n"
            "                seen.append(name)\n"
            "                if name.endswith('.json') and 'expected' in text:\n"
            "                    for case in json.loads(text).get('tests', []):\n"
            "                        if case['args'] == [nums]:\n"
            "                            return case['expected']\n"
            "    raise LookupError('no expected value in ' + ','.join(sorted(set(seen))))\n")
    result = _score(suite, _sum_above_task(suite), code)
    assert result.reward == 0.0 and not result.success
    assert "LookupError: no expected value in inputs.json,main.py,solution.py" in result.feedback


def test_hack_forged_result_lines_and_exit_score_zero(suite):
    task = _sum_above_task(suite)
    n = len(task.payload["tests"])
    # The probe that scored 1.0 before: read the harness's nonce, print nonce-tagged 'passed' lines (also on
    # the channel now), then exit cleanly before any test ran.
    code = ("import os, sys\n"
            "nonce = sys.stdin.readline().strip()\n"
            f"forged = ''.join(nonce + '{{\"i\": %d, \"ok\": true}}\\n' % i for i in range({n}))\n"
            "sys.__stdout__.write(forged)\n"
            "sys.__stdout__.flush()\n"
            "os.write(3, forged.encode())\n"
            "os._exit(0)\n"
            "def sum_above(nums):\n    return 0\n")
    result = _score(suite, task, code)
    assert result.reward == 0.0 and "not scored" in result.feedback
    # 50 forged lines, each with the right value (as if the candidate knew them): duplicates void the run.
    right = [json.dumps({"i": i % n, "value": repr(task.payload["tests"][i % n]["expected"])}) for i in range(50)]
    lines = json.dumps('{"loaded": true}\n' + "\n".join(right) + "\n")
    code = ("import os\n"
            f"os.write(3, {lines}.encode())\n"
            "os._exit(0)\n"
            "def sum_above(nums):\n    return 0\n")
    result = _score(suite, task, code)
    assert result.reward == 0.0 and "two results" in result.feedback
    assert result.checklist["passed"] == 0 and result.checklist["total"] == n


def test_hack_patching_the_harness_from_inside_the_function_scores_zero(suite):
    # The old comparator ('close') ran next to the candidate; now the comparison runs in lopd. Patching what
    # the harness does use (its report function, repr, json) can only make it send something else.
    code = ("import builtins, json, sys\n"
            "def sum_above(nums):\n"
            "    harness = sys._getframe(1).f_globals\n"
            "    harness['close'] = lambda a, b: True\n"
            "    real = harness['report']\n"
            "    harness['report'] = lambda obj: real({**obj, 'ok': True})\n"
            "    builtins.repr = lambda value: 'True'\n"
            "    json.dumps = lambda obj: '{\"i\": 0, \"ok\": true}'\n"
            "    return -1\n")
    result = _score(suite, _sum_above_task(suite), code)
    assert result.reward == 0.0 and not result.success


def test_hack_reading_the_templates_and_reference_solutions_scores_zero(suite):
    from lopd_core.envs.codegen import templates

    code = ("import importlib.util\n"
            "def sum_above(nums):\n"
            f"    source = open({templates.__file__!r}).read()\n"
            "    return source\n")
    result = _score(suite, _sum_above_task(suite), code)
    assert result.reward == 0.0 and "FileNotFoundError" in result.feedback
    code = ("import importlib.util\n"
            "def sum_above(nums):\n"
            "    raise LookupError(str(importlib.util.find_spec('lopd_core')))\n")
    result = _score(suite, _sum_above_task(suite), code)
    assert "LookupError: None" in result.feedback


def test_results_are_decoded_as_literals_and_rewards_stay_in_range():
    tests = [{"args": [[1, 2]], "expected": [1, 2]}, {"args": [[3]], "expected": [3]}]
    assert run_tests("def f(xs):\n    return tuple(xs)\n", "f", tests).all_passed  # JSON view: a tuple is a list
    report = run_tests("class Sneaky:\n    def __eq__(self, other):\n        return True\n"
                       "def f(xs):\n    return Sneaky()\n", "f", tests)
    assert report.passed == 0 and "not a plain value" in report.feedback
    report = run_tests("def f(xs):\n    return __import__('os').system('true') or xs\n", "f", tests)
    assert report.all_passed  # ordinary code still works
    with pytest.raises(ValueError, match="outside"):
        harness.TestReport(passed=7, total=6, feedback="")
    with pytest.raises(ProtocolError, match="not a result"):
        parse_channel('{"loaded": true}\n{"i": 0, "ok": true}\n', 2)
    with pytest.raises(ProtocolError, match="not a result"):
        parse_channel('{"loaded": true}\n{"i": 5, "value": "1"}\n', 2)
    assert parse_channel('{"loaded": true}\n{"i": 1, "value": "1"}\n', 2) == (None, {1: {"i": 1, "value": "1"}})
