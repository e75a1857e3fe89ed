"""`lopd-cycle`: one continual-learning cycle — rollouts → curate → index → distill → evaluate → promote.

Why: each cycle turns the agent's newest experience into a better (or, by the gate, unchanged) champion.
How: every stage is a task over :mod:`lopd_core.cycle` (idempotent on ``cycle_id``, so a re-run resumes
after the last completed stage and distillation resumes from its checkpoint); the distill stage holds the
global concurrency limit ``cycle.concurrency_limit_name`` so two cycles never train at once. Before the
first stage the flow labels its run with its process and reaps what killed processes left running
(``flows.common.reap_crashed``: their MLflow runs, cycle records, flow runs and training slot). The flow
publishes the cycle report (markdown), a table of sample trajectories and the learning curve as artifacts.

Run it:  ``lopd cycle --profile demo``  (ephemeral Prefect, no server), or ``python -m flows.cycle``;
serve it on a schedule: ``lopd serve --profile demo``.
"""

from __future__ import annotations

from datetime import UTC, datetime

from prefect import flow

from flows.common import claim_flow_run, config, reap_crashed, training_slot
from flows.stages import stage


def new_cycle_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S")


@flow(name="lopd-cycle", log_prints=True)
def cycle_flow(profile: str = "demo", overrides: list[str] | None = None, cycle_id: str = "") -> dict:
    """One cycle; an empty ``cycle_id`` starts a new one named after the current UTC time."""
    from lopd_core.workspace import Workspace

    overrides = overrides or []
    cycle_id = cycle_id or new_cycle_id()
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
    key = f"cycle-{cycle_id.lower().replace('_', '-')}"
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
