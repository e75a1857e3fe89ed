"""Running hidden unit tests against model-written code: outputs from the sandbox, verdict on our side.

One sandbox process per solution runs every test *input* of the task (one interpreter start instead of one
per test; several tasks run concurrently through :func:`lopd_core.envs.sandbox.run_batch`). The harness
inside loads ``solution.py`` with the program's own prints silenced, looks up the function, calls it once
per input with a per-test alarm and writes each result as ``repr`` to the sandbox's result channel (file
descriptor 3, apart from stdout). The parent decodes each result with :func:`ast.literal_eval` (never
pickle) and compares it, JSON-normalised (floats with a tolerance), with the expected value.

Why the candidate cannot score itself: the expected values and reference solutions never enter the sandbox
(only ``inputs.json``: the function name and the argument lists; the templates file and lopd itself are not
visible there either, see :mod:`lopd_core.envs.sandbox`), the comparison runs in the parent, and exit status
and printed text decide nothing. Code that writes to the channel itself can only claim outputs — which
are then compared like returned ones — and the parent accepts exactly one result per input: a malformed,
duplicate or out-of-range line, or a result after a load error, voids the whole run (reward 0). So the
reward is ``passed / total`` with ``passed <= total`` by construction.

Code extraction from a free-form answer lives here too (:func:`extract_code`).
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from lopd_core.envs.sandbox import SandboxJob, SandboxLimits, Verdict, run_batch

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_CODE_START_RE = re.compile(r"^(def |class |import |from |@|async def )", re.MULTILINE)
MAX_RESULT_CHARS = 100_000
"""Longest ``repr`` of one result the harness sends (a longer one counts as a failed test)."""

HARNESS = r'''
import ast, io, json, os, signal, sys
CHANNEL = os.fdopen(3, "w", encoding="utf-8")
def report(obj):
    CHANNEL.write(json.dumps(obj) + "\n")
    CHANNEL.flush()
spec = json.load(open("inputs.json"))
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
report({"loaded": True})
def on_alarm(signum, frame):
    raise TimeoutError("took longer than %g s" % spec["per_test_s"])
signal.signal(signal.SIGALRM, on_alarm)
for i, args in enumerate(spec["inputs"]):
    sys.stdout = io.StringIO()
    signal.setitimer(signal.ITIMER_REAL, spec["per_test_s"])
    try:
        text = repr(fn(*ast.literal_eval(args)))
        signal.setitimer(signal.ITIMER_REAL, 0)
        if len(text) > spec["max_chars"]:
            report({"i": i, "error": "the result is too large (%d characters)" % len(text)})
        else:
            report({"i": i, "value": text})
    except BaseException as exc:
        signal.setitimer(signal.ITIMER_REAL, 0)
        report({"i": i, "error": (type(exc).__name__ + ": " + str(exc))[:300]})
'''


@dataclass
class TestReport:
    passed: int
    total: int
    feedback: str
    """The first failing test (call, got, expected) or the load error / sandbox verdict."""
    results: list[dict[str, Any]] = field(default_factory=list)
    verdict_status: str = "ok"
    uncontained: list[str] = field(default_factory=list)
    """Sandbox protections missing for this run (scored only when the caller opted in to that)."""

    def __post_init__(self) -> None:
        if not 0 <= self.passed <= self.total:
            raise ValueError(f"TestReport: passed={self.passed} is outside [0, total={self.total}] (a verifier bug)")

    @property
    def reward(self) -> float:
        reward = self.passed / self.total if self.total else 0.0
        assert 0.0 <= reward <= 1.0, reward
        return reward

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


class ProtocolError(ValueError):
    """The sandboxed program wrote something to the result channel that the protocol does not allow."""


def decode_literal(text: Any) -> Any:
    """A value from its ``repr`` written by sandboxed code: :func:`ast.literal_eval` only (no code runs, no
    pickle); raises ValueError for anything that is not a plain literal or is too large."""
    if not isinstance(text, str):
        raise ValueError("the result is not a repr string")
    if len(text) > MAX_RESULT_CHARS:
        raise ValueError(f"the result is too large ({len(text)} characters)")
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
        raise ValueError(f"the result is not a plain value: {text[:120]}") from exc


def encode_literal(value: Any) -> str:
    """``repr(value)``, checked to decode back to an equal value with :func:`decode_literal`."""
    text = repr(value)
    try:
        same = decode_literal(text) == value
    except ValueError:
        same = False
    if not same:
        raise ValueError(f"{type(value).__name__} value {text[:120]} cannot pass through the literal codec")
    return text


def _normalise(value: Any) -> Any:
    """The JSON view of a result (tuples → lists), the form expected values are stored in."""
    return json.loads(json.dumps(value, allow_nan=False))


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def parse_channel(channel: str, n_tests: int, *, truncated: bool = False) -> tuple[str | None, dict[int, dict[str, Any]]]:
    """The harness's messages: (load error or None, one result per test index). Strict: the first line says
    loaded / load_error, then at most one ``{"i", "value" | "error"}`` per index in range; anything else
    raises :class:`ProtocolError`."""
    if truncated:
        raise ProtocolError("the result channel overflowed")
    lines = channel.splitlines()
    if channel and not channel.endswith("\n"):
        raise ProtocolError("the last line on the result channel is incomplete")
    results: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(lines):
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            raise ProtocolError(f"line {number + 1} on the result channel is not JSON") from None
        if not isinstance(msg, dict):
            raise ProtocolError(f"line {number + 1} on the result channel is not an object")
        if number == 0:
            if set(msg) == {"load_error"} and isinstance(msg["load_error"], str):
                if len(lines) > 1:
                    raise ProtocolError("results follow a load error")
                return msg["load_error"], {}
            if msg != {"loaded": True}:
                raise ProtocolError("the first line on the result channel is not the harness's")
            continue
        i = msg.get("i")
        kind = set(msg) - {"i"}
        if type(i) is not int or not 0 <= i < n_tests or kind not in ({"value"}, {"error"}) \
                or not isinstance(msg[kind.pop()], str):
            raise ProtocolError(f"line {number + 1} on the result channel is not a result of a test")
        if i in results:
            raise ProtocolError(f"test {i + 1} has two results")
        results[i] = msg
    return None, results


def _judge(message: dict[str, Any], expected: Any) -> dict[str, Any]:
    if "error" in message:
        return {"ok": False, "error": message["error"][:300]}
    text = message["value"]
    try:
        value = _normalise(decode_literal(text))
    except (ValueError, TypeError, RecursionError) as exc:
        return {"ok": False, "got": text[:200], "error": str(exc)[:300]}
    return {"ok": _close(value, expected), "got": text[:200]}


def _report(function: str, tests: list[dict[str, Any]], verdict: Verdict, allow_uncontained: bool) -> TestReport:
    total = len(tests)
    base = {"total": total, "verdict_status": verdict.status, "uncontained": verdict.uncontained}
    not_run = [{"i": i, "ok": False, "error": "not run"} for i in range(total)]
    if verdict.status == "refused":
        return TestReport(passed=0, feedback=f"not scored: the sandbox {verdict.reason}", results=not_run, **base)
    if verdict.uncontained and not allow_uncontained:
        return TestReport(passed=0, results=not_run, **base,
                          feedback=f"not scored: the sandbox did not contain this run ({', '.join(verdict.uncontained)})")
    try:
        load_error, messages = parse_channel(verdict.channel, total, truncated=verdict.channel_truncated)
    except ProtocolError as exc:
        return TestReport(passed=0, results=not_run, **base,
                          feedback=f"not scored: {exc} (only the test harness may write there)")
    results = {i: {"i": i, **_judge(m, tests[i]["expected"])} for i, m in messages.items()}
    passed = sum(1 for r in results.values() if r["ok"] is True)
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
            if not r["ok"]:
                if "got" not in r:
                    feedback = f"test {i + 1} failed: {call} raised {r['error']}"
                elif "error" in r:
                    feedback = f"test {i + 1} failed: {call} returned {r['got']}: {r['error']}"
                else:
                    feedback = f"test {i + 1} failed: {call} returned {r['got']}, expected {case['expected']!r}"
                break
    ordered = [results.get(i, {"i": i, "ok": False, "error": "not run"}) for i in range(total)]
    return TestReport(passed=passed, feedback=feedback, results=ordered, **base)


def run_tests_batch(jobs: list[tuple[str, str, list[dict[str, Any]]]], *, per_test_s: float = 2.0,
                    memory_mb: int = 512, workers: int | None = None,
                    allow_uncontained: bool = False) -> list[TestReport]:
    """Score many (code, function name, tests) jobs; tests are ``{"args": [...], "expected": value}``.

    Only the arguments go into the sandbox; the expected values stay here. ``allow_uncontained`` scores runs
    the sandbox could not fully contain (also ``LOPD_SANDBOX_ALLOW_UNCONTAINED=1``); otherwise they get 0.
    """
    programs = []
    for code, function, tests in jobs:
        spec = {"function": function, "inputs": [repr(list(t["args"])) for t in tests], "per_test_s": per_test_s,
                "max_chars": MAX_RESULT_CHARS}
        files = {"main.py": HARNESS, "solution.py": code, "inputs.json": json.dumps(spec)}
        programs.append(SandboxJob(files=files))
    longest = max((len(t) for _, _, t in jobs), default=1)
    limits = SandboxLimits(timeout_s=3.0 + per_test_s * longest, memory_mb=memory_mb, max_output_bytes=16_384,
                           max_channel_bytes=longest * (MAX_RESULT_CHARS + 400) + 4096,
                           allow_uncontained=allow_uncontained)
    verdicts = run_batch(programs, limits=limits, workers=workers)
    return [_report(function, tests, verdict, limits.uncontained_allowed)
            for (_, function, tests), verdict in zip(jobs, verdicts, strict=True)]


def run_tests(code: str, function: str, tests: list[dict[str, Any]], **kwargs: Any) -> TestReport:
    return run_tests_batch([(code, function, tests)], **kwargs)[0]
