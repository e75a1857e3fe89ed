"""`lopd-backfill`: rebuild curation and the index (and optionally evaluations) for a window of past cycles.

Why: after a new curation rule or embedder the experience bank should look as if it had always been
built that way. How: :func:`lopd_core.operations.backfill` re-curates the stored trajectories of the window
and re-indexes them; unchanged rows are not rewritten, so a second run is a no-op.

Run it: ``lopd backfill --since 20261201T000000 --profile demo`` or via the deployment
(``prefect deployment run lopd-backfill/lopd-backfill``).
"""

from __future__ import annotations

from prefect import flow, task

from flows.common import config, transient
from lopd_core import operations


@task(retry_condition_fn=transient, retries=2, retry_delay_seconds=5, persist_result=False)
def backfill_task(profile: str, overrides: list[str], cycle_ids: list[str], since: str, until: str,
                  rebuild_index: bool, reevaluate: list[str]) -> dict:
    return operations.backfill(config(profile, overrides), cycle_ids=cycle_ids, since=since, until=until,
                               rebuild_index=rebuild_index, reevaluate=reevaluate)


@flow(name="lopd-backfill", log_prints=True)
def backfill_flow(profile: str = "demo", overrides: list[str] | None = None, cycle_ids: list[str] | None = None,
                  since: str = "", until: str = "", rebuild_index: bool = False,
                  reevaluate: list[str] | None = None) -> dict:
    """Re-curate and re-index a window of cycles; ``reevaluate`` lists student versions to score again."""
    from prefect.artifacts import create_markdown_artifact

    result = backfill_task(profile, overrides or [], cycle_ids or [], since, until, rebuild_index, reevaluate or [])
    create_markdown_artifact(f"# lopd backfill\n\n```json\n{__import__('json').dumps(result, indent=2, default=str)}\n```",
                             key="lopd-backfill")
    return result
