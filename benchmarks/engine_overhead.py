"""Agent-loop overhead: generated tokens/s of ``run_episodes`` with the hf engine vs bare ``model.generate``.

What it measures (writes ``benchmarks/results/engine_overhead.json``): real toolworld episodes (train
split, level 1) of ``--batch`` tasks played for up to ``--turns`` turns by the agent loop with the hf engine
(batch = all episodes, so one generate call per turn). Every generate call the engine received is recorded
(its prompts and sampling parameters) and then replayed, in the same process, as a bare batched
``model.generate`` on the same left-padded prompts with the same generation config and the same seed, only
without ``output_scores`` and without anything around it. With the same seed and order the bare replay
samples the very same tokens as the engine did (``identical_tokens`` checks it), so both sides produce the
same tokens; the agent side counts only what it kept (the same, unless the trajectory cap cut a turn).

- agent tokens/s = generated tokens / wall time of the whole ``run_episodes`` call (rendering, the
  sentinel-split suffixes, decoding, the environments, log-prob recording included);
- bare tokens/s = the same tokens / the summed wall time of the bare ``generate`` calls;
- ``ratio`` = median agent tokens/s / median bare tokens/s over ``--repeats`` alternating runs
  (goal ≥ 0.9).

    python -m benchmarks.engine_overhead            # SmolLM2-135M fp32, batch 8, 3 turns, 160 new tokens, 3 repeats
    python -m benchmarks.engine_overhead --quick    # tiny model, batch 4, 2 turns, 16 new tokens, 2 repeats
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "engine_overhead.json"


class _RecordingEngine:
    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, inner.name, []

    def generate(self, prompts, params):
        gens = self.inner.generate(prompts, params)
        self.calls.append(([list(p) for p in prompts], params, [g.token_ids for g in gens]))
        return gens

    def update_policy(self, model, version):
        self.inner.update_policy(model, version)


def bare_replay(engine, calls) -> tuple[float, list[list[int]]]:
    """Replay each recorded call with plain batched ``model.generate``; (seconds, new tokens per row/call)."""
    model, total, outputs = engine.model, 0.0, []
    for prompts, params, _ in calls:
        config = engine._generation_config(params)
        config.output_scores, config.return_dict_in_generate = False, False
        ids, mask = engine._left_pad(prompts, next(model.parameters()).device)
        stop = set(params.stop_token_ids)
        with torch.random.fork_rng(devices=[]), torch.inference_mode():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            t0 = time.perf_counter()
            seqs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            total += time.perf_counter() - t0
        for row in seqs[:, ids.shape[1]:].tolist():
            cut = next((i + 1 for i, tok in enumerate(row) if tok in stop), len(row))
            outputs.append(row[:cut])
    return total, outputs


def run(args) -> dict:
    from lopd_core.envs import get_suite
    from lopd_core.models.loading import load_model_and_tokenizer
    from lopd_core.rollout.agent import run_episodes
    from lopd_core.rollout.engines.base import SamplingParams
    from lopd_core.rollout.engines.hf import HFEngine
    from lopd_core.workspace import Workspace

    ws = Workspace.default().ensure()
    model, tok = load_model_and_tokenizer(args.model, ws.models_dir, dtype=args.dtype, device="cpu")
    suite = get_suite("toolworld")
    tasks = suite.tasks("train", args.batch, level=1, seed=0)
    engine = HFEngine(model, tok, batch_size=args.batch)
    sampling = SamplingParams(temperature=0.7, top_p=0.95, top_k=20, max_new_tokens=args.max_new_tokens, seed=0)

    agent_rates, bare_rates, identical, tokens, previous_calls = [], [], True, 0, None
    for r in range(args.repeats + 1):  # run 0 warms up both paths and is not counted
        rec = _RecordingEngine(engine)
        if r % 2 == 0 or previous_calls is None:  # alternate which side runs first (drift on a shared machine)
            t0 = time.perf_counter()
            trajs = run_episodes(rec, tok, suite, tasks, max_turns=args.turns, max_trajectory_tokens=4096,
                                 sampling=sampling)
            agent_s = time.perf_counter() - t0
            bare_s, bare_rows = bare_replay(engine, rec.calls)
        else:  # same seed, same tasks: the calls are those of the previous run
            bare_s, bare_rows = bare_replay(engine, previous_calls)
            t0 = time.perf_counter()
            trajs = run_episodes(rec, tok, suite, tasks, max_turns=args.turns, max_trajectory_tokens=4096,
                                 sampling=sampling)
            agent_s = time.perf_counter() - t0
        previous_calls = rec.calls
        generated = sum(t.n_generated for t in trajs)
        engine_rows = [g for _, _, gens in rec.calls for g in gens]
        bare_total = sum(len(x) for x in bare_rows)
        identical &= bare_rows == engine_rows
        print(f"run {r}: agent {generated / agent_s:.1f} tok/s ({generated} tokens, {agent_s:.2f} s) | "
              f"bare {bare_total / bare_s:.1f} tok/s ({bare_total} tokens, {bare_s:.2f} s)", file=sys.stderr)
        if r == 0:
            continue
        agent_rates.append(generated / agent_s)
        bare_rates.append(bare_total / bare_s)
        tokens = generated
    ratio = statistics.median(agent_rates) / statistics.median(bare_rates)
    return {
        "benchmark": "engine_overhead",
        "command": "python -m benchmarks.engine_overhead " + " ".join(sys.argv[1:]),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
        "goal": "agent-loop generated tokens/s >= 0.9x bare batched model.generate",
        "setup": {"model": args.model, "dtype": args.dtype, "suite": "toolworld", "batch": args.batch,
                  "max_turns": args.turns, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                  "sampling": sampling.to_dict()},
        "generated_tokens_per_run": tokens,
        "identical_tokens": identical,
        "agent_tokens_per_s": {"median": statistics.median(agent_rates), "runs": agent_rates},
        "bare_generate_tokens_per_s": {"median": statistics.median(bare_rates), "runs": bare_rates},
        "ratio": ratio,
        "meets_goal_ratio_ge_0_9": ratio >= 0.9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0 = torch's default); 1 is far faster on a busy machine")
    parser.add_argument("--quick", action="store_true", help="tiny model, batch 4, 2 turns, 16 tokens, 2 repeats")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.quick:
        args.model, args.batch, args.turns, args.max_new_tokens, args.repeats = "tiny", 4, 2, 16, 2
    result = run(args)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("ratio", "identical_tokens", "meets_goal_ratio_ge_0_9")}))


if __name__ == "__main__":
    main()
