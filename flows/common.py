"""What every flow file shares: the Prefect environment of a workspace, config loading, retry rules.

``prefect_environment`` must run before Prefect is imported: it points PREFECT_HOME at the workspace and
enables Prefect's ephemeral (server-less) mode unless PREFECT_API_URL names a real server.
"""

from __future__ import annotations

import os

from lopd_core.config import Config, ConfigError, load_config
from lopd_core.workspace import Workspace


def prefect_environment(profile: str = "demo", overrides: list[str] | None = None) -> Workspace:
    cfg = load_config(profile, overrides or [])
    ws = Workspace.from_config(cfg.workspace).ensure()
    for key, value in ws.prefect_env().items():
        os.environ.setdefault(key, value)
    return ws


def config(profile: str, overrides: list[str] | None) -> Config:
    return load_config(profile, overrides or [])


def transient(task, task_run, state) -> bool:
    """Retry condition: retry everything except mistakes that a retry cannot fix."""
    from data_contracts.validate import StageQualityError

    try:
        state.result()
    except (ConfigError, StageQualityError, ValueError, FileNotFoundError, KeyError):
        return False
    except Exception:
        return True
    return False


def flow_run_id() -> str:
    from prefect.runtime import flow_run

    return str(flow_run.id or "")


def ensure_concurrency_limit(name: str, limit: int = 1) -> None:
    """Create the global concurrency limit once (a second create is refused by the server; that is fine)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except Exception:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))
            except Exception:
                pass
