"""The cycle's stages as Prefect tasks, and each stage as its own small flow.

Each task rebuilds the config from (profile, overrides) and calls :func:`lopd_core.cycle.run_stage`, which
is idempotent on the cycle id; results are small dicts. Reuse is Prefect's own task caching: a stage's
result is persisted (Prefect's result storage, by default under ``PREFECT_HOME``, which the workspace sets)
under a key made of its inputs — stage, profile, overrides, cycle id, the workspace and the identity of the
cycle's record (:func:`lopd_core.cycle.open_cycle`) — so a retried or re-run cycle gets each finished stage back in a ``Cached`` state without running it, and a
cycle whose record was deleted starts afresh. While the rollouts, distill and evaluate stages run, a progress artifact
of their task moves with each finished episode (rollouts, evaluate) or training step (distill), and the
library's log lines (one per training step) are in the task's log (:func:`flows.common.forward_library_logs`). The one-stage flows are named ``lopd-stage-<stage>``
(``lopd-evaluate`` and ``lopd-promote`` are the standalone flows of :mod:`flows.evaluate` and
:mod:`flows.promote`, which act on registered versions). Run one stage by hand, e.g.::

    python -m flows.stages curate --profile demo --cycle-id 20261202T1200
"""

from __future__ import annotations

import contextlib

from prefect import flow, task
from prefect.cache_policies import INPUTS

from flows.common import artifact_key, config, flow_run_id, progress_artifact, transient
from lopd_core.cycle import STAGES, open_cycle, run_stage

PROGRESS = {"rollouts": "episodes", "distill": "distill", "evaluate": "episodes"}
"""The :mod:`lopd_core.progress` reports a stage's progress artifact follows."""


@task(name="stage", retry_condition_fn=transient, cache_policy=INPUTS, persist_result=True)
def stage_task(stage: str, profile: str, overrides: list[str], cycle_id: str, workspace: str, record: str):
    """One stage; ``workspace`` and ``record`` (the cycle record's identity) only key the cache."""
    cfg = config(profile, overrides)
    follow = PROGRESS.get(stage)
    watch = (progress_artifact(follow, key=artifact_key("cycle", cycle_id, stage, "progress"),
                               description=f"cycle {cycle_id}: {stage} ({follow})")
             if follow else contextlib.nullcontext())
    with watch:
        return run_stage(cfg, cycle_id, stage, flow_run_id=flow_run_id())


def stage(name: str, profile: str, overrides: list[str], cycle_id: str) -> dict:
    """Run one stage with the retries of the profile's ``cycle`` section (its cached result when it finished
    before)."""
    from lopd_core.workspace import Workspace

    cfg = config(profile, overrides)
    home = str(Workspace.from_config(cfg.workspace).ensure().home)
    return stage_task.with_options(name=name, retries=cfg.cycle.retries,
                                   retry_delay_seconds=cfg.cycle.retry_delay_seconds,
                                   )(name, profile, overrides, cycle_id, home, open_cycle(cfg, cycle_id))


def _stage_flow(name: str):
    @flow(name=f"lopd-stage-{name}", log_prints=True)
    def stage_flow(cycle_id: str, profile: str = "demo", overrides: list[str] | None = None) -> dict:
        return stage(name, profile, overrides or [], cycle_id)

    stage_flow.__doc__ = f"Run the `{name}` stage of one cycle (idempotent on the cycle id)."
    return stage_flow


rollouts_flow, curate_flow, index_flow, distill_flow, evaluate_stage_flow, promote_stage_flow = (
    _stage_flow(s) for s in STAGES)

if __name__ == "__main__":
    import argparse

    from flows.common import prefect_environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--cycle-id", required=True)
    parser.add_argument("--profile", default="demo")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    prefect_environment(args.profile, args.overrides)
    flows = dict(zip(STAGES, (rollouts_flow, curate_flow, index_flow, distill_flow, evaluate_stage_flow,
                              promote_stage_flow), strict=True))
    print(flows[args.stage](args.cycle_id, args.profile, args.overrides))
