"""Is bf16 safe for LOPD's signal? Per-token δ, the margin Δ and the student's gradient against fp32, and the speed.

The same toolworld oracle episodes are replayed through a text-context teacher (chat-turn experiences) and
the base model in fp32 and in two bf16 modes: ``model.autocast=bfloat16`` (decoder matmuls in bf16 in forward
and backward; the LM head, log-softmax, δ and Δ in fp32) and ``model.bf16_backward`` (every forward in fp32,
the input gradients through frozen weights in bf16; :mod:`lopd_core.models.precision`). Reported per mode:
the largest and the mean per-token change of δ = log p_T − log p_base, the change of the balanced margin, the
cosine and relative error of the student's LoRA gradient (negative log-likelihood of the actions, small random
LoRA B so that every matrix gets a gradient), and the median time of that student forward+backward (ratio to
fp32 in the same process).

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
from lopd_core.algorithms.logprobs import gather_tokens, model_logprobs, plain_student_batch, student_logprobs
from lopd_core.algorithms.synthetic import experience_of
from lopd_core.config import load_config
from lopd_core.envs import get_suite
from lopd_core.models.composer import experience_turns
from lopd_core.models.latent import experiences_prompt
from lopd_core.models.loading import resolve_model_path
from lopd_core.models.policy import STUDENT, build_policy_set
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


MODES = {"fp32": {}, "autocast": {"autocast": "bfloat16"}, "bf16_backward": {"bf16_backward": True}}
"""The precisions compared with fp32: bf16 autocast (forward and backward matmuls) and bf16 in backward only."""


def _perturb_student(policies) -> None:
    """A fresh LoRA student has B = 0, so A gets no gradient; small random Bs make every matrix's gradient count."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policies.base.named_parameters():
            if "lora_B" in name and name.endswith(f"{STUDENT}.weight"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.01)


def student_step(policies, episodes) -> tuple[float, torch.Tensor]:
    """Seconds of one student forward + backward over the episodes (two at a time) with the negative
    log-likelihood of their actions as the loss, and the LoRA gradient it leaves (flattened)."""
    started = time.perf_counter()
    for start in range(0, len(episodes), 2):
        batch = plain_student_batch(policies, episodes[start:start + 2])
        lp = gather_tokens(student_logprobs(policies, batch), batch.target_ids[batch.mask.bool()])
        (-lp.sum() / len(episodes)).backward()
    seconds = time.perf_counter() - started
    params = list(policies.student_parameters())
    grad = torch.cat([p.grad.flatten() for p in params])
    for p in params:
        p.grad = None
    return seconds, grad


def compare_precisions(cfg, models_dir, *, episodes: int = 6, sharpen: float = 1.0, repeats: int = 0) -> dict:
    """Each mode of :data:`MODES` against fp32 on the same replayed episodes: the change of every per-token δ
    and of the balanced margin, the cosine of the student's LoRA gradient, and (``repeats``) the median step time."""
    suite = get_suite("toolworld")
    tasks = [t for t in suite.tasks("train", 80, level=1, seed=4) if t.family.startswith("weather")][:episodes]
    resolve_model_path(cfg.model.base, models_dir)  # made here if missing, so every build below draws the same LoRA init
    results = {}
    for mode, update in MODES.items():
        torch.manual_seed(0)
        policies = build_policy_set(cfg.model.model_copy(update={"autocast": "off", "bf16_backward": False, **update}),
                                    cfg.distill.lopd, models_dir, device="cpu")
        _perturb_student(policies)
        if sharpen != 1.0:
            with torch.no_grad():
                policies.base.get_input_embeddings().weight.mul_(sharpen)
        rows = [oracle_episode(policies.tokenizer, suite, t) for t in tasks]
        for i, e in enumerate(rows):  # half the replayed episodes count as failures for the margin
            e.reward = 1.0 if i % 2 == 0 else 0.0
        contexts = {e.episode_id: experience_of(rows[(i + 2) % len(rows)]) for i, e in enumerate(rows)}
        per_episode = deltas(policies, rows, contexts)
        _, grad = student_step(policies, rows)
        times = [student_step(policies, rows)[0] for _ in range(repeats)]
        results[mode] = {"deltas": per_episode, "margin": balanced_margin(per_episode, [e.reward for e in rows]),
                         "grad": grad, "step_s": statistics.median(times) if times else None}
    fp32 = results["fp32"]
    out = {"episodes": len(tasks), "action_tokens": sum(len(d) for d in fp32["deltas"]), "margin_fp32": fp32["margin"],
           "delta_fp32_max_abs": max(float(d.abs().max()) for d in fp32["deltas"]), "step_s_fp32": fp32["step_s"],
           "precisions": {}}
    for mode in MODES:
        if mode == "fp32":
            continue
        other = results[mode]
        diffs = torch.cat([(a - b).abs() for a, b in zip(fp32["deltas"], other["deltas"], strict=True)])
        margin_change = abs(fp32["margin"] - other["margin"])
        out["precisions"][mode] = {
            "delta_max_abs_change": float(diffs.max()), "delta_mean_abs_change": float(diffs.mean()),
            "delta_p99_abs_change": float(diffs.quantile(0.99)), "margin": other["margin"],
            "margin_abs_change": margin_change,
            "grad_cosine": float(torch.nn.functional.cosine_similarity(fp32["grad"].double(), other["grad"].double(), dim=0)),
            "grad_relative_error": float((fp32["grad"] - other["grad"]).norm() / fp32["grad"].norm()),
            "step_s": other["step_s"], "speedup": fp32["step_s"] / other["step_s"] if repeats else None,
            "within_tolerance": float(diffs.max()) <= TOLERANCE and margin_change <= TOLERANCE}
    return out


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
