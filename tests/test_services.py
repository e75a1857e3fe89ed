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
