"""The shared services for real (slow): `infra/services.py up --worker` starts PostgreSQL (as an unprivileged
user), moto's S3 server, the Prefect server on PostgreSQL, the MLflow server on PostgreSQL with artifacts in
the bucket, registers the deployments on a process work pool and starts a worker. Two smoke cycles run
through the `lopd-cycle` deployment; the registry's @champion pair lives in the MLflow server, the LanceDB
tables in the bucket, and no trajectory is duplicated or lost."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from workspace_procs import processes_with_env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    if shutil.which("initdb") is None and not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        pytest.skip("PostgreSQL's initdb is not installed")
    folder = tmp_path_factory.mktemp("services")
    os.chmod(folder, 0o755)  # the unprivileged PostgreSQL owner must reach its data folder
    for parent in folder.parents:
        if parent == Path("/"):
            break
        os.chmod(parent, os.stat(parent).st_mode | 0o005)
    cmd = [sys.executable, str(ROOT / "infra" / "services.py"), "up", "--dir", str(folder), "--extends", "smoke",
           "--worker"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    try:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        yield json.loads((folder / "services.json").read_text()), folder
    finally:
        subprocess.run([sys.executable, str(ROOT / "infra" / "services.py"), "down", "--dir", str(folder)],
                       capture_output=True, timeout=120)


def _wait(client, run_id, timeout=900):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = client.read_flow_run(run_id)
        if run.state is not None and run.state.is_final():
            return run
        time.sleep(2)
    raise AssertionError(f"flow run {run_id} did not finish in {timeout} s")


def test_two_cycles_run_through_the_deployment_on_the_shared_services(services, monkeypatch):
    state, folder = services
    env = dict(line.removeprefix("export ").split("=", 1) for line in (folder / "services.env").read_text().splitlines())
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    with get_client(sync_client=True) as client:
        pool = client.read_work_pool("lopd-process")
        assert pool.type == "process"
        runs = []
        for cycle in ("c1", "c2"):
            flow_run = run_deployment("lopd-cycle/lopd-cycle", parameters={"cycle_id": cycle}, timeout=0)
            runs.append(_wait(client, flow_run.id))
        assert [r.state.type.value for r in runs] == ["COMPLETED", "COMPLETED"], [r.state for r in runs]

    from lopd_core.config import load_config
    from lopd_core.memory.store import ExperienceStore
    from lopd_core.registry import ModelRegistry
    from lopd_core.workspace import Workspace

    cfg = load_config(state["profile"], {"workspace.home": str(folder / "lopd")})
    ws = Workspace.from_config(cfg.workspace)
    assert ws.mlflow_tracking_uri.startswith("http://127.0.0.1:") and ws.lance_uri.startswith("s3://")
    registry = ModelRegistry.from_workspace(ws, cfg.registry)
    champion = registry.champion()
    assert champion is not None and int(champion.student) >= 2  # v1 is the base; each cycle registers a pair
    assert len(registry.versions("student")) == 3
    store = ExperienceStore.from_config(cfg)
    ids = store.read("trajectories", columns=["trajectory_id", "cycle_id"])
    assert set(ids["cycle_id"]) == {"c1", "c2"} and ids["trajectory_id"].is_unique
    assert store.count("experiences") > 0
    import boto3

    s3 = boto3.client("s3", endpoint_url=state["s3"])
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="lopd")["Contents"]]
    assert any(k.startswith("lance/trajectories") for k in keys)
    assert any(k.startswith("mlartifacts/") for k in keys)  # the registered models, through the MLflow server


def test_a_worker_killed_in_distill_is_replaced_and_the_retried_run_resumes(services, monkeypatch):
    """kill -9 of the worker (and its flow run) during distillation; a new worker with an empty disk takes the
    retried run: the cycle's record and last checkpoint come from the bucket, distillation resumes there, the
    expired training lease is taken over, and no trajectory is lost or written twice."""
    import signal

    state, folder = services
    env = dict(line.removeprefix("export ").split("=", 1) for line in (folder / "services.env").read_text().splitlines())
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    import boto3
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Crashed, Scheduled

    s3 = boto3.client("s3", endpoint_url=state["s3"])
    checkpoint = "state/checkpoints/cycle-c3/step_000000/manifest.json"
    flow_run = run_deployment("lopd-cycle/lopd-cycle", timeout=0,
                              parameters={"cycle_id": "c3", "overrides": ["distill.steps=6"]})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:  # until the first checkpoint of distillation is in the bucket
        if s3.list_objects_v2(Bucket="lopd", Prefix=checkpoint).get("KeyCount"):
            break
        time.sleep(1)
    else:
        raise AssertionError("distillation never wrote its first checkpoint")
    # the machine dies: the worker and the flow run it started (Prefect runs it in a session of its own)
    os.killpg(state["pids"]["worker"], signal.SIGKILL)
    for pid in processes_with_env(f"PREFECT__FLOW_RUN_ID={flow_run.id}"):
        os.kill(pid, signal.SIGKILL)

    # a replacement worker on an empty disk (the deployment's job variables name the worker's LOPD_HOME: the
    # dead machine's folders are removed), then "Retry" of the same flow run
    import shutil

    home = folder / "lopd"
    for gone in ("runs", "checkpoints"):
        shutil.rmtree(home / gone, ignore_errors=True)
    log = (folder / "worker2.log").open("w")
    worker = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", "lopd-process"],
                              env={**os.environ, "LOPD_HOME": str(home)}, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True, cwd=ROOT)
    services_file = folder / "services.json"
    recorded = json.loads(services_file.read_text())
    recorded["pids"]["worker2"] = worker.pid  # `down` stops it too
    services_file.write_text(json.dumps(recorded))
    with get_client(sync_client=True) as client:
        # what the server's zombie detection (or lopd's reaper) and then "Retry" in the UI do: Crashed (which
        # releases the deployment's concurrency slot), then Scheduled for the same flow run
        client.set_flow_run_state(flow_run.id, Crashed(message="worker killed"), force=True)
        client.set_flow_run_state(flow_run.id, Scheduled(), force=True)
        final = _wait(client, flow_run.id, timeout=900)
        if final.state.type.value != "COMPLETED":
            from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])), limit=200)
            raise AssertionError(f"{final.state}: " + "\n".join(f"{e.name}: {e.message}" for e in logs[-40:]))

    from lopd_core.config import load_config
    from lopd_core.memory.store import ExperienceStore

    record = json.loads((home / "runs" / "c3" / "cycle.json").read_text())  # pulled, then completed, by the replacement
    assert record["state"] == "completed" and record["stages"]["distill"]["resumed"] is True
    assert record["stages"]["distill"]["steps"] == 6
    cfg = load_config(state["profile"], {"workspace.home": str(home)})
    ids = ExperienceStore.from_config(cfg).read("trajectories", where="cycle_id = 'c3'",
                                                columns=["trajectory_id"])["trajectory_id"]
    assert len(ids) == ids.nunique() == 4 + 6 * 2
