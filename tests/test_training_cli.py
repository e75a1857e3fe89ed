"""`lopd distill` through the real entry point (a subprocess), on the smoke profile's tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def lopd(*args, home, models_dir):
    env = {**os.environ, "LOPD_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "lopd_cli", *args, "--set", f"workspace.models_dir={models_dir}"],
                          capture_output=True, text=True, env=env, timeout=600)


def test_distill_grpo_one_step_json(tmp_path, models_dir):
    res = lopd("distill", "--profile", "smoke", "--method", "grpo", "--steps", "1", "--json",
               home=tmp_path, models_dir=models_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["method"] == "grpo" and summary["last_step"] == 0
    assert summary["retriever"].startswith("in-memory")  # no LanceDB experiences in a fresh workspace
    assert summary["budget"]["episodes"] == 2 and summary["budget"]["pretraining_episodes"] == 4
    assert (tmp_path / "checkpoints" / "grpo-smoke" / "step_000000" / "manifest.json").exists()
    rows = [json.loads(line) for line in open(summary["metrics_path"])]
    assert rows[0]["step"] == 0 and "rollout/success_rate" in rows[0]
    if rows[0]["distill/updated"]:  # GRPO steps only when some group's rewards differ
        assert "distill/student_grad_norm" in rows[0]
    else:
        assert rows[0]["grpo/zero_advantage_rate"] == 1.0
    # the run is tracked in MLflow: params to group by, the step's metrics, ended FINISHED
    run = _registry(tmp_path).client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.experiment_id != "0"
    assert run.data.params["method"] == "grpo" and run.data.params["steps"] == "1"
    assert run.data.tags["lopd.distill_run"] == "grpo-smoke"
    assert run.data.metrics["rollout/success_rate"] == rows[0]["rollout/success_rate"]
    # a second call resumes: nothing left to do, the same final artifacts, the same MLflow run
    again = lopd("distill", "--profile", "smoke", "--method", "grpo", "--steps", "1", "--json",
                 home=tmp_path, models_dir=models_dir)
    assert again.returncode == 0
    again_summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert again_summary["resumed"] is True and again_summary["mlflow_run_id"] == summary["mlflow_run_id"]


def _registry(home):
    from lopd_core.config import load_config
    from lopd_core.registry import ModelRegistry

    return ModelRegistry(f"sqlite:///{home / 'mlflow.db'}", (home / "mlartifacts").as_uri(), load_config("smoke").registry)


def test_a_distill_run_that_fails_leaves_its_mlflow_run_failed(tmp_path, models_dir):
    empty = tmp_path / "not-a-student"
    empty.mkdir()
    res = lopd("distill", "--profile", "smoke", "--method", "grpo", "--steps", "1", "--run", "broken",
               "--student-init", str(empty), home=tmp_path, models_dir=models_dir)
    assert res.returncode != 0
    registry = _registry(tmp_path)
    run = registry.find_run("lopd.distill_run", "broken", registry.experiment_for("lopd-distill"))
    assert run is not None and run.info.status == "FAILED"
    assert "not-a-student" in run.data.tags["lopd.failed"] or "Error" in run.data.tags["lopd.failed"]


def test_cold_start_without_successes_fails_with_the_fix(tmp_path, models_dir):
    # the smoke profile counts every finished episode as a success (threshold 0); the real threshold finds none
    res = lopd("distill", "--profile", "smoke", "--cold-start", "--steps", "1", "--set",
               "curation.success_threshold_tool=0.8", home=tmp_path, models_dir=models_dir)
    assert res.returncode == 1
    message = " ".join(res.stderr.split())  # the console wraps long lines
    assert "cold start" in message and "raise rollout.n_tasks or lower rollout.level" in message


def test_distill_cold_start_then_lopd_on_the_lancedb_store(tmp_path, models_dir, tiny_tokenizer):
    """The store path: seed trajectories (oracle plays, scored by the real verifier) → curate → index → the CLI."""
    from lopd_core.config import load_config
    from lopd_core.envs import get_suite
    from lopd_core.memory.curation import curate_store
    from lopd_core.memory.indexing import index_store
    from lopd_core.memory.store import ExperienceStore
    from lopd_core.rollout.oracle import oracle_episode

    home = tmp_path / "ws"
    cfg = load_config("smoke").with_overrides({"workspace.home": str(home), "workspace.models_dir": str(models_dir)})
    suite = get_suite("toolworld")
    seeds = [oracle_episode(tiny_tokenizer, suite, t) for t in suite.tasks("train", 6, level=1, seed=321)]
    for i, t in enumerate(seeds):
        t.cycle_id, t.trajectory_id = "seed", f"seed-{i}"
    store = ExperienceStore.from_config(cfg)
    store.write_trajectories(seeds, cycle_id="seed")
    curate_store(store, cfg)
    index_store(store)
    version = store.version("experiences")
    res = lopd("distill", "--profile", "smoke", "--cold-start", "--steps", "1", "--json", "--set",
               "distill.lopd.retrieval_family=any", home=home, models_dir=models_dir)  # 6 tasks, most of their own family
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["retriever"] == "lancedb" and summary["table_version"] == version
    assert summary["cold_start"]["examples"] == len(seeds) and summary["composer_dir"]
    assert summary["metrics"]["memory/hit_rate"] == 1.0 and summary["metrics"]["distill/updated"] == 1.0
