"""The cycle's stages as Prefect tasks, and each stage as its own small flow.

Each task rebuilds the config from (profile, overrides) and calls :func:`lopd_core.cycle.run_stage`, which
is idempotent on the cycle id; results are small dicts. The one-stage flows are named ``lopd-stage-<stage>``
(``lopd-evaluate`` and ``lopd-promote`` are the standalone flows of :mod:`flows.evaluate` and
:mod:`flows.promote`, which act on registered versions). Run one stage by hand, e.g.::

    python -m flows.stages curate --profile demo --cycle-id 20261202T1200
"""

from __future__ import annotations

from prefect import flow, task

from flows.common import config, flow_run_id, transient
from lopd_core.cycle import STAGES, run_stage


@task(name="stage", retry_condition_fn=transient, persist_result=False)
def stage_task(stage: str, profile: str, overrides: list[str], cycle_id: str) -> dict:
    return run_stage(config(profile, overrides), cycle_id, stage, flow_run_id=flow_run_id())


def stage(name: str, profile: str, overrides: list[str], cycle_id: str) -> dict:
    """Submit one stage with the retries of the profile's ``cycle`` section."""
    cfg = config(profile, overrides)
    return stage_task.with_options(name=name, retries=cfg.cycle.retries,
                                   retry_delay_seconds=cfg.cycle.retry_delay_seconds)(name, profile, overrides, cycle_id)


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
