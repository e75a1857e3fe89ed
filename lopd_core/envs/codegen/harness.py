"""Running hidden unit tests against model-written code, inside the sandbox.

One sandbox process per solution runs every test of the task (one interpreter start instead of one per
test; several tasks run concurrently through :func:`lopd_core.envs.sandbox.run_batch`). The harness loads
``solution.py`` with the program's own prints silenced, looks up the function, then calls it once per test
case with a per-test alarm, comparing the JSON-normalised result to the expected value (floats with a
tolerance). Results come back as stdout lines prefixed with a nonce the harness reads from stdin, so
ordinary prints cannot be mistaken for results.

Not a defence against code that deliberately inspects and patches the harness (see the sandbox docstring).
Code extraction from a free-form answer lives here too (:func:`extract_code`).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from lopd_core.envs.sandbox import SandboxJob, SandboxLimits, Verdict, run_batch

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_CODE_START_RE = re.compile(r"^(def |class |import |from |@|async def )", re.MULTILINE)

HARNESS = r'''
import copy, io, json, math, signal, sys
NONCE = sys.stdin.readline().strip()
OUT = sys.__stdout__
def report(obj):
    OUT.write(NONCE + json.dumps(obj) + "\n")
    OUT.flush()
spec = json.load(open("tests.json"))
sys.stdout = io.StringIO()
ns = {"__name__": "solution"}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
except BaseException as exc:
    report({"load_error": (type(exc).__name__ + ": " + str(exc))[:300]})
    raise SystemExit(0)
fn = ns.get(spec["function"])
if not callable(fn):
    report({"load_error": "no function named " + spec["function"] + " is defined"})
    raise SystemExit(0)
def close(a, b):
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    return a == b
def on_alarm(signum, frame):
    raise TimeoutError("took longer than %g s" % spec["per_test_s"])
signal.signal(signal.SIGALRM, on_alarm)
for i, case in enumerate(spec["tests"]):
    sys.stdout = io.StringIO()
    signal.setitimer(signal.ITIMER_REAL, spec["per_test_s"])
    try:
        got = fn(*copy.deepcopy(case["args"]))
        signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            norm = json.loads(json.dumps(got))
        except (TypeError, ValueError):
            report({"i": i, "ok": False, "got": repr(got)[:200], "error": "the result is not a plain value"})
            continue
        report({"i": i, "ok": close(norm, case["expected"]), "got": repr(got)[:200]})
    except BaseException as exc:
        signal.setitimer(signal.ITIMER_REAL, 0)
        report({"i": i, "ok": False, "error": (type(exc).__name__ + ": " + str(exc))[:300]})
'''


@dataclass
class TestReport:
    passed: int
    total: int
    feedback: str
    """The first failing test (call, got, expected) or the load error / sandbox verdict."""
    results: list[dict[str, Any]] = field(default_factory=list)
    verdict_status: str = "ok"

    @property
    def reward(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


def extract_code(answer: str, function: str | None = None) -> str:
    """The Python code in a free-form answer: the fenced block that defines ``function`` (else the first
    fenced block), or bare code from the first ``def``/``import`` line, trimmed until it compiles."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE_RE.findall(answer)]
    blocks = [(lang, body) for lang, body in blocks if lang in ("", "python", "py", "python3")] or blocks
    if blocks:
        if function:
            for _, body in blocks:
                if re.search(rf"^\s*def\s+{re.escape(function)}\s*\(", body, re.MULTILINE):
                    return body.strip("\n")
        return blocks[0][1].strip("\n")
    match = _CODE_START_RE.search(answer)
    if not match:
        return answer.strip("\n").rstrip()  # keep leading indentation: it may be a bare function body
    code = answer[match.start():]
    lines = code.rstrip().splitlines()
    while lines:
        candidate = "\n".join(lines)
        try:
            compile(candidate, "solution.py", "exec")
            return candidate
        except (SyntaxError, ValueError):
            lines.pop()
    return code.strip()


def _call_text(function: str, args: list[Any]) -> str:
    return f"{function}({', '.join(repr(a) for a in args)})"


def _report(function: str, tests: list[dict[str, Any]], verdict: Verdict, nonce: str) -> TestReport:
    results: dict[int, dict[str, Any]] = {}
    load_error = None
    for line in verdict.stdout.splitlines():
        if not line.startswith(nonce):
            continue
        try:
            msg = json.loads(line[len(nonce):])
        except json.JSONDecodeError:
            continue
        if "load_error" in msg:
            load_error = msg["load_error"]
        elif isinstance(msg.get("i"), int):
            results[msg["i"]] = msg
    passed = sum(1 for r in results.values() if r.get("ok") is True)
    if load_error:
        feedback = f"the code could not be loaded: {load_error}"
    else:
        feedback = "all tests passed"
        for i, case in enumerate(tests):
            r = results.get(i)
            call = _call_text(function, case["args"])
            if r is None:
                why = verdict.reason or "the program exited before running it"
                feedback = f"test {i + 1} ({call}) did not finish: {why}"
                break
            if not r.get("ok"):
                if "error" in r and "got" not in r:
                    feedback = f"test {i + 1} failed: {call} raised {r['error']}"
                else:
                    feedback = f"test {i + 1} failed: {call} returned {r.get('got')}, expected {case['expected']!r}"
                break
    ordered = [results.get(i, {"i": i, "ok": False, "error": "not run"}) for i in range(len(tests))]
    return TestReport(passed=passed, total=len(tests), feedback=feedback, results=ordered, verdict_status=verdict.status)


def run_tests_batch(jobs: list[tuple[str, str, list[dict[str, Any]]]], *, per_test_s: float = 2.0,
                    memory_mb: int = 512, workers: int | None = None) -> list[TestReport]:
    """Score many (code, function name, tests) jobs; tests are ``{"args": [...], "expected": value}``."""
    programs, nonces = [], []
    for code, function, tests in jobs:
        nonce = "@@" + secrets.token_hex(8) + "@@"
        nonces.append(nonce)
        spec = {"function": function, "tests": tests, "per_test_s": per_test_s}
        files = {"main.py": HARNESS, "solution.py": code, "tests.json": json.dumps(spec)}
        programs.append(SandboxJob(files=files, stdin=nonce + "\n"))
    longest = max((len(t) for _, _, t in jobs), default=1)
    limits = SandboxLimits(timeout_s=3.0 + per_test_s * longest, memory_mb=memory_mb, max_output_bytes=256_000)
    verdicts = run_batch(programs, limits=limits, workers=workers)
    return [_report(function, tests, verdict, nonce)
            for (_, function, tests), verdict, nonce in zip(jobs, verdicts, nonces, strict=True)]


def run_tests(code: str, function: str, tests: list[dict[str, Any]], **kwargs: Any) -> TestReport:
    return run_tests_batch([(code, function, tests)], **kwargs)[0]
