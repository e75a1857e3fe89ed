"""The smallest LOPD-vs-baselines comparison: torch + transformers + peft only (no Prefect, MLflow, LanceDB).

Meant for a GPU machine (about 5 minutes on one GPU with the defaults); it also runs on CPU with
``--device cpu --model tiny`` as a smoke test of the script itself. Protocol, as in ``lopd compare``:

1. the base model plays ``--seed-episodes`` training episodes; its successes form an in-memory experience
   bank (bag-of-words retrieval instead of LanceDB + MiniLM);
2. the composer is cold-started once on that bank;
3. every method (``--methods``) starts from the base model and trains for ``--steps`` steps of
   ``distill.tasks_per_step`` episodes (the same rollout budget), then is scored greedily on the same
   ``--eval-tasks`` held-out tasks as the base model.

    python -m benchmarks.gpu_compare --model /models/Qwen2.5-0.5B-Instruct --suite codegen
    python -m benchmarks.gpu_compare --device cpu --model tiny --steps 1 --eval-tasks 2 --seed-episodes 4

Results go to ``benchmarks/results/gpu_compare.json`` (``python -m benchmarks.run_all --render-only`` puts
them in BENCHMARKS.md). The model must be a local folder (or already in the HF cache): nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "gpu_compare.json"


def build_cfg(args):
    from lopd_core.config import load_config

    gpu = args.device.startswith("cuda")
    code = args.suite == "codegen"
    overrides = {
        "model.base": args.model, "model.device": args.device, "model.dtype": "bfloat16" if gpu else "float32",
        "model.student": "lora", "model.lora_rank": 16, "model.lora_alpha": 32,
        "rollout.suite": args.suite, "rollout.engine": "hf", "rollout.level": 1, "rollout.batch_size": 16,
        "rollout.max_turns": 1 if code else 4, "rollout.max_new_tokens": 256 if code else 128,
        "rollout.max_trajectory_tokens": 1024 if code else 1536,
        "distill.steps": args.steps, "distill.tasks_per_step": args.tasks_per_step, "distill.group_size": 4,
        "distill.micro_batch": 8 if gpu else 2, "distill.checkpoint_every": 1000, "distill.keep_checkpoints": 1,
        "distill.lopd.n_retrieved": 2, "distill.lopd.n_latents": 16, "distill.lopd.experience_max_tokens": 256,
        "distill.lopd.cold_start.steps": args.cold_start_steps, "distill.lopd.cold_start.batch_size": 4,
        "evaluate.n_tasks": args.eval_tasks, "evaluate.probe_n_tasks": 0, "evaluate.probe_prompts": 0,
    }
    return load_config("smoke" if args.model == "tiny" else "demo", overrides)


def main(argv: list[str] | None = None) -> int:
    from lopd_core.envs import get_suite
    from lopd_core.evaluation import evaluate, run_suite
    from lopd_core.memory.base import InMemoryRetriever
    from lopd_core.metrics import InMemoryLogger
    from lopd_core.training import build_policies, cold_start, experiences_from_trajectories, train

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="local model folder, or a prepared name")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--suite", default="codegen", choices=["codegen", "toolworld"])
    parser.add_argument("--methods", default="lopd,grpo,opsd,sdpo,skill_sd,none")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tasks-per-step", type=int, default=16)
    parser.add_argument("--seed-episodes", type=int, default=64)
    parser.add_argument("--cold-start-steps", type=int, default=20)
    parser.add_argument("--eval-tasks", type=int, default=64)
    parser.add_argument("--models-dir", type=Path, default=None, help="where prepared models live")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    cfg = build_cfg(args)
    suite = get_suite(args.suite)
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="lopd-gpu-compare-"))
    policies = build_policies(cfg, models_dir=args.models_dir)

    with policies.teacher() as base_model:  # the untrained base plays the seed episodes
        seed = run_suite(base_model, policies.tokenizer, args.suite, cfg=cfg, split="train", n_tasks=args.seed_episodes,
                         seed=0, policy_version="base", temperature=cfg.rollout.temperature, progress=True)
    bank = InMemoryRetriever(experiences_from_trajectories(seed, cfg, kind=suite.kind))
    print(f"bank: {len(bank.experiences)} experiences from {len(seed)} base episodes")
    composer = None
    threshold = cfg.curation.success_threshold(suite.kind)
    if bank.experiences:
        composer = cold_start(cfg, retriever=bank, out_dir=work / "cold_start", trajectories=seed,
                              policies=policies, models_dir=args.models_dir,
                              success_threshold=threshold).composer_dir
    base = evaluate(policies.teacher, policies.tokenizer, cfg=cfg, suite_name=args.suite, policy_version="base",
                    with_probe=False).metrics
    rows = []
    for method in [m for m in args.methods.split(",") if m]:
        if method in ("lopd", "opsd") and not bank.experiences:
            rows.append({"method": method, "skipped": "no successful base episode to build a bank from"})
            continue
        mcfg = cfg.with_overrides({"distill.method": method})
        t0 = time.perf_counter()
        fresh = build_policies(mcfg, models_dir=args.models_dir)
        result = train(mcfg, suite=suite, retriever=bank if method in ("lopd", "opsd") else None,
                       run_dir=work / method, composer_init=composer if method == "lopd" else None,
                       logger=InMemoryLogger(), policies=fresh, progress=True, models_dir=args.models_dir)
        ev = evaluate(fresh.student, fresh.tokenizer, cfg=mcfg, suite_name=args.suite, policy_version=method,
                      with_probe=False).metrics
        rows.append({"method": method, "final_success": ev["eval/success_rate"], "final_reward": ev["eval/mean_reward"],
                     "train_episodes": result.metrics.get("budget/episodes"), "wall_s": round(time.perf_counter() - t0, 1)})
        print(rows[-1])
        del fresh
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    report = {"benchmark": "gpu_compare", "command": "python -m benchmarks.gpu_compare " + " ".join(argv or []),
              "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "machine": {"platform": platform.platform(), "device": args.device,
                          "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                          "torch": torch.__version__},
              "model": args.model, "suite": args.suite, "steps": args.steps, "tasks_per_step": args.tasks_per_step,
              "bank_experiences": len(bank.experiences), "seed_episodes": len(seed),
              "base_success": base["eval/success_rate"], "results": rows,
              "wall_s": round(time.perf_counter() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
