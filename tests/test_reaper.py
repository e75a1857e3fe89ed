"""The reaper, for real: a `lopd cycle` subprocess is SIGKILLed after it opened its MLflow run; its temporary
Prefect server dies with it, and the next `lopd` start marks the MLflow run KILLED, the cycle record crashed
and the Prefect flow run Crashed. A training slot whose holder was SIGKILLed is free at once on a real Prefect
server. The owner test itself (`lopd_core.liveness`) on live, dead and recycled pids and remote heartbeats."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from workspace_procs import workspace_processes

from lopd_core import liveness
from lopd_core.workspace import free_port

pytestmark = pytest.mark.filterwarnings("ignore")


def _env(home: Path) -> dict[str, str]:
    env = {**os.environ, "LOPD_HOME": str(home)}
    for key in ("PREFECT_API_URL", "LOPD_PREFECT_TEMPORARY_API"):
        env.pop(key, None)
    return env


def _wait(predicate, timeout: float, what: str, proc=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended ({proc.returncode}) before {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _cycle_run(home: Path):
    db = home / "mlflow.db"
    if not db.exists():
        return None
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as con:
            row = con.execute("SELECT r.run_uuid, r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                              "WHERE t.key = 'lopd.cycle_id' AND t.value = 'k9'").fetchone()
    except sqlite3.Error:
        return None
    return row


@pytest.mark.slow  # about 90 s on 2 busy cores; the fast suite's kill -9 is test_cycle's crash test
@pytest.mark.skipif(sys.platform != "linux", reason="the owner test reads /proc")
def test_killed_cycle_is_marked_crashed_at_the_next_start(tmp_path, models_dir):
    home = tmp_path / "ws"
    base = [sys.executable, "-m", "lopd_cli"]
    sets = ["--profile", "smoke", "--set", f"workspace.models_dir={models_dir}"]
    proc = subprocess.Popen([*base, "cycle", "--cycle-id", "k9", *sets], env=_env(home),
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "cycle.log", "w"))
    try:
        run = _wait(lambda: _cycle_run(home), 300, "the cycle's MLflow run", proc)
        assert run[1] == "RUNNING"
        record = json.loads((home / "runs" / "k9" / "cycle.json").read_text())
        assert record["owner"]["pid"] == str(proc.pid) and record["state"] == "running"
        flow_run_id = record["owner"]["flow_run_id"]
        assert flow_run_id
        os.kill(proc.pid, signal.SIGKILL)  # the main process only: nothing of it may stay behind
        proc.wait()
        # the temporary Prefect server (and anything else the cycle started) dies with it
        _wait(lambda: not workspace_processes(home), 20, "the cycle's child processes to end")
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in workspace_processes(home):  # only if the assertion above failed
            os.kill(pid, signal.SIGKILL)

    # the record still says running (nothing ran after the kill); `lopd status` flags it
    from lopd_core.config import load_config
    from lopd_core.status import workspace_status
    from lopd_core.workspace import Workspace

    assert json.loads((home / "runs" / "k9" / "cycle.json").read_text())["state"] == "running"
    cfg = load_config("smoke", {"workspace.home": str(home), "workspace.models_dir": str(models_dir)})
    status = workspace_status(cfg, Workspace.from_config(cfg.workspace))
    assert status["cycles"][0]["state"] == "crashed (not yet marked)"
    assert f"process {proc.pid}" in status["cycles"][0]["error"]
    assert any(f"process {proc.pid}" in p for p in status["registry"]["problems"])

    # the next start (here a rollback, which has nothing to roll back to) reaps first
    res = subprocess.run([*base, "rollback", *sets], env=_env(home), capture_output=True, text=True, timeout=300)
    assert "nothing to roll back" in res.stderr, res.stderr[-3000:]
    assert f"process {proc.pid}" in res.stdout + res.stderr

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    killed = client.get_run(run[0])
    assert killed.info.status == "KILLED"
    assert f"process {proc.pid}" in killed.data.tags["lopd.crashed"]
    record = json.loads((home / "runs" / "k9" / "cycle.json").read_text())
    assert record["state"] == "crashed" and f"process {proc.pid}" in record["error"]
    with sqlite3.connect(home / "prefect" / "prefect.db") as con:
        state, message = con.execute(
            "SELECT f.state_type, s.message FROM flow_run f JOIN flow_run_state s ON s.id = f.state_id "
            "WHERE f.id = ?", (flow_run_id,)).fetchone()
    assert state == "CRASHED" and f"process {proc.pid}" in message
    assert not workspace_processes(home)  # the rollback's own temporary server stopped with it


def test_owner_stamps_tell_live_dead_recycled_and_remote_processes():
    me = liveness.owner()
    assert liveness.dead_reason(me, stale_after=60) == "" and liveness.is_self(me)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    gone = {**me, "pid": str(child.pid), "start": ""}
    assert f"process {child.pid}" in liveness.dead_reason(gone, stale_after=60)
    if sys.platform == "linux":
        recycled = {**me, "start": str(int(me["start"]) - 1)}  # our pid, another process's start time
        assert "belongs to another process" in liveness.dead_reason(recycled, stale_after=60)
        rebooted = {**me, "boot": "another-boot"}
        assert "rebooted" in liveness.dead_reason(rebooted, stale_after=60)
    remote = {**me, "host": me["host"] + "-elsewhere", "heartbeat": f"{time.time() - 120:.0f}"}
    assert "no heartbeat" in liveness.dead_reason(remote, stale_after=60)
    assert liveness.dead_reason(remote, stale_after=600) == ""
    assert liveness.dead_reason({}, stale_after=1) == ""  # no stamp: cannot tell, left alone


def test_reaper_marks_dead_runs_and_records_and_leaves_live_ones(tmp_path, smoke_config):
    from lopd_core.cycle import CycleRecord, CycleState, reap_cycle_records
    from lopd_core.registry import ModelRegistry
    from lopd_core.workspace import Workspace

    ws = Workspace.from_config(smoke_config.workspace).ensure()
    reg = ModelRegistry.from_workspace(ws, smoke_config.registry)
    live = reg.cycle_run("live")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = reg.comparison_run("compare-toolworld", "lopd-s0")
    reg.client.set_tag(dead, "lopd.owner.pid", str(child.pid))  # as if that process had opened it
    reg.client.set_tag(dead, "lopd.owner.start", "")
    legacy = reg.client.create_run(reg.experiment_id, run_name="legacy").info.run_id  # no stamp
    for cycle_id, pid in (("crashed", child.pid), ("alive", os.getpid())):
        CycleRecord(cycle_id, owner={**liveness.owner(), "pid": str(pid), "start": ""}).save(
            ws.runs_dir / cycle_id / "cycle.json")

    assert [r["run_id"] for r in reg.reap_runs(dry_run=True)] == [dead]
    reaped = reg.reap_runs()
    assert [r["run_id"] for r in reaped] == [dead] and f"process {child.pid}" in reaped[0]["reason"]
    assert reg.client.get_run(dead).info.status == "KILLED"
    assert reg.client.get_run(live).info.status == reg.client.get_run(legacy).info.status == "RUNNING"
    assert [r["cycle_id"] for r in reap_cycle_records(ws, stale_after=60)] == ["crashed"]
    assert CycleRecord.load(ws.runs_dir / "crashed" / "cycle.json", "crashed").state == CycleState.CRASHED
    assert CycleRecord.load(ws.runs_dir / "alive" / "cycle.json", "alive").state == CycleState.RUNNING
    # a resumed run is reopened and stamped with its new owner; finishing it stops its heartbeat
    assert reg.comparison_run("compare-toolworld", "lopd-s0") == dead
    resumed = reg.client.get_run(dead)
    assert resumed.info.status == "RUNNING" and resumed.data.tags["lopd.owner.pid"] == str(os.getpid())
    reg.end_run(dead)
    reg.end_run(live)
    reg.end_run(legacy)


_HOLDER = """
import sys, time
from flows.common import training_slot
with training_slot("lopd-training-test", sys.argv[1], lease_duration=float(sys.argv[2])):
    print("held", flush=True)
    time.sleep(600)
"""

_TAKER = """
import sys, time
from flows.common import training_slot
t0 = time.monotonic()
with training_slot("lopd-training-test", sys.argv[1], lease_duration=float(sys.argv[2])):
    print(f"acquired after {time.monotonic() - t0:.1f} s", flush=True)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="flock + /proc")
def test_slot_of_a_killed_holder_is_free_at_once_on_a_real_server(tmp_path):
    """A real server keeps a SIGKILLed holder's lease until it expires (120 s by default: the resumed cycle used to
    wait ~80 s); the lock file names the lease, and the next holder releases it."""
    port = free_port()
    env = {**_env(tmp_path / "ws"), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
                               "--host", "127.0.0.1", "--port", str(port), "--log-level", "error"],
                              env={**env, "PREFECT_UI_ENABLED": "0"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    holder = None
    try:
        from flows.common import _healthy

        _wait(lambda: _healthy(env["PREFECT_API_URL"]), 120, "the Prefect server", server)
        lock_dir = tmp_path / "ws"
        lock_dir.mkdir()
        holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock_dir), "300"], env=env,
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
        assert json.loads((lock_dir / ".training.lock").read_text())["lease_id"]
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        taker = subprocess.run([sys.executable, "-c", _TAKER, str(lock_dir), "300"], env=env, capture_output=True,
                               text=True, timeout=120)
        assert taker.returncode == 0, taker.stderr[-3000:]
        assert "released the training slot lease of process" in taker.stdout
        waited = float(taker.stdout.split("acquired after ")[1].split()[0])
        assert waited < 20, taker.stdout  # the lease had 300 s to run
        assert (lock_dir / ".training.lock").read_text() == ""  # a holder that ends clears its stamp
    finally:
        for proc in (holder, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_stage_that_raises_marks_its_record_and_mlflow_run_failed(smoke_config):
    from lopd_core.cycle import CycleContext, CycleRecord, CycleState

    def opens_then_fails(ctx):
        ctx.registry.log_metrics(ctx.mlflow_run_id, {"x": 1.0})
        raise ValueError("bad input")

    def fails_before_touching_mlflow(ctx):
        raise ValueError("bad input again")

    ctx = CycleContext(smoke_config, "f1")
    with pytest.raises(ValueError):
        ctx.run_stage("rollouts", opens_then_fails)
    run = ctx.registry.client.get_run(ctx.mlflow_run_id)
    assert run.info.status == "FAILED" and "rollouts: ValueError: bad input" in run.data.tags["lopd.failed"]
    # the retry (a new context, as a Prefect retry has) reopens the run, and fails it again
    retry = CycleContext(smoke_config, "f1")
    assert retry.mlflow_run_id == ctx.mlflow_run_id
    assert retry.registry.client.get_run(ctx.mlflow_run_id).info.status == "RUNNING"
    with pytest.raises(ValueError):
        CycleContext(smoke_config, "f1").run_stage("rollouts", fails_before_touching_mlflow)
    assert retry.registry.client.get_run(ctx.mlflow_run_id).info.status == "FAILED"
    record = CycleRecord.load(ctx.record_path, "f1")
    assert record.state == CycleState.FAILED and record.owner["pid"] == str(os.getpid())



def test_a_training_limit_that_cannot_be_created_stops_the_holder(tmp_path):
    """A limit that failed to be created would be no limit: an unreachable server is an error, not a pass."""
    env = {**_env(tmp_path / "ws"), "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api", "PREFECT_CLIENT_MAX_RETRIES": "0"}
    code = "from flows.common import ensure_concurrency_limit; ensure_concurrency_limit('lopd-training-test')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "ConnectError" in done.stderr, done.stderr[-2000:]
