"""What every flow file shares: the Prefect environment of a workspace, config loading, retry rules.

``prefect_environment`` must run before Prefect is imported: it points PREFECT_HOME at the workspace and
enables Prefect's ephemeral (server-less) mode unless PREFECT_API_URL names a real server.
"""

from __future__ import annotations

import contextlib
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


def _reset_active_slots(name: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(name)
        if limit.active_slots:
            client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))


@contextlib.contextmanager
def training_slot(name: str, lock_dir):
    """Hold the global concurrency limit ``name`` (one training cycle at a time) — crash-safe.

    Prefect's slot is leased by the server; an ephemeral server dies with its process, so a cycle killed
    while training would leave the slot occupied forever. A file lock in the workspace (released by the OS
    when its holder dies) is the truth on one machine: once we hold it, slots still marked active in an
    ephemeral (server-less) setup can only be leftovers of a crashed run and are reset. With a real server
    (PREFECT_API_URL set) leases are left to the server, which revokes expired ones.
    """
    import fcntl
    from pathlib import Path

    from prefect.concurrency.sync import concurrency

    ensure_concurrency_limit(name)
    path = Path(lock_dir) / ".training.lock"
    with path.open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"another cycle is training in this workspace; waiting for {path}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.environ.get("PREFECT_API_URL"):
            _reset_active_slots(name)
        try:
            with concurrency(name, occupy=1, lease_duration=120):
                yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
