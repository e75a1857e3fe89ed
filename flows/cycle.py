"""`lopd-cycle`: one continual-learning cycle — rollouts → curate → index → distill → evaluate → promote.

Why: each cycle turns the agent's newest experience into a better (or, by the gate, unchanged) champion.
How: every stage is a task over :mod:`lopd_core.cycle` (idempotent on ``cycle_id``, so a re-run resumes
after the last completed stage and distillation resumes from its checkpoint); the distill stage holds the
global concurrency limit ``cycle.concurrency_limit_name`` so two cycles never train at once. Before the
first stage the flow labels its run with its process and reaps what killed processes left running
(``flows.common.reap_crashed``: their MLflow runs, cycle records, flow runs and training slot). The flow
publishes the cycle report (markdown), a table of sample trajectories and the learning curve as artifacts.

The cycle id: the ``cycle_id`` parameter, or else one taken from the flow run itself
(:func:`flow_run_cycle_id`: its scheduled start, plus its id for a run nobody scheduled), so a retry of the
same flow run — Prefect's own ``retries`` or "Retry" in the UI — resumes the same cycle and its distill
checkpoint. The run is named ``cycle-<cycle id>``. A run that ends Failed or Crashed marks its cycle record and
its MLflow run FAILED (``on_failure``/``on_crashed``; a SIGKILL runs no hook: the reaper finds those).

Run it:  ``lopd cycle --profile demo``  (ephemeral Prefect, no server), or ``python -m flows.cycle``;
serve it on a schedule: ``lopd serve --profile demo``.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from prefect import flow

from flows.common import artifact_key, claim_flow_run, config, reap_crashed, training_slot
from flows.stages import stage

log = logging.getLogger(__name__)


def new_cycle_id() -> str:
    """The id `lopd cycle` gives a cycle started without ``--cycle-id`` (it prints it, for the re-run)."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S")


def flow_run_cycle_id(flow_run) -> str:
    """The cycle id of a Prefect flow run: a run its deployment's schedule created is named after its scheduled
    start (``20261205T1300Z``); any other run after its creation time and the start of its id
    (``20261205T1312Z-3f2a9c1b``). Both are fixed for the life of the flow run, so every retry of it finds the
    same cycle."""
    from lopd_core.cycle import cycle_id_at

    if flow_run.auto_scheduled and flow_run.expected_start_time is not None:
        return cycle_id_at(flow_run.expected_start_time)
    if flow_run.created is None:
        raise ValueError(f"flow run {flow_run.id} has no creation time to name its cycle after")
    return cycle_id_at(flow_run.created, run_id=str(flow_run.id))


def _current_cycle_id(cycle_id: str = "") -> str:
    from prefect.context import FlowRunContext

    from lopd_core.config import check_cycle_id

    if cycle_id:
        return check_cycle_id(cycle_id)
    return flow_run_cycle_id(FlowRunContext.get().flow_run)


def _run_name() -> str:
    from prefect.runtime import flow_run

    return f"cycle-{_current_cycle_id(flow_run.parameters.get('cycle_id') or '')}"


def mark_failed(flow, flow_run, state) -> None:
    """``on_failure``/``on_crashed``: the cycle's record and MLflow run FAILED (unless it completed)."""
    from lopd_core.config import load_config
    from lopd_core.cycle import mark_cycle_failed

    params = flow_run.parameters or {}
    try:
        cfg = load_config(params.get("profile") or "demo", params.get("overrides") or [])
        cycle_id = params.get("cycle_id") or flow_run_cycle_id(flow_run)
        if mark_cycle_failed(cfg, cycle_id, reason=f"flow run {flow_run.name} {state.name}: {state.message}"):
            log.warning("cycle %s: marked FAILED (flow run %s %s)", cycle_id, flow_run.name, state.name)
    except Exception as e:  # a hook that raises hides the run's own error
        log.warning("flow run %s: could not mark its cycle FAILED: %s: %s", flow_run.name, type(e).__name__, e)


@flow(name="lopd-cycle", log_prints=True, flow_run_name=_run_name, on_failure=[mark_failed],
      on_crashed=[mark_failed])
def cycle_flow(profile: str = "demo", overrides: list[str] | None = None, cycle_id: str = "") -> dict:
    """One cycle; an empty ``cycle_id`` names it after this flow run (:func:`flow_run_cycle_id`)."""
    from lopd_core.workspace import Workspace

    overrides = overrides or []
    cycle_id = _current_cycle_id(cycle_id)
    cfg = config(profile, overrides)
    claim_flow_run()
    reap_crashed(cfg)
    refs = {name: stage(name, profile, overrides, cycle_id) for name in ("rollouts", "curate", "index")}
    with training_slot(cfg.cycle.concurrency_limit_name, Workspace.from_config(cfg.workspace).ensure().home):
        refs["distill"] = stage("distill", profile, overrides, cycle_id)
    refs["evaluate"] = stage("evaluate", profile, overrides, cycle_id)
    refs["promote"] = stage("promote", profile, overrides, cycle_id)
    publish_artifacts(cfg, cycle_id)
    return {"cycle_id": cycle_id, "promoted": refs["promote"]["promoted"],
            "student_version": refs["promote"]["student_version"], "champion": refs["promote"]["champion_after"]}


def publish_artifacts(cfg, cycle_id: str) -> None:
    """The cycle report, sample trajectories and the learning curve as Prefect artifacts."""
    import base64

    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from lopd_core.cycle import CycleContext

    ctx = CycleContext(cfg, cycle_id)
    key = artifact_key("cycle", cycle_id)
    report = (ctx.dir / "report.md").read_text() if (ctx.dir / "report.md").exists() else "(no report)"
    curve = ctx.dir / "learning_curve.png"
    if curve.exists():
        report += f"\n\n![learning curve](data:image/png;base64,{base64.b64encode(curve.read_bytes()).decode()})\n"
    create_markdown_artifact(report, key=f"{key}-report", description=f"lopd cycle {cycle_id}")
    rows = ctx.store.read("trajectories", where=f"cycle_id = '{cycle_id}'",
                          columns=["trajectory_id", "task_id", "family", "reward", "success", "status", "n_turns"])
    create_table_artifact(rows.head(12).to_dict(orient="records"), key=f"{key}-trajectories",
                          description="sample trajectories of this cycle")


if __name__ == "__main__":
    import sys

    from flows.common import prefect_environment

    profile = sys.argv[1] if len(sys.argv) > 1 else "demo"
    prefect_environment(profile)
    print(cycle_flow(profile))
