"""What every flow file shares: the Prefect environment of a workspace, config loading, retry rules, the
training slot, and the reaper that marks crashed what a killed process left running.

``prefect_environment`` must run before Prefect is imported: it points PREFECT_HOME at the workspace and,
unless PREFECT_API_URL names a real server, starts Prefect's temporary API server *tied to this process*:
it gets SIGKILL when the process that started it dies, however it dies (Prefect's own ephemeral server
is stopped by an atexit hook, which a SIGKILL skips, and then outlives the CLI).

Deployment parameters are input from whoever can start a deployment run, so :func:`config` checks them when
the flow runs through a deployment: a plug-in suite is Python imported into the worker, so ``rollout.suite``,
``evaluate.probe_suite`` and a flow's own ``suite`` parameter may name a built-in suite, or a plug-in suite
YAML inside one of the ``rollout.suite_dirs`` of the profile file — and the parameters cannot change
``rollout.suite_dirs``. A flow called directly (``lopd cycle``, ``python -m flows.…``) is the user's own
command and may load any path.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from lopd_core import liveness
from lopd_core.config import Config, ConfigError, load_config
from lopd_core.envs.sandbox import allow_uncontained
from lopd_core.workspace import Workspace, free_port

TEMPORARY_API_ENV = "LOPD_PREFECT_TEMPORARY_API"
"""Set (to the API URL) when PREFECT_API_URL is the temporary server of a lopd process, not a real one."""
SLOT_LEASE_SECONDS = 120.0
OWNER_LABEL = "lopd.owner."

# PR_SET_PDEATHSIG survives exec: the server gets SIGKILL when the thread that started it (the main thread)
# dies. The getppid check covers a parent that died before prctl ran.
_TIED_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(0)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def prefect_environment(profile: str = "demo", overrides: list[str] | None = None, *,
                        temporary_server: bool = True) -> Workspace:
    cfg = load_config(profile, overrides or [])
    ws = Workspace.from_config(cfg.workspace).ensure()
    for key, value in ws.prefect_env().items():
        os.environ.setdefault(key, value)
    if temporary_server and not os.environ.get("PREFECT_API_URL"):
        url = start_temporary_server(float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", 120)))
        if url:
            os.environ["PREFECT_API_URL"] = os.environ[TEMPORARY_API_ENV] = url
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

    profile_rollout = load_config(profile).rollout
    if cfg.rollout.allow_uncontained_sandbox and not profile_rollout.allow_uncontained_sandbox:
        raise ConfigError(
            "rollout.allow_uncontained_sandbox: a deployment parameter cannot turn it on (it lets model-written "
            f"code run without full containment); set it in the profile '{profile}' on the worker"
        )
    trusted = profile_rollout.suite_dirs
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
    """The flow's configuration; in a deployment run, with :func:`check_deployment_suites` applied. Every
    flow and task starts here, so this is also where the library's log lines are forwarded to the run
    (:func:`forward_library_logs`)."""
    forward_library_logs()
    cfg = load_config(profile, overrides or [])
    if deployment_run():
        check_deployment_suites(cfg, profile, suites)
    allow_uncontained(cfg.rollout.allow_uncontained_sandbox)
    return cfg
def real_server() -> bool:
    """Whether PREFECT_API_URL names a real Prefect server (not a lopd process's temporary one)."""
    url = os.environ.get("PREFECT_API_URL", "")
    return bool(url) and url != os.environ.get(TEMPORARY_API_ENV)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start_temporary_server(timeout: float = 120.0) -> str | None:
    """Prefect's API server in a child process that dies with this one; its URL (None: not on Linux, where
    Prefect's own ephemeral server is used instead). The same server Prefect's ephemeral mode runs."""
    import importlib.util

    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return None
    site = Path(importlib.util.find_spec("prefect").origin).parent.parent
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    deadline = time.monotonic() + timeout
    for _attempt in range(5):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-c", _TIED_LAUNCHER, str(os.getpid()), sys.executable, "-m", "uvicorn",
             "--app-dir", str(site), "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1",
             "--port", str(port), "--log-level", "error", "--lifespan", "on"],
            env=env, stdin=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}/api"
        while proc.poll() is None and time.monotonic() < deadline and not _healthy(url):
            time.sleep(0.2)
        if proc.poll() is None and _healthy(url):
            atexit.register(_stop, proc)
            return url
        if proc.poll() is None or time.monotonic() >= deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"Prefect's temporary API server did not answer within {timeout:.0f} s "
                               "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS); set PREFECT_API_URL to use a "
                               "running server instead")
        # it exited: most likely the port was taken between the probe and its bind; try another
    raise RuntimeError(f"Prefect's temporary API server exited at start five times (exit status {proc.returncode}); "
                       "its output is above")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key from ``parts`` (keys allow lowercase letters, digits and dashes only)."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


# --------------------------------------------------------------------------------------------------
# Watching a run: the library's log lines and progress in the Prefect UI
class _InRun(logging.Filter):
    """Pass only records made inside a flow or task run (the API handler has nowhere to send the others)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from prefect.context import FlowRunContext, TaskRunContext

        return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def forward_library_logs() -> None:
    """Send the ``lopd_core`` loggers' INFO lines (one per training step, …) to the Prefect run they are
    made in — what ``PREFECT_LOGGING_EXTRA_LOGGERS=lopd_core`` does, also in a worker started without it.
    Records made outside a run (a heartbeat thread, the CLI around the flow) stay local. Idempotent."""
    from prefect.logging.handlers import APILogHandler

    logger = logging.getLogger("lopd_core")
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    if not any(isinstance(h, APILogHandler) for h in logger.handlers):
        handler = APILogHandler()
        handler.addFilter(_InRun())
        logger.addHandler(handler)


@contextlib.contextmanager
def progress_artifact(follow: str, *, key: str, description: str):
    """A progress artifact of the running flow or task, moved by the library's ``follow`` progress reports
    (:mod:`lopd_core.progress`: ``episodes``, ``distill``). A failed update is printed, never raised."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    from lopd_core.progress import reporting

    artifact_id = create_progress_artifact(0.0, key=key, description=description)

    def listener(name: str, done: int, total: int) -> None:
        if name != follow or total <= 0:
            return
        try:
            update_progress_artifact(artifact_id, round(100.0 * done / total, 1))
        except Exception as e:  # the UI lags; the work goes on
            print(f"progress artifact {key}: update failed ({type(e).__name__}: {e})")

    with reporting(listener):
        yield artifact_id


# --------------------------------------------------------------------------------------------------
# Owners and the reaper
def claim_flow_run() -> None:
    """Label the current flow run with this process (pid, host, boot, start), for :func:`reap_crashed`."""
    from uuid import UUID

    from prefect.client.orchestration import get_client

    run_id = flow_run_id()
    if not run_id:
        return
    stamp = {OWNER_LABEL + k: v for k, v in liveness.owner().items() if k != "heartbeat"}
    with get_client(sync_client=True) as client:
        client.update_flow_run_labels(UUID(run_id), stamp)


def _crash_flow_runs(known: dict[str, str], stale_after: float) -> list[dict[str, str]]:
    """Set Crashed on the flow runs of dead owners: those in ``known`` (id → reason) and any running one
    labelled with an owner that is gone."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    active = (StateType.RUNNING, StateType.PENDING, StateType.CANCELLING)
    crashed = []
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=list(active)))), limit=200)
        candidates = {str(r.id): r for r in runs}
        for run_id in known:
            if run_id not in candidates:
                with contextlib.suppress(Exception):
                    run = client.read_flow_run(UUID(run_id))
                    if run.state_type in active:
                        candidates[run_id] = run
        for run_id, run in candidates.items():
            if run_id == flow_run_id():  # this run: alive, whatever an earlier attempt of it left behind
                continue
            labels = {k.removeprefix(OWNER_LABEL): str(v) for k, v in (run.labels or {}).items()
                      if k.startswith(OWNER_LABEL)}
            reason = known.get(run_id) or liveness.dead_reason(labels, stale_after=stale_after)
            if not reason:
                continue
            client.set_flow_run_state(run.id, Crashed(message=f"lopd reaper: {reason}"), force=True)
            crashed.append({"flow_run_id": run_id, "name": run.name, "reason": reason})
    return crashed


def reap_crashed(cfg: Config) -> dict:
    """At the start of a cycle, comparison, promote or rollback: mark crashed what killed processes left
    running — their MLflow runs (KILLED), cycle records (``crashed``), Prefect flow runs (Crashed) — repair
    a lagging composer alias, and free the training slot a crashed holder kept."""
    from lopd_core.operations import reap

    found = reap(cfg)
    known = {r["flow_run_id"]: r["reason"] for r in found["mlflow_runs"] + found["cycles"] if r.get("flow_run_id")}
    # a retried flow run is the same flow run as the killed attempt whose leftovers were just reaped: never
    # crash the run that is doing the reaping
    known.pop(flow_run_id(), None)
    try:
        found["flow_runs"] = _crash_flow_runs(known, cfg.registry.stale_after_seconds)
    except Exception as e:  # no Prefect API reachable: the MLflow and record side is done anyway
        found["flow_runs"], found["flow_runs_error"] = [], f"{type(e).__name__}: {e}"
    ws = Workspace.from_config(cfg.workspace).ensure()
    found["training_slot"] = free_stale_slot(cfg.cycle.concurrency_limit_name, ws.home)
    for r in found["mlflow_runs"]:
        print(f"reaper: MLflow run {r['run_name'] or r['run_id']} marked KILLED: {r['reason']}")
    for r in found["cycles"]:
        print(f"reaper: cycle {r['cycle_id']} marked crashed: {r['reason']}")
    for r in found["flow_runs"]:
        print(f"reaper: flow run {r['name']} ({r['flow_run_id']}) set Crashed: {r['reason']}")
    for line in found["aliases_repaired"]:
        print(f"reaper: repaired the composer alias {line}")
    if found["training_slot"]:
        print(f"reaper: {found['training_slot']}")
    if found.get("flow_runs_error"):
        print(f"reaper: could not check Prefect flow runs: {found['flow_runs_error']}")
    return found


# --------------------------------------------------------------------------------------------------
# The training slot
def ensure_concurrency_limit(name: str, limit: int = 1) -> None:
    """Create the global concurrency limit ``name`` when it is missing. Only "it exists already" (another
    process created it first) is not an error: a limit that could not be created would be no limit, so any
    other failure (server unreachable, refused) raises and the training does not start unguarded."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
            return
        except ObjectNotFound:
            pass
        with contextlib.suppress(ObjectAlreadyExists):
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))
        client.read_global_concurrency_limit_by_name(name)  # there now, or this raises


def _reset_active_slots(name: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(name)
        if limit.active_slots:
            client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))


def _read_holder(lock) -> dict:
    lock.seek(0)
    text = lock.read().strip()
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}


def _write_holder(lock, holder: dict) -> None:
    lock.seek(0)
    lock.truncate()
    if holder:
        lock.write(json.dumps(holder))
    lock.flush()


def _free_leftover(lock, name: str) -> str:
    """With the file lock held: whatever slot the lock file still names was kept by a holder that died
    (a holder that ends clears it). Release its lease (a real server keeps it until it expires) and, with
    a temporary server, reset the slots it counted. Returns what was freed ('' = nothing)."""
    from uuid import UUID

    from prefect.client.orchestration import get_client

    holder = _read_holder(lock)
    freed = ""
    if holder.get("lease_id"):
        with get_client(sync_client=True) as client, contextlib.suppress(Exception):  # expired already
            client.release_concurrency_slots_with_lease(UUID(holder["lease_id"]))
        freed = (f"released the training slot lease of process {holder.get('pid')} on {holder.get('host')}, "
                 "which died holding it")
        _write_holder(lock, {})
    if not real_server():
        _reset_active_slots(name)
    return freed


def free_stale_slot(name: str, lock_dir) -> str:
    """Free the training slot if its last holder died holding it; '' when it is free or held by a live process."""
    ensure_concurrency_limit(name)
    path = Path(lock_dir) / ".training.lock"
    with path.open("a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return ""
        try:
            return _free_leftover(lock, name)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _acquire_slot(name: str, lease_duration: float) -> str:
    """Occupy one slot of ``name`` with a lease (waiting while it is taken); the lease id ('' if no limit)."""
    import httpx
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        while True:
            try:
                response = client.increment_concurrency_slots_with_lease(
                    names=[name], slots=1, mode="concurrency", lease_duration=lease_duration)
            except httpx.HTTPStatusError as e:
                if e.response.status_code != 423:
                    raise
                time.sleep(float(e.response.headers.get("Retry-After", 2.0)))
                continue
            body = response.json()
            return str(body.get("lease_id") or "") if body.get("limits") else ""


def _renew_until(stop: threading.Event, lease_id: str, lease_duration: float) -> None:
    from uuid import UUID

    from prefect.client.orchestration import get_client

    while not stop.wait(lease_duration / 3):
        try:
            with get_client(sync_client=True) as client:
                client.renew_concurrency_lease(UUID(lease_id), lease_duration=lease_duration)
        except Exception as e:  # a missed renewal is retried; the lease outlives two of them
            print(f"training slot: lease renewal failed ({type(e).__name__}: {e}); retrying")


@contextlib.contextmanager
def training_slot(name: str, lock_dir, lease_duration: float = SLOT_LEASE_SECONDS):
    """Hold the global concurrency limit ``name`` (one training cycle at a time) — crash-safe.

    A file lock in the workspace (released by the OS when its holder dies) is the truth on one machine; the
    holder writes its stamp and its Prefect lease id into the lock file and clears them when it ends. So
    once we hold the file lock, a lease still named there belongs to a holder that died: it is released
    at once (a real server would keep the slot until the lease expires), and with a temporary server the
    slots it counted are reset.
    """
    ensure_concurrency_limit(name)
    path = Path(lock_dir) / ".training.lock"
    with path.open("a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"another cycle is training in this workspace; waiting for {path}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            freed = _free_leftover(lock, name)
            if freed:
                print(f"training slot: {freed}")
            lease_id = _acquire_slot(name, lease_duration)
            _write_holder(lock, {**liveness.owner(), "lease_id": lease_id, "flow_run_id": flow_run_id()})
            stop = threading.Event()
            renewer = threading.Thread(target=_renew_until, args=(stop, lease_id, lease_duration), daemon=True,
                                       name="lopd-slot-lease")
            if lease_id:
                renewer.start()
            try:
                yield
            finally:
                stop.set()
                if lease_id:
                    from uuid import UUID

                    from prefect.client.orchestration import get_client

                    with get_client(sync_client=True) as client, contextlib.suppress(Exception):
                        client.release_concurrency_slots_with_lease(UUID(lease_id))
                _write_holder(lock, {})
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
