"""Shared state on S3-compatible storage, for real: moto's S3 server (a local process) holds the LanceDB
tables and the MLflow artifacts of a workspace whose locations are s3:// URIs (workspace.lance_uri,
workspace.mlflow_artifacts_uri, workspace.s3_endpoint_url). Two stores opened independently see one table:
rows written by one are read by the other, versions pin, pinned versions survive cleanup."""

from __future__ import annotations

import shutil
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from test_memory_support import make_trajectory
from workspace_procs import free_port, start_server

from lopd_core.config import load_config
from lopd_core.memory.store import ExperienceStore
from lopd_core.workspace import Workspace


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    boto3 = pytest.importorskip("boto3")
    server = shutil.which("moto_server", path=str(Path(sys.executable).parent))
    if server is None:
        pytest.skip("moto's server is not installed (requirements/cpu.txt pins it)")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=url, aws_access_key_id="test", aws_secret_access_key="test",
                          region_name="us-east-1")
    proc = start_server([server, "-H", "127.0.0.1", "-p", str(port)], lambda: client.create_bucket(Bucket="lopd"),
                        log=tmp_path_factory.mktemp("moto") / "moto.log", timeout=60)
    yield url, client
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def s3_workspace(s3_endpoint, tmp_path, monkeypatch):
    url, client = s3_endpoint
    for key, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MLFLOW_S3_ENDPOINT_URL", raising=False)
    prefix = tmp_path.name  # one prefix per test in the shared bucket
    cfg = load_config("smoke", {"workspace.home": str(tmp_path / "ws"), "workspace.s3_endpoint_url": url,
                                "workspace.lance_uri": f"s3://lopd/{prefix}/lance",
                                "workspace.mlflow_artifacts_uri": f"s3://lopd/{prefix}/mlartifacts"})
    return cfg, client, prefix


def test_two_stores_share_one_lancedb_table_on_s3(s3_workspace):
    cfg, client, prefix = s3_workspace
    writer, reader = ExperienceStore.from_config(cfg), ExperienceStore.from_config(cfg)
    assert writer.storage_options["endpoint"].startswith("http://127.0.0.1:") and writer.storage_options["allow_http"]
    first = writer.write_trajectories([make_trajectory(i) for i in range(3)], cycle_id="c1")
    writer.write_trajectories([make_trajectory(i) for i in range(3, 5)], cycle_id="c2")
    assert reader.count("trajectories") == 5
    assert reader.count("trajectories", version=first.version) == 3  # a pinned version reads the same remotely
    again = writer.write_trajectories([make_trajectory(i) for i in range(5)], cycle_id="c2")
    assert not again.changed and reader.count("trajectories") == 5  # idempotent upserts over S3
    kept = reader.keep_versions("trajectories", keep=timedelta(days=30), pinned=[first.version])
    assert kept["pinned"] == [first.version] and kept["removed"] == 0
    assert writer.db.open_table("trajectories").tags.list()[f"pinned-v{first.version}"]["version"] == first.version
    keys = client.list_objects_v2(Bucket="lopd", Prefix=f"{prefix}/lance/trajectories")["KeyCount"]
    assert keys > 0  # the table lives in the bucket, not on this disk
    assert not (Path(cfg.workspace.home) / "lance").exists()


def test_mlflow_artifacts_go_to_the_bucket(s3_workspace):
    from lopd_core.registry import ModelRegistry

    cfg, client, prefix = s3_workspace
    ws = Workspace.from_config(cfg.workspace).ensure()
    registry = ModelRegistry.from_workspace(ws, cfg.registry)
    run_id = registry.training_run("lopd-distill", "s3-check", params={"method": "lopd"})
    registry.log_artifact_text(run_id, "hello from the worker", "note.txt")
    registry.end_run(run_id)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="lopd", Prefix=f"{prefix}/mlartifacts")["Contents"]]
    assert any(k.endswith("note.txt") for k in keys)
    import mlflow

    text = mlflow.artifacts.load_text(f"runs:/{run_id}/note.txt")
    assert text == "hello from the worker"


@pytest.mark.slow  # one smoke cycle over two workers (~1 min)
def test_a_cycle_that_failed_on_one_worker_resumes_on_another(s3_endpoint, tmp_path, models_dir, monkeypatch):
    """workspace.state_uri: worker A's record and checkpoints are in the bucket; worker B, on an empty disk,
    pulls them, skips the stages A finished and resumes distillation from A's last checkpoint."""
    import json

    from lopd_core import cycle
    from lopd_core.operations import list_cycles

    url, _ = s3_endpoint
    for key, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    prefix = tmp_path.name
    shared = {"workspace.s3_endpoint_url": url, "workspace.lance_uri": f"s3://lopd/{prefix}/lance",
              "workspace.state_uri": f"s3://lopd/{prefix}/state",
              # one tracking store for both workers (an MLflow server in production: tests/test_services.py)
              "workspace.mlflow_tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
              "workspace.mlflow_artifacts_uri": f"s3://lopd/{prefix}/mlartifacts",
              "workspace.models_dir": str(models_dir), "distill.steps": 3}
    worker_a = load_config("smoke", {**shared, "workspace.home": str(tmp_path / "a")})
    worker_b = load_config("smoke", {**shared, "workspace.home": str(tmp_path / "b")})
    real_rekey = cycle._rekey

    def lose_the_gpu_at_step_1(trajectories, cycle_id, step):
        if step == 1:
            raise RuntimeError("injected: worker A lost its GPU")
        return real_rekey(trajectories, cycle_id, step)

    monkeypatch.setattr(cycle, "_rekey", lose_the_gpu_at_step_1)
    for stage in ("rollouts", "curate", "index"):
        cycle.run_stage(worker_a, "c1", stage)
    with pytest.raises(RuntimeError, match="lost its GPU"):
        cycle.run_stage(worker_a, "c1", "distill")
    monkeypatch.setattr(cycle, "_rekey", real_rekey)
    assert not (tmp_path / "b" / "runs").exists()  # worker B starts with nothing on its disk
    on_a = json.loads((tmp_path / "a" / "runs" / "c1" / "cycle.json").read_text())
    assert on_a["state"] == "failed" and list(on_a["stages"]) == ["rollouts", "curate", "index"]

    for stage in cycle.STAGES:
        cycle.run_stage(worker_b, "c1", stage)
    record = json.loads((tmp_path / "b" / "runs" / "c1" / "cycle.json").read_text())
    assert record["state"] == "completed"
    assert record["stages"]["distill"]["resumed"] is True and record["stages"]["distill"]["steps"] == 3
    for stage in ("rollouts", "curate", "index"):  # A's stages came with the record and were not run again
        assert record["timings"][stage] == on_a["timings"][stage] and record["stages"][stage] == on_a["stages"][stage]
    store = ExperienceStore.from_config(worker_b)
    ids = store.read("trajectories", where="cycle_id = 'c1'", columns=["trajectory_id"])["trajectory_id"]
    assert len(ids) == ids.nunique() == 4 + 3 * 2  # seed rollouts + 3 steps × 2 episodes: none lost, none twice
    assert list_cycles(worker_a) == ["c1"]  # worker A sees the cycle B finished
    assert json.loads((tmp_path / "a" / "runs" / "c1" / "cycle.json").read_text())["state"] == "completed"
