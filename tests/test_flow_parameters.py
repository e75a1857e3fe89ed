"""Deployment parameters cannot make a worker import a plug-in suite from anywhere.

A plug-in suite is Python imported into the process (``docs/plugin-suites.md``), so ``rollout.suite`` in a
deployment's ``overrides`` used to be code execution on the worker. In a deployment run (Prefect's
``PREFECT__RUNTIME__DEPLOYMENT__ID`` states it, as the runner's context does) the flows refuse a plug-in suite
outside ``rollout.suite_dirs`` of the profile file, before any stage runs; the suite below would leave a
marker file if its module were ever imported. The flow functions run as plain functions (``.fn``): the
check is the first thing they do, so no Prefect server is needed.
"""

from __future__ import annotations

import os
import shutil

import pytest

from lopd_core.config import ConfigError
from lopd_core.envs.plugin import EXAMPLE_SUITE
from lopd_core.envs.sandbox import ALLOW_UNCONTAINED_ENV


def _plugin(folder, marker):
    """A copy of the example plug-in suite whose module writes ``marker`` when it is imported."""
    shutil.copytree(EXAMPLE_SUITE.parent, folder)
    tools = folder / "tools.py"
    tools.write_text(tools.read_text() + f"\nimport pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n")
    return folder / "suite.yaml"


@pytest.fixture
def deployment(monkeypatch, tmp_path):
    monkeypatch.setenv("LOPD_HOME", str(tmp_path / "ws"))
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", "6f1c0a52-0000-4000-8000-000000000001")


def test_a_plugin_suite_is_code_that_runs_on_load(tmp_path):
    from lopd_core.envs import get_suite

    marker = tmp_path / "loaded"
    get_suite(str(_plugin(tmp_path / "demo_suite", marker)))
    assert marker.read_text() == "imported"  # why deployment parameters must not name one freely


def test_deployment_parameters_cannot_name_a_plugin_suite_outside_suite_dirs(deployment, tmp_path):
    from flows.compare import compare_flow
    from flows.cycle import cycle_flow
    from flows.evaluate import evaluate_flow
    from flows.stages import rollouts_flow

    marker = tmp_path / "imported"
    evil = _plugin(tmp_path / "evil", marker)
    attempts = [
        (lambda: cycle_flow.fn("smoke", [f"rollout.suite={evil}"], "c1"), "rollout.suite"),
        (lambda: rollouts_flow.fn("c1", "smoke", [f"rollout.suite={evil}"]), "rollout.suite"),
        (lambda: evaluate_flow.fn("smoke", [f"evaluate.probe_suite={evil}"]), "evaluate.probe_suite"),
        (lambda: compare_flow.fn(suite=str(evil), methods="none", budget=2, profile="smoke"), "suite"),
        (lambda: cycle_flow.fn("smoke", [f"rollout.suite_dirs=[{evil.parent}]", f"rollout.suite={evil}"], "c1"),
         "rollout.suite_dirs"),
        (lambda: cycle_flow.fn("smoke", [f"rollout={{suite: {evil}, suite_dirs: [{tmp_path}]}}"], "c1"),
         "rollout.suite_dirs"),
        (lambda: cycle_flow.fn("smoke", ["rollout.allow_uncontained_sandbox=true"], "c1"),
         "rollout.allow_uncontained_sandbox"),
    ]
    messages = []
    for attempt, field in attempts:
        with pytest.raises(ConfigError) as info:
            attempt()
        messages.append(str(info.value))
        assert messages[-1].startswith(f"{field}: "), messages[-1]
    assert "add its directory there, or run it with the CLI" in messages[0]
    assert "set it in the profile file on the worker" in messages[-2]
    assert "cannot turn it on" in messages[-1] and ALLOW_UNCONTAINED_ENV not in os.environ
    assert not marker.exists()  # nothing was imported
    assert not (tmp_path / "ws" / "runs" / "c1").exists()  # and no stage started


def test_a_profile_on_the_worker_allows_its_suite_directories_and_nothing_around_them(deployment, tmp_path):
    from flows.common import config

    marker = tmp_path / "imported"
    allowed = _plugin(tmp_path / "suites" / "library", marker)
    outside = _plugin(tmp_path / "elsewhere", marker)
    (tmp_path / "suites" / "link").symlink_to(tmp_path / "elsewhere")
    profile = tmp_path / "worker.yaml"
    profile.write_text(f"extends: smoke\nrollout:\n  suite_dirs: [{tmp_path / 'suites'}]\n")
    cfg = config(str(profile), [f"rollout.suite={allowed}"])
    assert cfg.rollout.suite == str(allowed)
    assert config(str(profile), ["rollout.suite=codegen", "evaluate.probe_suite=toolworld"]).rollout.suite == "codegen"
    for sneaky in (outside, tmp_path / "suites" / ".." / "elsewhere" / "suite.yaml",
                   tmp_path / "suites" / "link" / "suite.yaml"):
        with pytest.raises(ConfigError, match=r"rollout\.suite: .* not inside rollout\.suite_dirs"):
            config(str(profile), [f"rollout.suite={sneaky}"])
    assert not marker.exists()


def test_built_in_suites_and_the_cli_are_not_restricted(tmp_path, monkeypatch):
    from flows.common import config, deployment_run

    monkeypatch.setenv("LOPD_HOME", str(tmp_path / "ws"))
    monkeypatch.delenv("PREFECT__RUNTIME__DEPLOYMENT__ID", raising=False)
    assert not deployment_run()
    path = str(tmp_path / "anywhere" / "suite.yaml")
    assert config("smoke", [f"rollout.suite={path}"]).rollout.suite == path  # the user's own command
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", "6f1c0a52-0000-4000-8000-000000000001")
    assert deployment_run()
    for name in ("toolworld", "codegen", "humaneval", "bfcl"):
        assert config("smoke", [f"rollout.suite={name}"]).rollout.suite == name
