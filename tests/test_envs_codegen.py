"""codegen: 44 templates whose reference solutions pass their hidden tests in the sandbox, partial credit,
feedback, code extraction, the template split, and a real (tiny-model) episode."""

from __future__ import annotations

import collections

import pytest

from lopd_core.envs import get_suite
from lopd_core.envs.codegen.harness import extract_code, run_tests, run_tests_batch
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
