"""External benchmarks (BFCL single-turn, HumanEval) for the final students of a `lopd compare` root.

    python -m benchmarks.external_eval --root $LOPD_HOME/compare/codegen --bfcl 8 --humaneval 8

Loads the base model once, loads each run's final student into it (LoRA adapter or full weights, as the
profile's ``model.student`` says) and
scores it greedily on the first ``--bfcl`` tasks of each BFCL level (simple, multiple, parallel,
parallel_multiple → levels 1-4; ``--bfcl-levels``) and the first ``--humaneval`` HumanEval problems (in the
sandbox). Writes ``benchmarks/results/external_eval_<suite>.json``; ``--resume`` keeps the rows already
there (same settings) and scores only the runs that are missing, so runs finished later are added.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SHAPES = {"bfcl": {"rollout.max_turns": 1, "rollout.max_new_tokens": 160, "rollout.max_trajectory_tokens": 3072},
          "humaneval": {"rollout.max_turns": 1, "rollout.max_new_tokens": 384, "rollout.max_trajectory_tokens": 1536}}


def main(argv: list[str] | None = None) -> int:
    from lopd_core.compare import final_dir
    from lopd_core.config import load_config
    from lopd_core.evaluation import evaluate
    from lopd_core.training import build_policies
    from lopd_core.workspace import Workspace, portable

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True, help="a `lopd compare` work directory")
    parser.add_argument("--profile", default="demo")
    parser.add_argument("--bfcl", type=int, default=8)
    parser.add_argument("--bfcl-levels", type=int, nargs="+", default=[1])
    parser.add_argument("--humaneval", type=int, default=8)
    parser.add_argument("--runs", nargs="+", default=None,
                        help="run keys to score (e.g. lopd-s0 grpo-s0); default: every finished run")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/external_eval_<suite>.json")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows of --out scored with the same settings and score only the other runs")
    args = parser.parse_args(argv)
    out = args.out or RESULTS / f"external_eval_{args.root.name}.json"
    settings = {"profile": args.profile, "bfcl": args.bfcl, "bfcl_levels": args.bfcl_levels, "humaneval": args.humaneval}
    done = {}
    if args.resume and out.exists():
        previous = json.loads(out.read_text())
        if previous.get("settings") == settings:
            done = {row["run"]: row for row in previous["results"]}
        else:
            print(f"--resume: {out} was scored with other settings ({previous.get('settings')}); scoring every run")

    cfg = load_config(args.profile)
    policies = build_policies(cfg, models_dir=Workspace.from_config(cfg.workspace).models_dir)
    runs = {"base": None}
    for result in sorted(args.root.glob("runs/*/result.json")):
        if args.runs is None or result.parent.name in args.runs:
            runs[result.parent.name] = final_dir(args.root, result.parent.name) / "student"
    if args.runs is not None and (missing := set(args.runs) - set(runs)):
        parser.error(f"no finished run {', '.join(sorted(missing))} under {args.root / 'runs'}")
    rows = []
    for name, student in runs.items():
        if name in done:
            print(f"{name}: kept from {out.name}", flush=True)
            rows.append(done[name])
            continue
        if student is not None:
            policies.load_student(student)  # the run's adapter (or full weights) into the one loaded base
        scope = policies.teacher if student is None else policies.student
        row = {"run": name}
        jobs = [("bfcl", lvl, args.bfcl) for lvl in args.bfcl_levels] + [("humaneval", 1, args.humaneval)]
        for suite, level, n in jobs:
            if n <= 0:
                continue
            t0 = time.perf_counter()
            scfg = cfg.with_overrides({**SHAPES[suite], "rollout.suite": suite, "rollout.level": level,
                                       "evaluate.n_tasks": n, "evaluate.probe_n_tasks": 0, "evaluate.probe_prompts": 0})
            m = evaluate(scope, policies.tokenizer, cfg=scfg, suite_name=suite, policy_version=name, with_probe=False).metrics
            row[f"{suite}_l{level}"] = {"success_rate": m["eval/success_rate"], "n": n,
                                        "seconds": round(time.perf_counter() - t0, 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    suite_name = args.root.name
    command = portable("python -m benchmarks.external_eval " + " ".join(argv or []),
                       Workspace.from_config(cfg.workspace).home)
    out.write_text(json.dumps({"benchmark": f"external_eval_{suite_name}", "command": command,
                               "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": {"cpus": os.cpu_count()},
                               "settings": settings,
                               "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
