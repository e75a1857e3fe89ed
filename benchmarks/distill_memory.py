"""Peak memory of one distillation step: LOPD, OPSD-style, TRL's GKDTrainer, and top-M + tail vs full vocabulary.

What it measures (writes ``benchmarks/results/distill_memory.json``): every configuration runs in its own
fresh child process (``--child MODE``), which builds the models and the batch, runs one warm-up step, resets
the kernel's peak-RSS counter (``/proc/self/clear_refs`` ← 5), runs one more step and reports
``VmHWM − VmRSS`` before that step: the extra resident memory the step needed on top of the models
(on CUDA: ``torch.cuda.max_memory_allocated`` minus the allocation before the step). Modes:

- ``lopd`` / ``lopd_reuse``: :class:`~lopd_core.algorithms.lopd.LOPD` (``reuse_teacher_forward`` off / on);
- ``opsd``: the OPSD-style step (full-vocabulary forward KL to the frozen teacher);
- ``trl_gkd``: TRL's GKDTrainer step on the same batch (full logits at every position for both models);
- ``loss_topm_tail`` vs ``loss_full_vocab``: the student distillation update alone — the teacher keeps only
  its top-M log-probs ``[N, M]`` and the loss is the top-M + tail reverse KL, versus keeping the full
  ``[N, V]`` teacher log-probs and the full-vocabulary reverse KL. ``ratio_full_over_topm`` compares them.

    python -m benchmarks.distill_memory            # demo sizes (B=8, ~1,000-token trajectories)
    python -m benchmarks.distill_memory --quick    # B=2, ~300 tokens
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile

import torch

from benchmarks.distill_common import (
    add_size_arguments,
    config_for,
    make_batch,
    models_dir,
    sizes,
    write_result,
)

MODES = ("lopd", "lopd_reuse", "opsd", "trl_gkd", "loss_topm_tail", "loss_full_vocab")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def build_loss_only(cfg, size, *, full_vocab: bool):
    """The student distillation update alone, with the teacher's top-M (+ tail) or its full distribution."""
    from lopd_core import losses
    from lopd_core.algorithms.batch import student_batch, to_padded
    from lopd_core.algorithms.logprobs import model_logprobs, student_logprobs
    from lopd_core.algorithms.optim import clip_and_step, make_adamw
    from lopd_core.models.policy import build_policy_set

    policies = build_policy_set(cfg.model, cfg.distill.lopd, models_dir())
    rows, _, _ = make_batch(policies.tokenizer, size, n_retrieved=1)
    batch = student_batch(rows, pad_id=policies.tokenizer.pad_token_id, device=policies.device)
    optimizer = make_adamw(policies.student_parameters(), lr=cfg.distill.lr_student, weight_decay=0.0)

    def step():
        with torch.no_grad():
            teacher = model_logprobs(policies, None, batch)
            if not full_vocab:
                topm_logprobs, topm_ids = teacher.topk(cfg.distill.top_m, dim=-1)
                del teacher
        student = student_logprobs(policies, batch)
        if full_vocab:
            per_token = losses.reverse_kl(student, teacher)
        else:
            per_token = losses.topm_tail_reverse_kl(student.gather(-1, topm_ids), topm_logprobs)
        loss = losses.global_token_mean(to_padded(per_token, batch.mask), batch.mask)
        loss.backward()
        clip_and_step(policies.student_parameters(), optimizer, max_norm=1.0)
        return float(loss.detach())

    return step


def child(mode: str, cfg, size) -> dict:
    from benchmarks.distill_throughput import build_lopd, build_opsd, build_trl_gkd

    workdir = tempfile.mkdtemp()
    if mode == "lopd":
        step, _ = build_lopd(cfg, size)
    elif mode == "lopd_reuse":
        step, _ = build_lopd(cfg.with_overrides({"distill.lopd.reuse_teacher_forward": True}), size)
    elif mode == "opsd":
        step = build_opsd(cfg, size)
    elif mode == "trl_gkd":
        step, facts = build_trl_gkd(cfg, size, workdir)
        if step is None:
            return {"mode": mode, **facts}
    else:
        step = build_loss_only(cfg, size, full_vocab=mode == "loss_full_vocab")
    step()  # warm-up: first-call allocations, optimizer state
    gc.collect()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    rss_before = _status_kb("VmRSS")
    reset = _reset_peak()
    step()
    out = {"mode": mode, "rss_before_mb": rss_before / 1024, "peak_rss_mb": _status_kb("VmHWM") / 1024,
           "peak_reset": reset}
    out["step_extra_mb"] = out["peak_rss_mb"] - out["rss_before_mb"] if reset else None
    if cuda:
        out["cuda_step_extra_mb"] = (torch.cuda.max_memory_allocated() - before) / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_size_arguments(parser, quick_help="B=2, ~300-token trajectories")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    args = parser.parse_args()
    size = sizes(args)
    cfg = config_for(args.model, size)
    if args.child:
        print(json.dumps(child(args.child, cfg, size)))
        return
    forwarded = ["--model", args.model, *(["--quick"] if args.quick else [])]
    for flag in ("batch", "prompt_tokens", "reply_tokens", "repeats"):
        if getattr(args, flag) is not None:
            forwarded += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    results = {}
    for mode in args.modes.split(","):
        proc = subprocess.run([sys.executable, "-m", "benchmarks.distill_memory", *forwarded, "--child", mode],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            results[mode] = {"mode": mode, "error": proc.stderr.strip().splitlines()[-1:]}
        else:
            results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(json.dumps(results[mode]), flush=True)

    def extra(mode):
        return (results.get(mode) or {}).get("step_extra_mb")

    summary = {"sizes": size, "model": args.model, "modes": results,
               "ratio_full_over_topm": (extra("loss_full_vocab") / extra("loss_topm_tail"))
               if extra("loss_full_vocab") and extra("loss_topm_tail") else None,
               "ratio_trl_gkd_over_opsd": (extra("trl_gkd") / extra("opsd")) if extra("trl_gkd") and extra("opsd") else None}
    print(f"→ {write_result('distill_memory', summary)}")


if __name__ == "__main__":
    main()
