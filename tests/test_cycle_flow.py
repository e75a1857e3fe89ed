"""The cycle as a Prefect flow run a user can retry and watch (ephemeral Prefect, real MLflow sqlite, LanceDB,
the smoke profile's tiny model): the cycle id comes from the flow run, a failed run retried resumes its cycle
and its distill checkpoint, the stages' step lines and progress reach the Prefect API, a failed run leaves its
MLflow run FAILED; and the learning curve across cycles."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

import pytest

pytestmark = pytest.mark.filterwarnings("ignore")


def test_cycle_ids_from_moments_and_flow_runs():
    from prefect.client.schemas.objects import FlowRun

    from flows.cycle import flow_run_cycle_id
    from lopd_core.config import check_cycle_id
    from lopd_core.cycle import cycle_id_at

    moment = datetime(2026, 12, 5, 13, 0, 42, tzinfo=UTC)
    assert cycle_id_at(moment) == "20261205T1300Z"
    run_id = uuid.UUID("3f2a9c1b-0000-4000-8000-000000000000")
    assert cycle_id_at(moment, run_id=str(run_id)) == "20261205T1300Z-3f2a9c1b"

    scheduled = FlowRun(flow_id=uuid.uuid4(), id=run_id, auto_scheduled=True, expected_start_time=moment,
                        created=datetime(2026, 12, 5, 12, 0, tzinfo=UTC))
    assert flow_run_cycle_id(scheduled) == "20261205T1300Z"  # the schedule's slot, not when it was created
    by_hand = FlowRun(flow_id=uuid.uuid4(), id=run_id, created=moment, expected_start_time=None)
    assert flow_run_cycle_id(by_hand) == "20261205T1300Z-3f2a9c1b"
    assert check_cycle_id(flow_run_cycle_id(by_hand))
    with pytest.raises(ValueError, match="no creation time"):
        flow_run_cycle_id(FlowRun(flow_id=uuid.uuid4(), created=None))


def test_learning_curve_is_held_out_success_across_cycles(smoke_config):
    from PIL import Image

    from lopd_core.cycle import CycleContext, CycleRecord, cycle_history, learning_curve
    from lopd_core.registry import SUCCESS

    ws_runs = CycleContext(smoke_config, "c0").ws.runs_dir
    rows = [("c1", 0.25, 0.5, "2", True), ("c2", 0.5, 0.25, "3", False), ("c3", 0.5, 0.75, None, None)]
    for i, (cycle_id, champion, challenger, version, promoted) in enumerate(rows):
        stages = {"evaluate": {"champion": {SUCCESS: champion}, "challenger": {SUCCESS: challenger},
                               "champion_student": "1" if i == 0 else "2"}}
        if version is not None:
            stages["promote"] = {"student_version": version, "promoted": promoted}
        CycleRecord(cycle_id, stages=stages, started_at=1000.0 + i).save(ws_runs / cycle_id / "cycle.json")
    CycleRecord("c4", started_at=1004.0).save(ws_runs / "c4" / "cycle.json")  # not evaluated yet: no point

    history = cycle_history(CycleContext(smoke_config, "c3").ws)
    assert [(h["cycle_id"], h["champion_success"], h["challenger_success"], h["promoted"]) for h in history] == [
        ("c1", 0.25, 0.5, True), ("c2", 0.5, 0.25, False), ("c3", 0.5, 0.75, None)]
    # c3's promote stage draws the curve before its result is recorded: it passes that result in
    path = learning_curve(CycleContext(smoke_config, "c3"), {"student_version": "4", "promoted": True})
    assert path is not None and path.name == "learning_curve.png"
    with Image.open(path) as image:
        assert image.width > 300 and image.height > 200


def _prefect_client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def test_a_failed_cycle_flow_run_retried_resumes_its_cycle_and_is_watchable(tmp_path, models_dir, monkeypatch):
    """Attempt 1 fails outside any stage (the failure hook marks the cycle), attempt 2 fails in the middle of
    distillation, attempt 3 completes it from the checkpoint: one flow run, one cycle id, taken from the run."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterStartTime,
        LogFilter,
        LogFilterFlowRunId,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )
    from prefect.flow_engine import run_flow
    from prefect.logging.handlers import APILogWorker

    import flows.cycle as cycle_flows
    import lopd_core.cycle as cycle
    from lopd_core.config import load_config
    from lopd_core.cycle import CycleRecord, CycleState
    from lopd_core.registry import ModelRegistry
    from lopd_core.workspace import Workspace

    monkeypatch.setenv("LOPD_HOME", str(tmp_path / "ws"))
    overrides = [f"workspace.models_dir={models_dir}", "distill.steps=3", "cycle.retries=0"]
    cfg = load_config("smoke", overrides)
    ws = Workspace.from_config(cfg.workspace).ensure()
    for k, v in ws.prefect_env().items():
        monkeypatch.setenv(k, v)

    real_slot, real_rekey = cycle_flows.training_slot, cycle._rekey
    faults = {"slot": 1, "distill step 1": 1}

    def slot_failing_once(*args, **kwargs):
        if faults["slot"]:
            faults["slot"] -= 1
            raise RuntimeError("injected: the training slot could not be taken")
        return real_slot(*args, **kwargs)

    def rekey_failing_once(trajectories, cycle_id, step):
        if step == 1 and faults["distill step 1"]:  # after step 0's checkpoint, before step 1's
            faults["distill step 1"] -= 1
            raise RuntimeError("injected: the worker lost its GPU")
        return real_rekey(trajectories, cycle_id, step)

    monkeypatch.setattr(cycle_flows, "training_slot", slot_failing_once)
    monkeypatch.setattr(cycle, "_rekey", rekey_failing_once)

    # the test process's Prefect API may already hold other tests' flow runs: only those started from now on
    # are this test's
    started = datetime.now(UTC)

    def new_runs(client):
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=started)))

    # --- attempt 1: fails between stages; the on_failure hook marks the cycle and its MLflow run FAILED ---
    with pytest.raises(RuntimeError, match="training slot"):
        cycle_flows.cycle_flow("smoke", overrides)
    with _prefect_client() as client:
        (flow_run,) = new_runs(client)
    assert flow_run.state.type.value == "FAILED"
    cycle_id = flow_run.name.removeprefix("cycle-")
    assert flow_run.name == f"cycle-{cycle_id}" and cycle_id == cycle_flows.flow_run_cycle_id(flow_run)
    assert cycle_id.endswith("-" + flow_run.id.hex[:8])
    record_path = ws.runs_dir / cycle_id / "cycle.json"
    record = CycleRecord.load(record_path, cycle_id)
    assert record.state == CycleState.FAILED and "training slot" in record.error
    assert list(record.stages) == ["rollouts", "curate", "index"]
    registry = ModelRegistry.from_workspace(ws, cfg.registry)
    mlflow_run = registry.find_run("lopd.cycle_id", cycle_id)
    assert mlflow_run.info.status == "FAILED" and "training slot" in mlflow_run.data.tags["lopd.failed"]

    def retry():
        """What a worker does with a run retried from the UI: the same flow run, run again."""
        with _prefect_client() as client:
            again = client.read_flow_run(flow_run.id)
        return run_flow(cycle_flows.cycle_flow, flow_run=again, parameters=again.parameters)

    # --- attempt 2: fails in distillation after the first step's checkpoint ---------------------------------
    with pytest.raises(RuntimeError, match="lost its GPU"):
        retry()
    record = CycleRecord.load(record_path, cycle_id)
    assert record.state == CycleState.FAILED and "distill: RuntimeError" in record.error
    checkpoints = ws.checkpoints_dir / f"cycle-{cycle_id}"
    assert (checkpoints / "step_000000" / "manifest.json").exists()
    assert registry.client.get_run(mlflow_run.info.run_id).info.status == "FAILED"

    # --- attempt 3: the same flow run completes the same cycle, distillation resumed -------------------------
    result = retry()
    assert result["cycle_id"] == cycle_id
    record = CycleRecord.load(record_path, cycle_id)
    assert record.state == CycleState.COMPLETED and record.stages["distill"]["resumed"] is True
    assert record.stages["distill"]["steps"] == 3
    assert sorted(p.name for p in ws.runs_dir.iterdir() if (p / "cycle.json").exists()) == [cycle_id]
    run = registry.client.get_run(mlflow_run.info.run_id)
    assert run.info.status == "FINISHED" and run.data.params["method"] == cfg.distill.method
    assert run.data.params["cycle_id"] == cycle_id

    APILogWorker.drain_all(timeout=30)  # the log lines are sent in the background
    with _prefect_client() as client:
        final = client.read_flow_run(flow_run.id)
        assert final.state.type.value == "COMPLETED" and final.run_count == 3
        assert [r.id for r in new_runs(client)] == [flow_run.id]  # the retries reused the one flow run
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])),
                                      task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(
                                          any_=[flow_run.id])))
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])), limit=200)
        progress = {stage: client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
            any_=[f"cycle-{cycle_id.lower()}-{stage}-progress"]))) for stage in ("rollouts", "distill", "evaluate")}
    # the stages recorded by an earlier attempt show as reused (Cached), the rest ran
    states: dict[str, list[str]] = {}
    for t in sorted(tasks, key=lambda t: t.expected_start_time):
        states.setdefault(t.name.rsplit("-", 1)[0], []).append(t.state.name)
    assert states["rollouts"] == ["Completed", "Cached", "Cached"]
    # (Prefect's own task cache answers them: nothing in flows/ makes a Cached state by hand)
    assert states["distill"] == ["Failed", "Completed"]
    assert states["promote"] == ["Completed"]
    # one line per training step from the library's logger, in the distill task's log
    lines = [entry.message for entry in logs]
    for step in (1, 2, 3):
        assert any(f"step {step}/3" in line for line in lines), f"no line for step {step}: {lines[-20:]}"
    assert any(entry.name.startswith("lopd_core.training") and entry.task_run_id for entry in logs)
    # each watched stage has a progress artifact of its task, ended at 100 % (distill: attempt 2 stopped
    # at a third, attempt 3 went on from the checkpoint); the stages reused by later attempts made none
    for stage in ("rollouts", "evaluate"):
        assert [float(a.data) for a in progress[stage]] == [100.0], stage
    assert sorted(float(a.data) for a in progress["distill"]) == [33.3, 100.0]
    assert json.loads(record_path.read_text())["cycle_id"] == cycle_id
