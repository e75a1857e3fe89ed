"""Is the self-teacher privileged? δ = log p_teacher(a) − log p_base(a) on the base model's own held-out episodes.

LOPD only helps when the latent-conditioned teacher puts *more* probability than the student on the actions
of successful episodes and less on those of failed ones (the outcome-signed Δ that the margin constraint asks
to be ≥ m). This measures that directly for a finished ``lopd compare`` root:

1. the base model plays the comparison's held-out tasks greedily (the same tasks as its evaluations);
2. each episode retrieves J experiences from the comparison's pinned bank (train split only, as in training);
3. every assistant token is scored by the base model without context and by each teacher: the frozen base
   with the latents of the cold-start composer φ0, with the final composer of each ``--runs`` run, and with
   the retrieved trajectories as text (the ``lopd_text`` ablation's teacher).

Reported per teacher: mean δ over the tokens of successful and of failed episodes, the outcome-signed Δ
(token-weighted, A = 2r − 1), δ at the first assistant token (where a tool-use episode decides between a
call and a direct answer), and how often the teacher's top-1 first token is the one the base model chose.

    python -m benchmarks.teacher_privilege --root $LOPD_HOME/compare/toolworld --runs lopd-s0 lopd-s1

Writes ``benchmarks/results/teacher_privilege_<suite>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def token_logprobs(algorithm, rows, experiences) -> list[torch.Tensor]:
    """Per episode, the teacher's log-probs of its assistant tokens (LOPD's teacher phase, without grad)."""
    from lopd_core.algorithms.logprobs import gather_tokens

    out = []
    with torch.no_grad():
        for c in algorithm._micro_batches(rows, rows, experiences):
            teacher_lp, _ = algorithm._teacher(c.t_batch, c.pairs, c.pair_rows)
            out += _per_row(gather_tokens(teacher_lp, c.targets), c.s_batch.mask, teacher_lp.argmax(-1))
    return out


def base_logprobs(policies, rows) -> list[torch.Tensor]:
    from lopd_core.algorithms.logprobs import gather_tokens, model_logprobs, plain_student_batch

    out = []
    with torch.no_grad():
        for start in range(0, len(rows), 4):
            batch = plain_student_batch(policies, rows[start:start + 4])
            lp = model_logprobs(policies, None, batch)
            targets = batch.target_ids[batch.mask.bool()]
            out += _per_row(gather_tokens(lp, targets), batch.mask, lp.argmax(-1))
    return out


def _per_row(values: torch.Tensor, mask: torch.Tensor, argmax: torch.Tensor) -> list[torch.Tensor]:
    """Split flat per-token values into rows; each row carries (token log-probs, top-1 ids) stacked."""
    counts = mask.sum(1).long().tolist()
    return [torch.stack([v.float(), a.float()]) for v, a in zip(values.split(counts), argmax.split(counts), strict=True)]


def summarize(teacher: list[torch.Tensor], base: list[torch.Tensor], rows) -> dict[str, float]:
    deltas = [t[0] - b[0] for t, b in zip(teacher, base, strict=True)]
    won = [d for d, r in zip(deltas, rows, strict=True) if r.success]
    lost = [d for d, r in zip(deltas, rows, strict=True) if not r.success]
    signed = sum(float((2 * r.reward - 1) * d.sum()) for d, r in zip(deltas, rows, strict=True))
    first = [float(d[0]) for d in deltas if len(d)]
    agree = [float(t[1][0] == b[1][0]) for t, b in zip(teacher, base, strict=True) if t.shape[1]]
    won_first = [float(d[0]) for d in won if len(d)]
    return {
        "delta_success_tokens": float(torch.cat(won).mean()) if won else float("nan"),
        "delta_failure_tokens": float(torch.cat(lost).mean()) if lost else float("nan"),
        "outcome_signed_delta": signed / max(sum(len(d) for d in deltas), 1),
        "delta_first_token": statistics.fmean(first) if first else float("nan"),
        "delta_first_token_successes": statistics.fmean(won_first) if won_first else float("nan"),
        "first_token_top1_agreement": statistics.fmean(agree) if agree else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    from lopd_core.algorithms.lopd import LOPD
    from lopd_core.compare import Comparison, final_dir
    from lopd_core.config import load_config
    from lopd_core.evaluation import evaluate
    from lopd_core.models.composer import load_composer
    from lopd_core.training import build_policies, retrieve_for
    from lopd_core.workspace import portable

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True, help="a finished `lopd compare` work directory")
    parser.add_argument("--profile", default="demo")
    parser.add_argument("--suite", default=None, help="default: the root's folder name")
    parser.add_argument("--eval-tasks", type=int, default=16, help="held-out tasks (as the comparison evaluated)")
    parser.add_argument("--runs", nargs="*", default=["lopd-s0"], help="runs whose final composer is scored")
    parser.add_argument("--latents", type=int, default=None, help="K of the cold start to load (default: the profile's)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    suite = args.suite or args.root.name
    cfg = load_config(args.profile, {"rollout.suite": suite, "evaluate.n_tasks": args.eval_tasks,
                                     "evaluate.probe_n_tasks": 0, "evaluate.probe_prompts": 0})
    if args.latents:
        cfg = cfg.with_overrides({"distill.lopd.n_latents": args.latents})
    comp = Comparison(cfg, suite=suite, budget=cfg.distill.tasks_per_step, root=args.root)
    policies = build_policies(cfg, models_dir=comp.ws.models_dir)
    started = time.perf_counter()

    rows = [t for t in evaluate(policies.teacher, policies.tokenizer, cfg=cfg, suite_name=suite, policy_version="base",
                                with_probe=False).trajectories if t.status == "ok" and any(t.assistant_mask)]
    lopd = cfg.distill.lopd
    experiences, memory = retrieve_for(comp.bank().retriever, rows, rows, step=0, k=lopd.n_retrieved,
                                       exclude_same_task=lopd.exclude_same_task, group_size=1)
    keep = [i for i, e in enumerate(experiences) if e]
    rows, experiences = [rows[i] for i in keep], [experiences[i] for i in keep]
    print(f"{len(rows)} held-out base episodes ({sum(r.success for r in rows)} successful), "
          f"{memory['memory/mean_retrieved']:.1f} experiences each")
    base = base_logprobs(policies, rows)

    composers = {"latent, cold-start φ0": comp.root / "cold_start" / f"k{lopd.n_latents}"}
    composers |= {f"latent, {run} final": final_dir(comp.root, run) / "composer" for run in args.runs}
    results = {}
    for name, directory in composers.items():
        if not directory.exists():
            print(f"skipping {name}: {directory} does not exist")
            continue
        composer = load_composer(policies, directory, lopd)
        results[name] = summarize(token_logprobs(LOPD(cfg.distill, policies, composer), rows, experiences), base, rows)
        print(name, json.dumps(results[name]))
    text_cfg = cfg.with_overrides({"distill.lopd.context": "text"})
    results["text context"] = summarize(token_logprobs(LOPD(text_cfg.distill, policies, None), rows, experiences),
                                        base, rows)
    print("text context", json.dumps(results["text context"]))

    out = args.out or RESULTS / f"teacher_privilege_{suite}.json"
    out.write_text(json.dumps({
        "benchmark": f"teacher_privilege_{suite}",
        "command": portable("python -m benchmarks.teacher_privilege " + " ".join(argv or []), comp.ws.home),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "episodes": len(rows),
        "successful_episodes": sum(r.success for r in rows), "supervised_tokens": sum(len(b[0]) for b in base),
        "seconds": round(time.perf_counter() - started, 1), "teachers": results}, indent=2))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
