"""`lopd compare`: LOPD against the baselines under one rollout budget, with a report."""

from __future__ import annotations

import shlex
import sys
from datetime import date
from pathlib import Path
from typing import Annotated

import typer

from lopd_cli.common import (
    JsonFlag,
    Overrides,
    Profile,
    emit_json,
    engine_line,
    fail,
    load,
    log,
    out,
    workspace,
)


def compare(
    suite: Annotated[str, typer.Option(help="Task suite.")] = "toolworld",
    methods: Annotated[str, typer.Option(help="Comma-separated: lopd,grpo,opsd,sdpo,skill_sd,rft,rft_hinted,sft_oracle,none.")] = "lopd,grpo,opsd,sdpo,skill_sd,none",
    budget: Annotated[int, typer.Option(help="Training episodes per run (steps = budget / distill.tasks_per_step).")] = 160,
    seeds: Annotated[int, typer.Option(help="Seeds per method (override per method with --seeds-for).")] = 1,
    seeds_for: Annotated[str, typer.Option("--seeds-for", help="Seeds per method, ablation or grid point, e.g. 'lopd=3,grpo=3,lopd_text=3,lopd@lr3e-4=3' (ablations and grid points default to 1).")] = "",
    ablations: Annotated[str, typer.Option(help="Comma-separated: lopd_frozen, lopd_m0, lopd_text, lopd_k8, lopd_k32, lopd_j1, lopd_j3, lopd_signed, lopd_user_framing, lopd_system, lopd_chat_turn, lopd_any_family, lopd_oracle_fallback.")] = "",
    lr_grid: Annotated[str, typer.Option("--lr-grid", help="Comma-separated learning rates, e.g. '3e-5,3e-4': one more run per method and rate (named <method>@lr<rate>, seed 0; more seeds with --seeds-for), to be scored on validation.")] = "",
    eval_every: Annotated[int, typer.Option(help="Evaluate every this many steps (default: evaluate.every_steps).")] = 0,
    eval_tasks: Annotated[int, typer.Option(help="Held-out tasks per evaluation (default: evaluate.n_tasks).")] = 0,
    seed_episodes: Annotated[int, typer.Option(help="Base-model episodes that seed the experience bank (default: rollout.n_tasks).")] = 0,
    bank_episodes: Annotated[list[Path] | None, typer.Option(help="Seed the bank from these episodes (JSONL of `lopd probe-passk --out`) instead; repeatable.")] = None,
    root: Annotated[Path | None, typer.Option(help="Work directory (default: <workspace>/compare/<suite>); reuse it to resume.")] = None,
    report_dir: Annotated[Path | None, typer.Option(help="Where the report goes (default: reports/<suite>-<date>).")] = None,
    report_only: Annotated[bool, typer.Option("--report-only", help="Write the report from the runs finished so far; run nothing.")] = False,
    profile: Profile = "demo",
    set_: Overrides = None,
    as_json: JsonFlag = False,
):
    """Compare LOPD against the baselines under one rollout budget (resumable); writes a Markdown + PNG report."""
    from lopd_core.compare import parse_seeds_for, run_comparison, split_names
    from lopd_core.compare_report import machine_description, summarize, write_report

    cfg = load(profile, set_)
    try:
        seeds_by_method = parse_seeds_for(seeds_for)
    except ValueError as e:
        fail(f"--{e}", code=2)
    try:
        grid = [float(v) for v in split_names(lr_grid)]
    except ValueError:
        fail(f"--lr-grid: {lr_grid!r} is not a comma-separated list of numbers such as 3e-5,3e-4", code=2)
    ws = workspace(cfg)
    if not report_only:
        log(engine_line(cfg))
        from lopd_core.operations import reap

        # runs a killed comparison left RUNNING are marked KILLED before it resumes them
        for r in reap(cfg)["mlflow_runs"]:
            log(f"reaper: MLflow run {r['run_name'] or r['run_id']} marked KILLED: {r['reason']}")
    root = root or ws.home / "compare" / suite
    report_dir = report_dir or Path("reports") / f"{suite}-{date.today().isoformat()}"
    try:
        result = run_comparison(cfg, suite=suite, methods=split_names(methods), budget=budget, seeds=seeds, root=root,
                                ablations=split_names(ablations), seeds_by_method=seeds_by_method, lr_grid=grid,
                                eval_every=eval_every or None, eval_tasks=eval_tasks or None,
                                seed_episodes=seed_episodes or None, bank_episodes=list(bank_episodes or []), log=log,
                                report_only=report_only)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        fail(str(e))
    command = "lopd compare " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    summary = summarize(result, write_report(result, report_dir, machine=machine_description(), command=command,
                                                 home=ws.home))
    if as_json:
        emit_json(summary)
    else:
        out.print(f"report: {summary['report']}")
        for name, values in summary["final_success"].items():
            out.print(f"  {name:14s} final held-out success {', '.join(f'{v:.3f}' for v in values)}")
