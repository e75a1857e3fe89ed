"""codegen: procedural Python function-writing tasks verified by hidden unit tests in the sandbox.

A task instantiates one of the 51 templates of :mod:`lopd_core.envs.codegen.templates` with drawn
parameters (thresholds, shift amounts, coin sets …) and draws 6–8 hidden test inputs; the expected outputs
come from the template's reference solution (our own trusted code, run in-process at task creation). The
prompt shows the signature, the specification and one worked example (an input that is not among the
hidden tests). The episode is one assistant turn: the code is extracted from the answer (a ```python
fence, else bare code), the hidden test inputs run in one sandboxed process that hands back the function's
outputs, and this process compares them with the expected values (which never enter the sandbox; see
:mod:`lopd_core.envs.codegen.harness`): reward = fraction passed, success = all passed; feedback = the first
failing test (call, got, expected) or the load error / timeout. A run the sandbox refused or could not
fully contain scores 0 unless ``LOPD_SANDBOX_ALLOW_UNCONTAINED=1``.

Split: train tasks use the 37 train templates, test tasks the 14 test templates (3-5 per level), so no
evaluation template — and hence no evaluation function — is ever trained on. ``Task.oracle`` is the
reference solution in a fence.
"""

from __future__ import annotations

import json
import random
from typing import Any, Literal

from lopd_core.envs.base import EpisodeResult, Split, StepResult, Task
from lopd_core.envs.codegen.harness import extract_code, run_tests
from lopd_core.envs.codegen.templates import TEMPLATES, Template

LEVELS = (1, 2, 3, 4)

SYSTEM_PROMPT = ("You are an expert Python programmer. Reply with one ```python code block that defines the "
                 "requested function (standard library only), and nothing else.")


def _reference(template: Template, params: dict[str, Any]):
    namespace: dict[str, Any] = {}
    exec(compile(template.solution.format(**params), f"<reference {template.key}>", "exec"), namespace)  # noqa: S102 - our own template code
    return template.solution.format(**params), namespace[template.function]


def _expected(fn, args: list[Any]) -> Any:
    import copy

    return json.loads(json.dumps(fn(*copy.deepcopy(args))))


class CodegenEnvironment:
    def __init__(self, task: Task, *, per_test_s: float = 2.0) -> None:
        self.task = task
        self.per_test_s = per_test_s
        self.reset(task)

    def reset(self, task: Task) -> list[dict[str, Any]]:
        self.task = task
        self._result: EpisodeResult | None = None
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.instruction}]

    def step(self, assistant_text: str) -> StepResult:
        function = self.task.payload["function"]
        code = extract_code(assistant_text, function)
        report = run_tests(code, function, self.task.payload["tests"], per_test_s=self.per_test_s)
        self._result = EpisodeResult(
            reward=round(report.reward, 6), success=report.all_passed, feedback=report.feedback,
            checklist={"passed": report.passed, "total": report.total, "all_passed": report.all_passed,
                       "sandbox_status": report.verdict_status, "code_chars": len(code),
                       "uncontained": report.uncontained},
        )
        return StepResult(observation=None, done=True)

    def result(self) -> EpisodeResult:
        if self._result is None:
            return EpisodeResult(reward=0.0, success=False, feedback="no answer was given",
                                 checklist={"passed": 0, "total": len(self.task.payload["tests"]), "all_passed": False})
        return self._result


class CodegenSuite:
    name = "codegen"
    kind: Literal["tool", "code"] = "code"

    def __init__(self, templates: list[Template] | None = None) -> None:
        self.templates = templates or TEMPLATES

    def templates_for(self, split: Split, level: int) -> list[Template]:
        return [t for t in self.templates if t.split == split and t.level == level]

    def tasks(self, split: Split, n: int, *, level: int = 1, seed: int = 0) -> list[Task]:
        if split not in ("train", "test"):
            raise ValueError(f"codegen: split must be 'train' or 'test' (got {split!r})")
        if level not in LEVELS:
            raise ValueError(f"codegen: level must be one of {LEVELS} (got {level})")
        pool = self.templates_for(split, level)
        return [self._task(split, level, seed, i, pool[i % len(pool)]) for i in range(n)]

    def _task(self, split: Split, level: int, seed: int, index: int, template: Template) -> Task:
        task_id = f"codegen/{split}/L{level}/s{seed}/{index:05d}"
        rng = random.Random(task_id)
        params = template.params(rng)
        source, fn = _reference(template, params)
        example_args, *case_args = [list(c) for c in template.cases(rng, params)]
        tests = [{"args": a, "expected": _expected(fn, a)} for a in case_args]
        example = f">>> {template.function}({', '.join(repr(a) for a in example_args)})\n{_expected(fn, example_args)!r}"
        instruction = (f"Write a Python function `{template.signature}` that {template.description.format(**params)}.\n"
                       f"Example:\n{example}")
        return Task(
            task_id=task_id, suite=self.name, family=f"codegen/{template.key}", split=split, level=level,
            instruction=instruction, tools=[],
            payload={"template": template.key, "function": template.function, "params": params, "tests": tests},
            oracle=f"```python\n{source}```",
        )

    def make_env(self, task: Task) -> CodegenEnvironment:
        if "tests" not in task.payload or "function" not in task.payload:
            raise ValueError(f"task {task.task_id} is not a codegen task (payload needs 'function' and 'tests')")
        return CodegenEnvironment(task)
