"""Starting success of the base model on every suite and level (greedy and sampled), for difficulty tuning.

What it measures: for each (suite, split, level, decoding) the success rate, mean reward, tool-call
statistics, tokens per episode and generated tokens/s of real multi-turn episodes played by
:func:`lopd_core.rollout.agent.run_episodes` with the ``hf`` engine on SmolLM2-135M-Instruct (fp32, CPU).
Decoding: greedy, and the rollout sampling defaults (temperature 0.7, top-p 0.95, top-k 20, fixed seed).
The target (issue: starting success) is 10–40 % on level 1 of the toolworld and codegen TRAIN splits,
so that learning is visible at this scale.

Run (writes benchmarks/results/suite_baseline.json; merge-updates entries measured before)::

    python -m benchmarks.suite_baseline                       # toolworld + codegen, levels 1-4, 32 episodes
    python -m benchmarks.suite_baseline --quick               # level 1 only, 16 episodes
    python -m benchmarks.suite_baseline --suites humaneval bfcl --n 64 --modes greedy

No timing assertion anywhere: throughput is recorded for context only (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "suite_baseline.json"
SETTINGS = {  # per-suite episode shape (the demo profile for tool use; one longer turn for code)
    "tool": {"max_turns": 4, "max_new_tokens": 96, "max_trajectory_tokens": 1024},
    "code": {"max_turns": 1, "max_new_tokens": 256, "max_trajectory_tokens": 1024},
    # BFCL: one turn, but its function docs make prompts of up to ~2k tokens (parallel_multiple)
    "bfcl": {"max_turns": 1, "max_new_tokens": 160, "max_trajectory_tokens": 3072},
}
MODES = {"greedy": {"temperature": 0.0}, "sample": {"temperature": 0.7, "top_p": 0.95, "top_k": 20}}


def _levels(suite_name: str, requested: list[int]) -> list[int]:
    if suite_name == "humaneval":
        return [1]
    return requested


def _splits(suite_name: str, requested: list[str]) -> list[str]:
    return ["test"] if suite_name in ("humaneval", "bfcl") else requested


def measure(model_name: str, suites: list[str], levels: list[int], splits: list[str], modes: list[str], n: int,
            batch_size: int, seed: int) -> list[dict]:
    import torch

    from lopd_core.envs import get_suite
    from lopd_core.models.loading import load_model_and_tokenizer
    from lopd_core.rollout.agent import run_episodes, summarize_trajectories
    from lopd_core.rollout.engines.base import SamplingParams
    from lopd_core.rollout.engines.hf import HFEngine
    from lopd_core.workspace import Workspace

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    ws = Workspace.default().ensure()
    model, tokenizer = load_model_and_tokenizer(model_name, ws.models_dir, dtype="float32", device="cpu")
    engine = HFEngine(model, tokenizer, batch_size=batch_size)
    rows = []
    for suite_name in suites:
        suite = get_suite(suite_name)
        shape = SETTINGS.get(suite_name, SETTINGS[suite.kind])
        for split in _splits(suite_name, splits):
            for level in _levels(suite_name, levels):
                tasks = suite.tasks(split, n, level=level, seed=seed)
                for mode in modes:
                    params = SamplingParams(max_new_tokens=shape["max_new_tokens"], seed=seed,
                                            **{**{"top_p": 1.0, "top_k": 0}, **MODES[mode]})
                    t0 = time.perf_counter()
                    trajs = run_episodes(engine, tokenizer, suite, tasks, max_turns=shape["max_turns"],
                                         max_trajectory_tokens=shape["max_trajectory_tokens"], sampling=params,
                                         progress=True)
                    wall = time.perf_counter() - t0
                    m = summarize_trajectories(trajs, wall_s=wall)
                    row = {
                        "suite": suite_name, "split": split, "level": level, "mode": mode, "n": len(trajs),
                        "success_rate": round(m["rollout/success_rate"], 4),
                        "mean_reward": round(m["rollout/mean_reward"], 4),
                        "mean_tokens": round(m["rollout/mean_tokens"], 1),
                        "mean_turns": round(m["rollout/mean_turns"], 2),
                        "tool_calls_per_episode": round(m["rollout/tool_calls"] / max(1, len(trajs)), 2),
                        "invalid_calls_per_turn": round(m["rollout/invalid_calls_per_turn"], 3),
                        "generated_tokens_per_s": round(m["rollout/generated_tokens_per_s"], 1),
                        "wall_s": round(wall, 1),
                        "statuses": {k.split("_", 1)[1]: v for k, v in m.items() if k.startswith("rollout/status_")},
                        "example_feedback": next((t.feedback for t in trajs if not t.success), ""),
                    }
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--suites", nargs="+", default=["toolworld", "codegen"])
    parser.add_argument("--levels", nargs="+", type=int, default=[1, 2, 3, 4])
    parser.add_argument("--splits", nargs="+", default=["train"])
    parser.add_argument("--modes", nargs="+", default=["greedy", "sample"], choices=sorted(MODES))
    parser.add_argument("--n", type=int, default=32, help="episodes per (suite, split, level, mode)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="level 1 only, 16 episodes")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.levels, args.n = [1], min(args.n, 16)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows = measure(args.model, args.suites, args.levels, args.splits, args.modes, args.n, args.batch_size, args.seed)

    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    key = lambda r: (r["suite"], r["split"], r["level"], r["mode"])  # noqa: E731
    merged = {key(r): r for r in previous.get("results", [])}
    command = "python -m benchmarks.suite_baseline " + " ".join(argv if argv is not None else sys.argv[1:])
    merged.update({key(r): {**r, "command": command} for r in rows})
    report = {
        "benchmark": "suite_baseline",
        "model": args.model,
        "command": command,
        "note": "each result row carries the command that measured it (runs are merged by suite/split/level/mode)",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "settings": SETTINGS, "modes": MODES, "seed": args.seed,
        "target": "level-1 train success of toolworld and codegen between 0.10 and 0.40",
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "results": sorted(merged.values(), key=lambda r: (r["suite"], r["split"], r["level"], r["mode"])),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"written": str(args.out), "rows": len(rows)}))


if __name__ == "__main__":
    main()
