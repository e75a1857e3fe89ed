"""`lopd cycle|serve|deploy|backfill|evaluate|promote|rollback`: the continual-learning cycle and its registry.

These commands run the Prefect flows of ``flows/`` — ``lopd cycle`` is one ``lopd-cycle`` flow run — and
print a summary (``--json``: one JSON object on the last line of stdout). Without PREFECT_API_URL they start
Prefect's temporary API server as a child that dies with the command, even when it is killed
(``flows.common.prefect_environment``).
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from lopd_cli.common import JsonFlag, Overrides, Profile, emit_json, err, fail, load, log, out


def _prefect(profile: str, overrides: list[str] | None, *, temporary_server: bool = True):
    """Config + Prefect pointed at the workspace (must happen before a flow runs)."""
    cfg = load(profile, overrides)  # a bad config exits here with the field named
    from flows.common import prefect_environment

    return cfg, prefect_environment(profile, overrides, temporary_server=temporary_server)


def _ui_hints(ws) -> list[str]:
    import os

    from flows.common import real_server

    mlflow = (f"MLflow UI:  {ws.mlflow_tracking_uri}" if ws.mlflow_tracking_uri.startswith("http")
              else f"MLflow UI:  mlflow ui --backend-store-uri {ws.mlflow_tracking_uri}")
    prefect = (f"Prefect UI: {os.environ['PREFECT_API_URL'].removesuffix('/api')}" if real_server()
               else f"Prefect UI: PREFECT_HOME={ws.prefect_home} prefect server start   (then open http://127.0.0.1:4200)")
    return [mlflow, prefect]


def _print_cycle_summary(summary: dict) -> None:
    table = Table(title=f"lopd cycle {summary['cycle_id']} ({summary['state']})", show_header=False)
    fmt = lambda v: "—" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    rows = [("suite / method", f"{summary['suite']} / {summary['method']}"),
            ("seed-rollout success (champion)", fmt(summary["seed_rollout_success"])),
            ("held-out success before (champion)", fmt(summary["success_before"])),
            ("held-out success after (challenger)", fmt(summary["success_after"])),
            ("experiences stored (table version)", f"{fmt(summary['experiences'])} (v{fmt(summary['experiences_version'])})"),
            ("distillation steps", fmt(summary["distill_steps"])),
            ("registered pair", f"student v{fmt(summary['student_version'])} / composer v{fmt(summary['composer_version'])}"),
            ("decision", fmt(summary["decision"])),
            ("@champion", f"student v{fmt(summary['champion'])}"),
            ("stage seconds", ", ".join(f"{k} {v:.0f}" for k, v in summary["timings_s"].items())),
            ("report", summary["report"])]
    for k, v in rows:
        table.add_row(k, v)
    out.print(table)


def cycle(
    profile: Profile = "demo",
    set_: Overrides = None,
    cycle_id: Annotated[str, typer.Option(help="Cycle id (re-running an id resumes/returns it); default: UTC time.")] = "",
    as_json: JsonFlag = False,
):
    """Run one continual-learning cycle as a Prefect flow run."""
    import time

    cfg, ws = _prefect(profile, set_)
    from flows.cycle import cycle_flow, new_cycle_id
    from lopd_core.cycle import cycle_summary

    cycle_id = cycle_id or new_cycle_id()
    err.print(f"cycle {cycle_id}: profile {cfg.name}, workspace {ws.home}", highlight=False)
    started = time.perf_counter()
    try:
        cycle_flow(profile, list(set_ or []), cycle_id)
    except Exception as e:  # the flow run failed; the record says which stage
        summary = cycle_summary(cfg, cycle_id)
        fail(f"cycle {cycle_id} failed: {e} (state recorded in {ws.runs_dir / cycle_id / 'cycle.json'}; "
             f"re-run with --cycle-id {cycle_id} to resume)")
    summary = cycle_summary(cfg, cycle_id)
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    if as_json:
        for line in _ui_hints(ws):
            log(line)
        emit_json(summary)
        return
    _print_cycle_summary(summary)
    out.print(f"wall time {summary['wall_s']:.0f} s")
    for line in _ui_hints(ws):
        out.print(line, highlight=False)


def serve(profile: Profile = "demo", set_: Overrides = None):
    """Register and serve the Prefect deployments (lopd-cycle on its schedule, backfill, evaluate, promote, rollback)."""
    _prefect(profile, set_, temporary_server=False)
    from flows.common import real_server

    if not real_server():
        fail("`lopd serve` needs a Prefect server: run `prefect server start` and set "
             "PREFECT_API_URL=http://127.0.0.1:4200/api (schedules do not run in ephemeral mode)")
    from flows.serve import serve as serve_deployments

    serve_deployments(profile, list(set_ or []))


def deploy(
    pool: Annotated[str, typer.Option(help="Prefect work pool (created as a process pool when missing).")] = "lopd-process",
    profile: Profile = "demo",
    set_: Overrides = None,
):
    """Register the deployments on a work pool (lopd-cycle on the profile's schedule); run them with a worker."""
    cfg, ws = _prefect(profile, set_, temporary_server=False)
    from flows.common import real_server

    if not real_server():
        fail("`lopd deploy` needs a Prefect server: run `prefect server start` and set "
             "PREFECT_API_URL=http://127.0.0.1:4200/api")
    from flows.serve import deploy as deploy_deployments

    env = {"LOPD_HOME": str(ws.home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    ids = deploy_deployments(profile, list(set_ or []), pool=pool, env=env)
    out.print(f"{len(ids)} deployments on work pool {pool!r}; start a worker: prefect worker start --pool {pool}")


def backfill(
    profile: Profile = "demo",
    set_: Overrides = None,
    cycle: Annotated[list[str] | None, typer.Option("--cycle", help="Cycle id of the window (repeatable).")] = None,
    since: Annotated[str, typer.Option(help="First cycle id of the window (ids sort by time).")] = "",
    until: Annotated[str, typer.Option(help="Last cycle id of the window.")] = "",
    rebuild_index: Annotated[bool, typer.Option(help="Re-embed everything (e.g. after changing index.embedder).")] = False,
    reevaluate: Annotated[list[str] | None, typer.Option(help="Student version to re-evaluate (repeatable).")] = None,
    as_json: JsonFlag = False,
):
    """Re-curate and re-index (optionally re-evaluate) a window of past cycles, as a `lopd-backfill` flow run."""
    _prefect(profile, set_)
    from flows.backfill import backfill_flow

    result = backfill_flow(profile, list(set_ or []), list(cycle or []), since, until, rebuild_index, list(reevaluate or []))
    if as_json:
        emit_json(result)
    else:
        out.print(result)


def evaluate(
    profile: Profile = "demo",
    set_: Overrides = None,
    version: Annotated[str, typer.Option(help="'champion', 'challenger' or a student version number.")] = "champion",
    as_json: JsonFlag = False,
):
    """Evaluate a registered model pair on held-out tasks (a `lopd-evaluate` flow run)."""
    _prefect(profile, set_)
    from flows.evaluate import evaluate_flow

    try:
        result = evaluate_flow(profile, list(set_ or []), version)
    except ValueError as e:
        fail(str(e))
    if as_json:
        emit_json(result)
        return
    table = Table("metric", "value", title=f"student v{result['student_version']}")
    for k, v in sorted(result["metrics"].items()):
        table.add_row(k, f"{v:.4g}")
    out.print(table)


def promote(
    profile: Profile = "demo",
    set_: Overrides = None,
    force: Annotated[bool, typer.Option("--force", help="Promote @challenger even if it was rolled back (still "
                                        "through the gate); recorded on the pair.")] = False,
    as_json: JsonFlag = False,
):
    """Run the promotion gate on @challenger vs @champion (a `lopd-promote` flow run)."""
    _prefect(profile, set_)
    from flows.promote import promote_flow

    try:
        result = promote_flow(profile, list(set_ or []), force)
    except (ValueError, RuntimeError, TimeoutError) as e:
        fail(str(e))
    emit_json(result) if as_json else out.print(result["decision"], highlight=False)


def rollback(profile: Profile = "demo", set_: Overrides = None, as_json: JsonFlag = False):
    """Re-point @champion to the previous pair (a `lopd-rollback` flow run)."""
    _prefect(profile, set_)
    from flows.promote import rollback_flow

    try:
        result = rollback_flow(profile, list(set_ or []))
    except (RuntimeError, TimeoutError) as e:
        fail(str(e))
    if as_json:
        emit_json(result)
    else:
        out.print(f"@champion: student v{result['champion']['student']} / composer v{result['champion']['composer']} "
                  f"(was student v{result['rolled_back']['student']})")
