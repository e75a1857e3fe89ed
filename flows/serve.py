"""The Prefect deployments of the pipeline, declared once: `lopd serve` runs them in one process, `lopd deploy`
registers them on a work pool.

``lopd-cycle`` gets the schedule of the profile's ``cycle`` section (interval minutes or cron; the only place
a schedule is written); ``lopd-backfill``, ``lopd-evaluate``, ``lopd-promote``, ``lopd-rollback`` and
``lopd-compare`` run on demand (``prefect deployment run lopd-backfill/lopd-backfill``). Both need a Prefect
server (``prefect server start``; set PREFECT_API_URL); a work pool also needs a worker
(``prefect worker start --pool lopd-process``).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name → (entrypoint relative to the repository root, deployment options)
DEPLOYMENTS: dict[str, tuple[str, dict]] = {
    "lopd-cycle": ("flows/cycle.py:cycle_flow",
                   {"concurrency_limit": 1, "description": "one continual-learning cycle (rollouts → curate → index → "
                                                           "distill → evaluate → promote)"}),
    "lopd-backfill": ("flows/backfill.py:backfill_flow",
                      {"description": "re-curate and re-index a window of past cycles from the stored trajectories"}),
    "lopd-evaluate": ("flows/evaluate.py:evaluate_flow",
                      {"description": "evaluate a registered student version on the held-out tasks"}),
    "lopd-promote": ("flows/promote.py:promote_flow", {"description": "the promotion gate on @challenger vs @champion"}),
    "lopd-rollback": ("flows/promote.py:rollback_flow", {"description": "re-point @champion to the previous pair"}),
    "lopd-compare": ("flows/compare.py:compare_flow",
                     {"concurrency_limit": 1, "description": "LOPD vs the baselines under one rollout budget (resumable)"}),
}


def schedule_of(cfg) -> dict:
    """The ``to_deployment`` schedule argument of ``lopd-cycle`` from the profile's ``cycle`` section."""
    if cfg.cycle.schedule_interval_minutes:
        return {"interval": timedelta(minutes=cfg.cycle.schedule_interval_minutes)}
    if cfg.cycle.schedule_cron:
        return {"cron": cfg.cycle.schedule_cron}
    return {}


def _flow(entrypoint: str):
    import importlib

    module, _, name = entrypoint.partition(":")
    return getattr(importlib.import_module(module.removesuffix(".py").replace("/", ".")), name)


def deployments(profile: str, overrides: list[str] | None = None, *, source: Path | None = None,
                job_variables: dict | None = None) -> list:
    """Every deployment, with the profile and overrides as parameters. ``source`` (a directory holding this
    repository) makes them loadable by a worker in another process: what a work pool needs."""
    from flows.common import config

    cfg = config(profile, overrides)
    params = {"profile": profile, "overrides": list(overrides or [])}
    out = []
    for name, (entrypoint, options) in DEPLOYMENTS.items():
        flow = _flow(entrypoint)
        if source is not None:
            flow = flow.from_source(source=str(source), entrypoint=entrypoint)
        extra = {"job_variables": job_variables} if job_variables else {}
        out.append(flow.to_deployment(name, parameters=params, **options, **(schedule_of(cfg) if name == "lopd-cycle" else {}),
                                      **extra))
    return out


def serve(profile: str = "demo", overrides: list[str] | None = None, *, limit: int | None = None) -> None:
    from prefect import serve as prefect_serve

    prefect_serve(*deployments(profile, overrides), limit=limit)


def deploy(profile: str, overrides: list[str] | None, *, pool: str, env: dict[str, str], source: Path = REPO) -> list:
    """Register every deployment on the work pool ``pool`` (created as a process pool when missing), with
    ``env`` in the worker's job environment; returns the deployment ids."""
    from prefect import deploy as prefect_deploy
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        except ObjectAlreadyExists:
            pass
    found = deployments(profile, overrides, source=source, job_variables={"env": env})
    return list(prefect_deploy(*found, work_pool_name=pool, build=False, push=False, print_next_steps_message=False))


if __name__ == "__main__":
    import sys

    serve(sys.argv[1] if len(sys.argv) > 1 else "demo")
