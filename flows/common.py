"""What every flow file shares: the Prefect environment of a workspace, config loading, retry rules.

``prefect_environment`` must run before Prefect is imported: it points PREFECT_HOME at the workspace and
enables Prefect's ephemeral (server-less) mode unless PREFECT_API_URL names a real server.

Deployment parameters are input from whoever can start a deployment run, so :func:`config` checks them when
the flow runs through a deployment: a plug-in suite is Python imported into the worker, so ``rollout.suite``,
``evaluate.probe_suite`` and a flow's own ``suite`` parameter may name a built-in suite, or a plug-in suite
YAML inside one of the ``rollout.suite_dirs`` of the profile file — and the parameters cannot change
``rollout.suite_dirs``. A flow called directly (``lopd cycle``, ``python -m flows.…``) is the user's own
command and may load any path.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from lopd_core.config import Config, ConfigError, load_config
from lopd_core.workspace import Workspace


def prefect_environment(profile: str = "demo", overrides: list[str] | None = None) -> Workspace:
    cfg = load_config(profile, overrides or [])
    ws = Workspace.from_config(cfg.workspace).ensure()
    for key, value in ws.prefect_env().items():
        os.environ.setdefault(key, value)
    return ws


def deployment_run() -> bool:
    """Whether this code runs in a flow run started through a deployment (its parameters came from outside)."""
    if os.environ.get("PREFECT__RUNTIME__DEPLOYMENT__ID"):  # Prefect's own way to state (or mock) it
        return True
    from prefect.context import FlowRunContext

    flow_run = getattr(FlowRunContext.get(), "flow_run", None)
    return bool(getattr(flow_run, "deployment_id", None))


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
        return True
    except ValueError:
        return False


def check_deployment_suites(cfg: Config, profile: str, suites: dict[str, str] | None = None) -> None:
    """Refuse plug-in suites outside the profile's ``rollout.suite_dirs`` (see the module docstring).

    ``suites``: more suite names a flow takes as its own parameters, by parameter name."""
    from lopd_core.envs import BUILTIN_SUITES

    trusted = load_config(profile).rollout.suite_dirs
    if cfg.rollout.suite_dirs != trusted:
        raise ConfigError(
            f"rollout.suite_dirs: a deployment parameter cannot change it (the profile '{profile}' says "
            f"{trusted}, the overrides make it {cfg.rollout.suite_dirs}); set it in the profile file on the worker"
        )
    dirs = [Path(d).expanduser().resolve() for d in trusted]
    named = {"rollout.suite": cfg.rollout.suite, "evaluate.probe_suite": cfg.evaluate.probe_suite, **(suites or {})}
    for field, name in named.items():
        if name in BUILTIN_SUITES or (field == "evaluate.probe_suite" and name in ("auto", "")):
            continue
        path = Path(name).expanduser().resolve()
        if not any(_inside(path, d) for d in dirs):
            allowed = ", ".join(str(d) for d in dirs) or "none"
            raise ConfigError(
                f"{field}: {name!r} is not a built-in suite ({', '.join(BUILTIN_SUITES)}) and not inside "
                f"rollout.suite_dirs (now: {allowed}). A plug-in suite runs its Python in the worker, so a flow "
                "started through a deployment only loads one from a directory listed in rollout.suite_dirs of "
                "the profile file; add its directory there, or run it with the CLI"
            )


def config(profile: str, overrides: list[str] | None, *, suites: dict[str, str] | None = None) -> Config:
    """The flow's configuration; in a deployment run, with :func:`check_deployment_suites` applied."""
    cfg = load_config(profile, overrides or [])
    if deployment_run():
        check_deployment_suites(cfg, profile, suites)
    return cfg


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
