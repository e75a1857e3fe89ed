"""`lopd serve`: register every deployment in one process and run them (``prefect.serve``).

``lopd-cycle`` gets the schedule of the profile's ``cycle`` section (interval minutes or cron);
``lopd-backfill``, ``lopd-evaluate``, ``lopd-promote``, ``lopd-rollback`` and ``lopd-compare`` run on demand
(``prefect deployment run lopd-backfill/lopd-backfill``). Needs a Prefect server
(``prefect server start``; set PREFECT_API_URL). For work pools use ``infra/prefect.yaml`` instead.
"""

from __future__ import annotations

from datetime import timedelta


def deployments(profile: str, overrides: list[str] | None = None) -> list:
    from flows.backfill import backfill_flow
    from flows.common import config
    from flows.compare import compare_flow
    from flows.cycle import cycle_flow
    from flows.evaluate import evaluate_flow
    from flows.promote import promote_flow, rollback_flow

    cfg = config(profile, overrides)
    params = {"profile": profile, "overrides": list(overrides or [])}
    schedule = {}
    if cfg.cycle.schedule_interval_minutes:
        schedule["interval"] = timedelta(minutes=cfg.cycle.schedule_interval_minutes)
    elif cfg.cycle.schedule_cron:
        schedule["cron"] = cfg.cycle.schedule_cron
    return [
        cycle_flow.to_deployment("lopd-cycle", parameters=params, concurrency_limit=1, **schedule,
                                 description="one continual-learning cycle"),
        backfill_flow.to_deployment("lopd-backfill", parameters=params),
        evaluate_flow.to_deployment("lopd-evaluate", parameters=params),
        promote_flow.to_deployment("lopd-promote", parameters=params),
        rollback_flow.to_deployment("lopd-rollback", parameters=params),
        compare_flow.to_deployment("lopd-compare", parameters=params, concurrency_limit=1,
                                   description="LOPD vs the baselines under one rollout budget (resumable)"),
    ]


def serve(profile: str = "demo", overrides: list[str] | None = None, *, limit: int | None = None) -> None:
    from prefect import serve as prefect_serve

    prefect_serve(*deployments(profile, overrides), limit=limit)


if __name__ == "__main__":
    import sys

    serve(sys.argv[1] if len(sys.argv) > 1 else "demo")
