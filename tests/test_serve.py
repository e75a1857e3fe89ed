"""`lopd serve` against a real local Prefect server: a scheduled smoke cycle runs to completion, and a manual
backfill started with `prefect deployment run` completes. Slow (server start-up, scheduler loops)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lopd_core.workspace import free_port

pytestmark = pytest.mark.slow


def _wait(predicate, timeout: float, what: str, procs=()):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{p.args[:3]} exited with {p.returncode} while waiting for {what}")
        value = predicate()
        if value:
            return value
        time.sleep(2)
    raise AssertionError(f"timed out waiting for {what}")


def _flow_runs(env, deployment: str) -> list:
    code = (
        "import asyncio, json\n"
        "from prefect.client.orchestration import get_client\n"
        "from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName\n"
        "async def main():\n"
        "    async with get_client() as c:\n"
        f"        runs = await c.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=['{deployment}'])))\n"
        "        print(json.dumps([r.state_type.value for r in runs]))\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    import json

    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else []


def test_serve_runs_a_scheduled_cycle_and_a_manual_backfill(tmp_path, models_dir):
    port = free_port()
    home = tmp_path / "ws"
    env = {**os.environ, "LOPD_HOME": str(home), "PREFECT_HOME": str(tmp_path / "prefect-server"),
           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5", "PREFECT_RUNNER_POLL_FREQUENCY": "3"}
    prefect = str(Path(sys.executable).with_name("prefect"))
    server = subprocess.Popen([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    serve = None
    try:
        _wait(lambda: _health(port), 120, "the Prefect server", [server])
        serve = subprocess.Popen(
            [sys.executable, "-m", "lopd_cli", "serve", "--profile", "smoke",
             "--set", f"workspace.models_dir={models_dir}", "--set", "cycle.schedule_interval_minutes=1"],
            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "serve.log", "w"), start_new_session=True)
        states = _wait(lambda: [s for s in _flow_runs(env, "lopd-cycle") if s == "COMPLETED"], 900,
                       "a scheduled lopd-cycle run to complete", [server, serve])
        assert states
        run = subprocess.run([prefect, "deployment", "run", "lopd-backfill/lopd-backfill"], env=env,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        _wait(lambda: "COMPLETED" in _flow_runs(env, "lopd-backfill"), 600, "the backfill run", [server, serve])
        assert any(p.name == "cycle.json" for p in (home / "runs").rglob("cycle.json"))
    finally:
        for proc in (serve, server):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)


def _health(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False
