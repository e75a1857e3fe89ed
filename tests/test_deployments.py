"""The deployment declarations match the flows: `infra/prefect.yaml` and `lopd serve` name the same set, and
every entrypoint imports to a Prefect flow."""

import importlib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_work_pool_file_and_serve_declare_the_same_flows(models_dir):
    from prefect import Flow

    from flows.serve import deployments

    declared = yaml.safe_load((ROOT / "infra" / "prefect.yaml").read_text())["deployments"]
    for d in declared:
        module, _, name = d["entrypoint"].partition(":")
        obj = getattr(importlib.import_module(module.removesuffix(".py").replace("/", ".")), name)
        assert isinstance(obj, Flow), d["entrypoint"]
    served = deployments("smoke", [f"workspace.models_dir={models_dir}"])
    assert sorted(d.name for d in served) == sorted(d["name"] for d in declared)
    assert {d.name: d.flow_name for d in served}["lopd-compare"] == "lopd-compare"
