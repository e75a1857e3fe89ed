"""Distillation throughput on SmolLM2-135M: the LOPD step by phase, an OPSD-style step, and TRL's GKDTrainer.

What it measures (writes ``benchmarks/results/distill_throughput.json``), all in one process on one batch
(:func:`benchmarks.distill_common.make_batch`, demo sizes by default), median of ``--repeats`` after a
warm-up:

1. **LOPD step** (:class:`lopd_core.algorithms.lopd.LOPD`): wall time of the teacher, student and composer
   phases and supervised tokens/s; the anchor cache is emptied before every repeat, as in training where
   each step brings new (task, experience) pairs. Also with separate teacher and composer forwards
   (``distill.lopd.reuse_teacher_forward: false``, the default before 2026-12-06).
2. **Cold-start step** (:class:`lopd_core.algorithms.cold_start.ColdStart`, ``cold_start.batch_size``
   trajectories) and the configured number of steps × its median: the cold start's share of a demo cycle.
3. **OPSD-style step** (:class:`lopd_core.algorithms.opsd.OPSD`, forward KL, frozen teacher with a short
   reference in the system message) against **TRL's GKDTrainer** doing the same student update — LoRA of
   the same rank on the same base model, forward KL (GKD ``beta = 0``, ``lmbda = 0``: no generation), the
   same batch and token mask in micro-batches of ``distill.micro_batch`` with gradient accumulation (as ours;
   B = 8 at once took > 20 GB in TRL here), AdamW step and gradient clip — timed as ``training_step`` + optimizer step.
   ``ratio = TRL time / our time`` (goal ≥ 1.2).
4. **Achieved FLOP/s** of the LOPD step, ``12·N·supervised tokens / step time`` (the issue's accounting), and
   a work-based count (2N per token per forward, 4N per token per backward to the inputs, over every token
   each phase actually processes), both against the measured fp32 matmul peak of this machine (goal ≥ 40%).

    python -m benchmarks.distill_throughput             # B=8, ~1,000-token trajectories, 3 repeats
    python -m benchmarks.distill_throughput --quick     # B=2, ~300 tokens, 2 repeats (a few minutes)
    python -m benchmarks.distill_throughput --episodes E.jsonl --parts opsd,trl --name opsd_vs_trl
                                                        # real toolworld episodes, OPSD-style vs TRL only

TRL comes from ``requirements/bench.txt`` (``make bench`` installs it); without it the TRL rows are skipped
and the result says so. Peak memory is in :mod:`benchmarks.distill_memory`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from benchmarks.distill_common import (
    add_size_arguments,
    config_for,
    make_batch,
    models_dir,
    sizes,
    timed,
    write_result,
)


def matmul_peak_flops(*, n: int = 1024, repeats: int = 7) -> float:
    """Median fp32 FLOP/s of an n×n by n×n matmul on this machine (the 'peak' the step is compared with)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        times.append((time.perf_counter() - start) / 4)
    return 2 * n**3 / statistics.median(times)


def lopd_setup(cfg):
    from lopd_core.models.composer import freeze_phi0, new_composer_state
    from lopd_core.models.policy import build_policy_set

    policies = build_policy_set(cfg.model, cfg.distill.lopd, models_dir())
    composer = new_composer_state(policies, cfg.distill.lopd)
    freeze_phi0(policies, composer)
    return policies, composer


def build_lopd(cfg, size):
    """(step function, static facts) of one LOPD step on the benchmark batch."""
    from lopd_core.algorithms.base import StepInputs
    from lopd_core.algorithms.lopd import LOPD
    from lopd_core.models.composer import encoder_ids

    policies, composer = lopd_setup(cfg)
    rows, tasks, retrieved = make_batch(policies.tokenizer, size, n_retrieved=cfg.distill.lopd.n_retrieved)
    algo = LOPD(cfg.distill, policies, composer)

    def step():
        composer.anchor_cache.clear()
        return algo.step(StepInputs(step=0, trajectories=rows, tasks=tasks, retrieved=retrieved))

    base = policies.base.get_base_model()
    encoder_tokens = sum(len(encoder_ids(policies.tokenizer, t.instruction, e, max_tokens=cfg.distill.lopd.experience_max_tokens))
                         for t, exps in zip(tasks, retrieved, strict=True) for e in exps)
    from lopd_core.models.latent import latent_prompt

    k, tok = cfg.distill.lopd.n_latents, policies.tokenizer
    span_starts = [latent_prompt(tok, r.messages[: r.initial_messages], r.tools, n_latents=len(e) * k,
                                 placeholder_id=tok.pad_token_id).span_start for r, e in zip(rows, retrieved, strict=True)]
    facts = {"parameters": sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n),
             "teacher_prefix_tokens": float(min(span_starts) * len(rows)) if cfg.distill.lopd.teacher_prefix_cache else 0.0,
             "embedding_parameters": base.get_input_embeddings().weight.numel(),
             "encoder_tokens": float(encoder_tokens), "student_tokens": float(sum(r.n_tokens for r in rows))}
    return step, facts


def run_lopd(cfg, size) -> dict:
    step, facts = build_lopd(cfg, size)
    result = timed(step, repeats=size["repeats"])
    metrics = result.pop("outputs")
    out = {**result, **facts, "supervised_tokens": metrics[0]["distill/supervised_tokens"],
           "teacher_tokens": metrics[0]["distill/teacher_tokens"],
           "phase_median_s": {p: statistics.median(m[f"distill/time_{p}_s"] for m in metrics)
                              for p in ("teacher", "student", "composer")}}
    out["supervised_tokens_per_s"] = out["supervised_tokens"] / out["median_s"]
    del step
    gc.collect()
    return out


def run_cold_start(cfg, size) -> dict:
    """One cold-start step of ``cold_start.batch_size`` trajectories (each with its J experiences)."""
    from lopd_core.algorithms.cold_start import ColdStart, ColdStartExample

    policies, composer = lopd_setup(cfg)
    rows, _, retrieved = make_batch(policies.tokenizer, size, n_retrieved=cfg.distill.lopd.n_retrieved)
    n = min(cfg.distill.lopd.cold_start.batch_size, len(rows))
    examples = [ColdStartExample(r, e) for r, e in zip(rows[:n], retrieved[:n], strict=True)]
    trainer = ColdStart(cfg.distill, policies, composer)
    result = timed(lambda: trainer.step(examples), repeats=size["repeats"])
    metrics = result.pop("outputs")
    out = {**result, "batch": n, "supervised_tokens": metrics[0]["cold_start/supervised_tokens"],
           "configured_steps": cfg.distill.lopd.cold_start.steps}
    out["estimated_cold_start_s"] = out["median_s"] * out["configured_steps"]
    gc.collect()
    return out


def build_opsd(cfg, size):
    from lopd_core.algorithms.base import StepInputs
    from lopd_core.algorithms.opsd import OPSD
    from lopd_core.models.policy import build_policy_set

    cfg = cfg.with_overrides({"distill.method": "opsd", "distill.opsd.divergence": "forward_kl"})
    policies = build_policy_set(cfg.model, cfg.distill.lopd, models_dir())
    rows, tasks, _ = make_batch(policies.tokenizer, size, n_retrieved=1)
    algo = OPSD(cfg.distill, policies)
    return lambda: algo.step(StepInputs(step=0, trajectories=rows, tasks=tasks, retrieved=[[]] * len(rows)))


def run_opsd(cfg, size) -> dict:
    result = timed(build_opsd(cfg, size), repeats=size["repeats"])
    metrics = result.pop("outputs")
    out = {**result, "supervised_tokens": metrics[0]["distill/supervised_tokens"]}
    out["supervised_tokens_per_s"] = out["supervised_tokens"] / out["median_s"]
    gc.collect()
    return out


def build_trl_gkd(cfg, size, workdir: str):
    """(step function, facts) of TRL's GKDTrainer on the same batch, or (None, reason) without TRL."""
    try:
        import trl
        from datasets import Dataset
        from peft import LoraConfig
        from trl.experimental.gkd import GKDConfig, GKDTrainer
    except ImportError as e:
        return None, {"skipped": f"TRL is not installed ({e}); install requirements/bench.txt"}

    from lopd_core.algorithms.batch import student_batch
    from lopd_core.models.loading import load_causal_lm, load_tokenizer, resolve_model_path

    path = resolve_model_path(cfg.model.base, models_dir())
    tok = load_tokenizer(path)
    rows, _, _ = make_batch(tok, size, n_retrieved=1)
    student, teacher = load_causal_lm(path, device=cfg.model.device), load_causal_lm(path, device=cfg.model.device)
    m = cfg.model
    lora = LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=0.0, target_modules=list(m.lora_targets),
                      task_type="CAUSAL_LM")
    args = GKDConfig(output_dir=workdir, per_device_train_batch_size=len(rows), learning_rate=cfg.distill.lr_student,
                     max_grad_norm=cfg.distill.grad_clip, lmbda=0.0, beta=0.0, temperature=1.0, seq_kd=False,
                     report_to=[], use_cpu=not torch.cuda.is_available(), bf16=False, max_length=None,
                     logging_steps=10**9, save_strategy="no", disable_dropout=True)
    dataset = Dataset.from_list([{"messages": r.messages} for r in rows])
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=dataset,
                         processing_class=tok, peft_config=lora)
    trainer.create_optimizer()
    device = next(trainer.model.parameters()).device
    # the same ids and supervised tokens as ours: labels = ids at assistant positions, −100 elsewhere; the batch
    # in micro-batches of distill.micro_batch with gradient accumulation, as ours (B = 8 whole needs > 20 GB here)
    size = cfg.distill.micro_batch or len(rows)
    chunks = []
    for start in range(0, len(rows), size):
        part = rows[start:start + size]
        batch = student_batch(part, pad_id=tok.pad_token_id, device=device)
        labels = torch.full_like(batch.input_ids, -100)
        for b, r in enumerate(part):
            mask = torch.tensor(r.assistant_mask, dtype=torch.bool, device=device)
            labels[b, : len(r.token_ids)][mask] = batch.input_ids[b, : len(r.token_ids)][mask]
        chunks.append(({"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "labels": labels},
                       batch.n_tokens))
    trainer.current_gradient_accumulation_steps = len(chunks)  # normally set by Trainer.train's loop
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    def step():
        loss = sum(float(trainer.training_step(trainer.model, dict(inputs))) for inputs, _ in chunks)
        torch.nn.utils.clip_grad_norm_(params, cfg.distill.grad_clip)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        return loss

    return step, {"trl_version": trl.__version__, "supervised_tokens": float(sum(n for _, n in chunks)),
                  "micro_batch": size}


def run_trl_gkd(cfg, size) -> dict:
    """TRL's GKDTrainer: training_step (student + teacher forward, JSD β = 0, backward) + clip + AdamW step."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        step, facts = build_trl_gkd(cfg, size, tmp)
        if step is None:
            return facts
        result = timed(step, repeats=size["repeats"])
    losses = result.pop("outputs")
    out = {**result, **facts, "loss": losses[-1]}
    out["supervised_tokens_per_s"] = out["supervised_tokens"] / out["median_s"]
    del step
    gc.collect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_size_arguments(parser, quick_help="B=2, ~300-token trajectories, 2 repeats")
    parser.add_argument("--parts", default="lopd,cold_start,opsd,trl",
                        help="which steps to time (comma-separated of lopd, cold_start, opsd, trl)")
    parser.add_argument("--name", default="distill_throughput", help="result file benchmarks/results/NAME.json")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if parts - {"lopd", "cold_start", "opsd", "trl"}:
        raise SystemExit(f"--parts: unknown {sorted(parts - {'lopd', 'cold_start', 'opsd', 'trl'})}")
    size = sizes(args)
    cfg = config_for(args.model, size)
    peak = matmul_peak_flops()
    print(f"matmul peak {peak / 1e9:.1f} GFLOP/s", flush=True)
    summary: dict = {"sizes": size, "model": args.model, "matmul_peak_flops": peak}
    if "lopd" in parts:
        lopd = run_lopd(cfg, size)
        print(f"lopd step {lopd['median_s']:.2f} s  phases {lopd['phase_median_s']}", flush=True)
        lopd_separate = run_lopd(cfg.with_overrides({"distill.lopd.reuse_teacher_forward": False}), size)
        print(f"lopd step (separate teacher and composer forwards) {lopd_separate['median_s']:.2f} s", flush=True)
        summary |= {"lopd_step": lopd, "lopd_step_separate_teacher_forward": lopd_separate,
                    "ratio_separate_over_reuse": lopd_separate["median_s"] / lopd["median_s"], **_flops(lopd, peak)}
    if "cold_start" in parts:
        cold = run_cold_start(cfg, size)
        print(f"cold-start step {cold['median_s']:.2f} s (x{cold['configured_steps']} ≈ "
              f"{cold['estimated_cold_start_s'] / 60:.1f} min)", flush=True)
        summary["cold_start_step"] = cold
    if "opsd" in parts:
        summary["opsd_step"] = run_opsd(cfg, size)
        print(f"opsd-style step {summary['opsd_step']['median_s']:.2f} s", flush=True)
    if "trl" in parts:
        summary["trl_gkd_step"] = gkd = run_trl_gkd(cfg, size)
        print(f"trl gkd step {gkd.get('median_s', float('nan')):.2f} s", flush=True)
        if "opsd_step" in summary and "median_s" in gkd:
            summary["ratio_trl_gkd_over_opsd"] = gkd["median_s"] / summary["opsd_step"]["median_s"]
    path = write_result(args.name, summary, module="distill_throughput")
    print(f"ratio TRL GKD / OPSD-style: {summary.get('ratio_trl_gkd_over_opsd')}  → {path}")


def _flops(lopd: dict, peak: float) -> dict:
    """Achieved FLOP/s of the LOPD step: the issue's 12·N per supervised token, and a work-based count."""
    n = lopd["parameters"]
    issue_flops = 12 * n * lopd["supervised_tokens"]
    # Work-based matmul count with N_lin = N − V·d (the embedding lookup is no matmul; the tied LM head runs only at
    # supervised positions): teacher phase = encoder fwd + teacher fwd (2N_lin each) + φ0 anchor encoder fwd (2N_lin);
    # student phase = fwd + backward to the inputs (LoRA: no full weight gradients) = 4N_lin; composer phase =
    # encoder fwd + bwd (4N_lin) and teacher fwd + bwd from the latent span on (4N_lin; the prefix before the span
    # is cached). LM head: 5 passes of 2·V·d per supervised token. Attention scores are left out (an undercount).
    n_lin, head = n - lopd["embedding_parameters"], lopd["embedding_parameters"]
    composer_teacher = lopd["teacher_tokens"] - lopd["teacher_prefix_tokens"]
    work_flops = (n_lin * (8 * lopd["encoder_tokens"] + 2 * lopd["teacher_tokens"] + 4 * composer_teacher
                           + 4 * lopd["student_tokens"]) + 10 * head * lopd["supervised_tokens"])
    return {"lopd_flops_12N_per_supervised_token": issue_flops / lopd["median_s"],
            "lopd_fraction_of_peak_12N": issue_flops / lopd["median_s"] / peak,
            "lopd_flops_work_based": work_flops / lopd["median_s"],
            "lopd_fraction_of_peak_work_based": work_flops / lopd["median_s"] / peak}


if __name__ == "__main__":
    main()
