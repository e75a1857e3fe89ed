"""The deployments are declared once (``flows.serve.DEPLOYMENTS``): `lopd serve` runs them in one process and
`lopd deploy` registers the same set on a work pool, with lopd-cycle on the profile's schedule (the only
place a schedule is written). Here against the suite's real Prefect API."""

import importlib
import uuid
from datetime import timedelta

from prefect import Flow

from flows.serve import DEPLOYMENTS, REPO, deploy, deployments


def test_every_entrypoint_is_a_flow_and_serve_names_the_declared_set(models_dir):
    for name, (entrypoint, _) in DEPLOYMENTS.items():
        module, _, attr = entrypoint.partition(":")
        assert (REPO / module).is_file(), name
        assert isinstance(getattr(importlib.import_module(module.removesuffix(".py").replace("/", ".")), attr), Flow)
    served = deployments("smoke", [f"workspace.models_dir={models_dir}"])
    assert [d.name for d in served] == list(DEPLOYMENTS)
    assert {d.name: d.flow_name for d in served}["lopd-compare"] == "lopd-compare"


def test_deploy_registers_every_deployment_on_a_work_pool_with_the_profiles_schedule(models_dir, tmp_path):
    from prefect.client.orchestration import get_client

    pool = f"lopd-test-{uuid.uuid4().hex[:8]}"
    overrides = [f"workspace.models_dir={models_dir}", "cycle.schedule_interval_minutes=90"]
    ids = deploy("smoke", overrides, pool=pool, env={"LOPD_HOME": str(tmp_path)})
    assert len(ids) == len(DEPLOYMENTS)
    with get_client(sync_client=True) as client:
        assert client.read_work_pool(pool).type == "process"
        found = {d.name: d for d in (client.read_deployment(i) for i in ids)}
        assert sorted(found) == sorted(DEPLOYMENTS)
        for name, d in found.items():
            assert d.work_pool_name == pool and d.entrypoint == DEPLOYMENTS[name][0], name
            assert d.parameters == {"profile": "smoke", "overrides": overrides}
            assert d.job_variables["env"]["LOPD_HOME"] == str(tmp_path)
            assert d.pull_steps and str(REPO) in str(d.pull_steps), name  # a worker elsewhere finds the code
        schedules = found["lopd-cycle"].schedules
        assert len(schedules) == 1 and schedules[0].schedule.interval == timedelta(minutes=90)
        assert all(not d.schedules for n, d in found.items() if n != "lopd-cycle")
        assert found["lopd-cycle"].global_concurrency_limit is not None
