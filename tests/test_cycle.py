"""The continual-learning cycle for real: `lopd cycle` subprocesses (ephemeral Prefect, LanceDB, MLflow) on
the smoke profile (tiny model), consecutive cycles, re-runs, a crash mid-distillation (SIGKILL: reaped and
resumed), injected bad rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from workspace_procs import workspace_processes

pytestmark = pytest.mark.filterwarnings("ignore")


def lopd(home: Path, models_dir: Path, *args: str, check: bool = True, **popen) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOPD_HOME": str(home)}
    cmd = [sys.executable, "-m", "lopd_cli", *args, "--profile", "smoke",
           "--set", f"workspace.models_dir={models_dir}"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, **popen)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return res


def last_json(res: subprocess.CompletedProcess) -> dict:
    return json.loads(res.stdout.strip().splitlines()[-1])


def store(home: Path):
    from lopd_core.memory.store import ExperienceStore

    return ExperienceStore(str(home / "lance"))


def registry(home: Path):
    from lopd_core.config import load_config
    from lopd_core.registry import ModelRegistry

    return ModelRegistry(f"sqlite:///{home / 'mlflow.db'}", (home / "mlartifacts").as_uri(), load_config("smoke").registry)


@pytest.fixture(scope="module")
def two_cycles(tmp_path_factory, models_dir):
    home = tmp_path_factory.mktemp("ws")
    first = last_json(lopd(home, models_dir, "cycle", "--cycle-id", "c1", "--json"))
    versions_after_first = {t: store(home).version(t) for t in ("trajectories", "experiences")}
    second = last_json(lopd(home, models_dir, "cycle", "--cycle-id", "c2", "--json"))
    return home, first, second, versions_after_first


def test_second_cycle_builds_on_the_first_champion(two_cycles):
    home, first, second, _ = two_cycles
    assert first["state"] == second["state"] == "completed"
    assert first["champion"] == "2"  # smoke's gate (margin 0) promotes a tie; v1 is the base
    rec = json.loads((home / "runs" / "c2" / "cycle.json").read_text())
    assert rec["stages"]["rollouts"]["champion_student"] == first["champion"]
    rows = store(home).read("trajectories", where="cycle_id = 'c2'", columns=["trajectory_id", "policy_version"])
    seed = rows[rows["trajectory_id"].str.startswith("c2/rollouts/")]
    assert set(seed["policy_version"]) == {f"student-v{first['champion']}"}


def test_table_versions_advance_and_rows_are_not_duplicated(two_cycles):
    home, first, second, before = two_cycles
    s = store(home)
    assert s.version("trajectories") > before["trajectories"]
    assert second["experiences_version"] > first["experiences_version"]
    ids = s.read("trajectories", columns=["trajectory_id"])["trajectory_id"]
    # per cycle: 4 seed rollouts + 2 steps x 2 training episodes
    assert len(ids) == ids.nunique() == 2 * (4 + 2 * 2)
    assert s.count("quarantine") == 0  # well-formed cycles quarantine nothing
    # the index stage keeps the versions registered models were trained on (index.keep_versions_days)
    rec = json.loads((home / "runs" / "c2" / "cycle.json").read_text())["stages"]["index"]["versions"]
    assert {first["experiences_version"], second["experiences_version"]} <= set(rec["experiences"]["pinned"])
    tags = s.db.open_table("experiences").tags.list()
    assert tags[f"pinned-v{first['experiences_version']}"]["version"] == first["experiences_version"]
    assert s.count("experiences", version=first["experiences_version"]) > 0


def test_rerunning_a_finished_cycle_changes_nothing(two_cycles, models_dir):
    home, first, _, _ = two_cycles
    s, reg = store(home), registry(home)
    tables = {t: (s.version(t), s.count(t)) for t in ("trajectories", "curated", "experiences", "evaluations")}
    model_versions = (len(reg.versions("student")), len(reg.versions("composer")))
    again = last_json(lopd(home, models_dir, "cycle", "--cycle-id", "c1", "--json"))
    assert {k: v for k, v in again.items() if k != "wall_s"} == {k: v for k, v in first.items() if k != "wall_s"}
    assert {t: (s.version(t), s.count(t)) for t in tables} == tables
    assert (len(reg.versions("student")), len(reg.versions("composer"))) == model_versions


def test_pairs_carry_lineage_tags_and_rollback_restores(two_cycles, models_dir):
    home, first, second, _ = two_cycles
    reg = registry(home)
    v = {r["version"]: r for r in reg.versions("student")}[second["student_version"]]
    for tag in ("paired_version", "experience_table_version", "data_contract_version", "config_hash",
                "eval_run_id", "flow_run_id", "base_model"):
        assert v["tags"].get(tag), tag
    assert v["tags"]["base_model"] == "tiny" and v["tags"]["experience_table_version"] == str(second["experiences_version"])
    out = last_json(lopd(home, models_dir, "rollback", "--json"))
    assert out["champion"]["student"] == first["champion"] and out["rolled_back"]["student"] == second["champion"]
    assert reg.champion().student == first["champion"]
    # the next (scheduled) promote does not undo the operator's rollback: @challenger is the rolled-back pair
    again = last_json(lopd(home, models_dir, "promote", "--json"))
    assert not again["promoted"] and "rolled back" in again["decision"] and "--force" in again["decision"]
    assert reg.champion().student == first["champion"]
    from lopd_core.config import load_config
    from lopd_core.operations import promote_challenger

    cfg = load_config("smoke", {"workspace.home": str(home), "workspace.models_dir": str(models_dir)})
    forced = promote_challenger(cfg, force=True, flow_run_id="operator")
    assert forced["promoted"] and forced["forced"] and reg.champion().student == second["champion"]
    assert "operator" in reg.version_tags("student", second["champion"])["forced"]


def test_forced_champion_is_a_model_mlflow_loads_and_lopd_exports(two_cycles, models_dir, tmp_path):
    """The deployable student: a trained pair promoted explicitly (`lopd promote --force`, recorded as forced)
    answers a chat request through `mlflow.pyfunc.load_model("models:/lopd-student@champion")`, offline; the
    base (v1) loads the same way; `lopd export` writes a folder transformers loads, that answers the same."""
    import mlflow
    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lopd_core.models.loading import resolve_model_path
    from lopd_core.records.chat import end_of_turn_ids

    home, first, second, _ = two_cycles
    trained = second["student_version"]
    lopd(home, models_dir, "rollback", "--json")  # @champion leaves the trained pair, which is now rolled back
    forced = last_json(lopd(home, models_dir, "promote", "--force", "--json"))
    reg = registry(home)
    assert forced["promoted"] and forced["forced"] and reg.champion().student == trained
    assert "--force" in reg.version_tags("student", trained)["forced"]

    request = {"messages": [{"role": "user", "content": "Which city is the capital of France?"}],
               "temperature": 0.0, "max_tokens": 8}
    mlflow.set_registry_uri(f"sqlite:///{home / 'mlflow.db'}")
    mlflow.set_tracking_uri(f"sqlite:///{home / 'mlflow.db'}")
    answers = {}
    for uri in ("models:/lopd-student@champion", "models:/lopd-student/1"):
        model = mlflow.pyfunc.load_model(uri)
        assert model.metadata.metadata["task"] == "llm/v1/chat" and model.metadata.signature is not None
        reply = model.predict(request)
        assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["role"] == "assistant"
        assert reply["usage"]["completion_tokens"] >= 1
        answers[uri] = reply["choices"][0]["message"]["content"]
    assert len(mlflow.MlflowClient().search_logged_models([reg.experiment_id])) == len(reg.versions("student"))

    adapter = reg.download("student", trained)  # a standard peft folder whose base is a real folder
    assert (Path(json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"])
            / "config.json").exists()
    AutoPeftModelForCausalLM.from_pretrained(str(adapter))

    out = tmp_path / "export"
    exported = last_json(lopd(home, models_dir, "export", "--version", "champion", "--out", str(out), "--json"))
    assert exported["student_version"] == trained
    merged, tokenizer = AutoModelForCausalLM.from_pretrained(str(out)), AutoTokenizer.from_pretrained(str(out))
    base = AutoModelForCausalLM.from_pretrained(str(resolve_model_path("tiny", models_dir)))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[name], base.state_dict()[name])  # the trained deltas are in it
    prompt = tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    ids = merged.generate(**prompt, max_new_tokens=8, do_sample=False, eos_token_id=end_of_turn_ids(tokenizer),
                          pad_token_id=tokenizer.pad_token_id)[0, prompt["input_ids"].shape[1]:]
    ids = [t for t in ids.tolist() if t not in end_of_turn_ids(tokenizer)]
    assert tokenizer.decode(ids, skip_special_tokens=True) == answers["models:/lopd-student@champion"]


def _kill_orphans(home: Path) -> None:
    """A crash test must not leave the host with stray processes, even when its assertion failed."""
    for pid in workspace_processes(home):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_crash_in_distillation_resumes_from_checkpoint(tmp_path, models_dir):
    home = tmp_path / "ws"
    args = [sys.executable, "-m", "lopd_cli", "cycle", "--profile", "smoke", "--cycle-id", "k1",
            "--set", f"workspace.models_dir={models_dir}", "--set", "distill.steps=4"]
    env = {**os.environ, "LOPD_HOME": str(home)}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ckpt_root = home / "checkpoints" / "cycle-k1"
    deadline = time.time() + 600
    while time.time() < deadline and not list(ckpt_root.glob("step_000001")):
        assert proc.poll() is None, "the cycle ended before it could be interrupted"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)  # the main process only: what it started must die with it
    proc.wait()
    try:
        deadline = time.time() + 20
        while workspace_processes(home) and time.time() < deadline:
            time.sleep(0.2)
        assert not workspace_processes(home), "the temporary Prefect server (or another child) outlived the killed cycle"
    finally:
        _kill_orphans(home)
    rec = json.loads((home / "runs" / "k1" / "cycle.json").read_text())
    assert "distill" not in rec["stages"] and "index" in rec["stages"]
    assert rec["state"] == "running" and rec["owner"]["pid"] == str(proc.pid) and rec["owner"]["stage"] == "distill"
    killed_flow_run = rec["owner"]["flow_run_id"]

    summary = last_json(lopd(home, models_dir, "cycle", "--cycle-id", "k1", "--json", "--set", "distill.steps=4"))
    assert summary["state"] == "completed" and summary["distill_steps"] == 4
    rec = json.loads((home / "runs" / "k1" / "cycle.json").read_text())
    assert rec["stages"]["distill"]["resumed"] is True
    ids = store(home).read("trajectories", columns=["trajectory_id"])["trajectory_id"]
    distill_ids = sorted(i for i in ids if i.startswith("k1/distill/"))
    assert distill_ids == sorted(f"k1/distill/{s:04d}/{i:04d}" for s in range(4) for i in range(2))
    assert len(ids) == ids.nunique()
    # the resumed cycle's reaper marked the killed attempt: its MLflow run (reopened, now finished) says why,
    # and its Prefect flow run is Crashed
    run = registry(home).client.get_run(rec["stages"]["promote"]["mlflow_run_id"])
    assert run.info.status == "FINISHED" and f"process {proc.pid}" in run.data.tags["lopd.crashed"]
    import sqlite3

    with sqlite3.connect(home / "prefect" / "prefect.db") as con:
        state = con.execute("SELECT state_type FROM flow_run WHERE id = ?", (killed_flow_run,)).fetchone()[0]
    assert state == "CRASHED"


def test_malformed_rows_are_quarantined_and_the_cycle_completes(tmp_path, models_dir, monkeypatch):
    """Fault injection: the rollout producer hands the real stage two broken trajectories."""
    from dataclasses import replace

    import lopd_core.cycle as cycle
    from lopd_core.config import load_config

    monkeypatch.setenv("LOPD_HOME", str(tmp_path / "ws"))
    overrides = [f"workspace.models_dir={models_dir}", "rollout.n_tasks=6", "curation.max_bad_row_fraction=0.5"]
    cfg = load_config("smoke", overrides)
    from lopd_core.workspace import Workspace

    for k, v in Workspace.from_config(cfg.workspace).ensure().prefect_env().items():
        monkeypatch.setenv(k, v)
    real = cycle.seed_episodes

    def corrupting(*args, **kwargs):
        out = real(*args, **kwargs)
        if len(out) == 6:  # the rollouts stage's 6 episodes
            out[0] = replace(out[0], reward=1.7)
            out[1] = replace(out[1], assistant_mask=out[1].assistant_mask[:-3])
        return out

    monkeypatch.setattr(cycle, "seed_episodes", corrupting)  # what the rollouts stage calls
    from flows.cycle import cycle_flow

    result = cycle_flow("smoke", overrides, "q1")
    assert result["cycle_id"] == "q1"
    s = store(tmp_path / "ws")
    quarantine = s.read("quarantine")
    bad = quarantine[quarantine["row_key"].isin(["q1/rollouts/0000", "q1/rollouts/0001"])]
    assert len(bad) == 2
    reasons = " ".join(bad["reason"].tolist())
    assert "reward" in reasons and "mask_length_matches_token_ids" in reasons
    assert s.count("trajectories", where="trajectory_id = 'q1/rollouts/0000'") == 0
    assert s.count("trajectories", where="trajectory_id LIKE 'q1/rollouts/%'") == 4
