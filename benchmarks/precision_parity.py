"""Is bf16 autocast safe for LOPD's signal? Per-token δ and the margin Δ in bf16 against fp32, and the speed.

The same toolworld oracle episodes are replayed through a text-context teacher (chat-turn experiences) and
the base model, once with ``model.autocast=off`` and once with ``bfloat16`` (decoder matmuls in bf16; the LM
head, log-softmax, δ and Δ in fp32). Reported: the largest and the mean per-token change of δ = log p_T −
log p_base, the change of the balanced margin, and the median time of a student forward+backward on the
episodes in each precision (ratio in the same process).

    python -m benchmarks.precision_parity                  # SmolLM2-135M (prepared), 8 episodes
    python -m benchmarks.precision_parity --model tiny --sharpen 10

Writes ``benchmarks/results/precision_parity.json``. The bar the issue set: both changes ≤ 0.002 nats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from lopd_core import losses
from lopd_core.algorithms.batch import to_padded
from lopd_core.algorithms.logprobs import model_logprobs, plain_student_batch, student_logprobs
from lopd_core.algorithms.synthetic import experience_of
from lopd_core.config import load_config
from lopd_core.envs import get_suite
from lopd_core.models.composer import experience_turns
from lopd_core.models.latent import experiences_prompt
from lopd_core.models.policy import build_policy_set
from lopd_core.privilege import action_logprobs
from lopd_core.rollout.oracle import oracle_episode

RESULTS = Path(__file__).parent / "results" / "precision_parity.json"
TOLERANCE = 0.002


def deltas(policies, episodes, contexts) -> list[torch.Tensor]:
    tok = policies.tokenizer

    def builder(rows):
        prompts = [experiences_prompt(tok, r.messages[: r.initial_messages], r.tools,
                                      [experience_turns(tok, contexts[r.episode_id], max_tokens=256)],
                                      placement="chat_turn") for r in rows]
        return prompts, lambda batch: model_logprobs(policies, None, batch)

    teacher = action_logprobs(policies, episodes, teacher=builder, micro_batch=2)
    base = action_logprobs(policies, episodes, teacher=None, micro_batch=2)
    return [t - b for t, b in zip(teacher, base, strict=True)]


def balanced_margin(per_episode: list[torch.Tensor], rewards: list[float]) -> float:
    mask = torch.zeros(len(per_episode), max(len(d) for d in per_episode))
    for i, d in enumerate(per_episode):
        mask[i, : len(d)] = 1.0
    weights = losses.margin_weights(torch.tensor(rewards), form="balanced")
    return float(losses.privilege_margin(to_padded(torch.cat(per_episode), mask), mask, weights))


def step_seconds(policies, episodes, repeats: int) -> float:
    """Median seconds of one student forward + backward over the episodes (two at a time)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for start in range(0, len(episodes), 2):
            batch = plain_student_batch(policies, episodes[start:start + 2])
            lp = student_logprobs(policies, batch)
            (-lp.max(-1).values.mean()).backward()
        for p in policies.student_parameters():
            p.grad = None
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def compare_precisions(cfg, models_dir, *, episodes: int = 6, sharpen: float = 1.0, repeats: int = 0) -> dict:
    suite = get_suite("toolworld")
    tasks = [t for t in suite.tasks("train", 80, level=1, seed=4) if t.family.startswith("weather")][:episodes]
    results = {}
    for precision in ("off", "bfloat16"):
        torch.manual_seed(0)
        policies = build_policy_set(cfg.model.model_copy(update={"autocast": precision}), cfg.distill.lopd, models_dir,
                                    device="cpu")
        if sharpen != 1.0:
            with torch.no_grad():
                policies.base.get_input_embeddings().weight.mul_(sharpen)
        rows = [oracle_episode(policies.tokenizer, suite, t) for t in tasks]
        for i, e in enumerate(rows):  # half the replayed episodes count as failures for the margin
            e.reward = 1.0 if i % 2 == 0 else 0.0
        contexts = {e.episode_id: experience_of(rows[(i + 2) % len(rows)]) for i, e in enumerate(rows)}
        per_episode = deltas(policies, rows, contexts)
        results[precision] = {"deltas": per_episode, "margin": balanced_margin(per_episode, [e.reward for e in rows]),
                              "step_s": step_seconds(policies, rows, repeats) if repeats else None}
    fp32, bf16 = results["off"], results["bfloat16"]
    diffs = torch.cat([(a - b).abs() for a, b in zip(fp32["deltas"], bf16["deltas"], strict=True)])
    return {"episodes": len(tasks), "action_tokens": int(diffs.numel()),
            "delta_max_abs_change": float(diffs.max()), "delta_mean_abs_change": float(diffs.mean()),
            "delta_p99_abs_change": float(diffs.quantile(0.99)), "margin_fp32": fp32["margin"],
            "margin_bf16": bf16["margin"], "margin_abs_change": abs(fp32["margin"] - bf16["margin"]),
            "delta_fp32_max_abs": max(float(d.abs().max()) for d in fp32["deltas"]),
            "step_s_fp32": fp32["step_s"], "step_s_bf16": bf16["step_s"],
            "speedup": fp32["step_s"] / bf16["step_s"] if repeats else None,
            "within_tolerance": float(diffs.max()) <= TOLERANCE and abs(fp32["margin"] - bf16["margin"]) <= TOLERANCE}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--sharpen", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from lopd_core.workspace import Workspace

    cfg = load_config("smoke" if args.model == "tiny" else "demo", {"model.base": args.model})
    models_dir = Workspace.from_config(cfg.workspace).ensure().models_dir
    result = compare_precisions(cfg, models_dir, episodes=args.episodes, sharpen=args.sharpen, repeats=args.repeats)
    report = {"benchmark": "precision_parity", "command": "python -m benchmarks.precision_parity " + " ".join(argv or []),
              "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": args.model, "tolerance": TOLERANCE,
              "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
                          "torch_threads": torch.get_num_threads()}, **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
