"""The MLflow registry on a real sqlite store: pairs, aliases, the gate, rollback."""

import pytest

from lopd_core.config import load_config
from lopd_core.registry import ModelRegistry, decide_promotion


@pytest.fixture
def registry(tmp_path):
    cfg = load_config("smoke").registry
    return ModelRegistry(f"sqlite:///{tmp_path / 'mlflow.db'}", (tmp_path / "art").as_uri(), cfg)


def _dirs(tmp_path, name):
    s, c = tmp_path / f"{name}-s", tmp_path / f"{name}-c"
    for d in (s, c):
        d.mkdir()
        (d / "weights.txt").write_text(name)
    return s, c


def _summary(success, length=50.0, malformed=0.0, probe=0.5, forgetting=0.0):
    return {"eval/success_rate": success, "eval/mean_response_tokens": length, "eval/malformed_call_rate": malformed,
            "eval/probe_success_rate": probe, "eval/forgetting_delta": forgetting}


def test_bootstrap_registers_base_as_v1_champion(registry, tmp_path):
    pair = registry.bootstrap_base("tiny", config_hash="abc", base_path=tmp_path)
    assert (pair.student, pair.composer) == ("1", "1")
    assert registry.champion().student == "1" and registry.champion().is_base
    assert registry.bootstrap_base("tiny", config_hash="abc", base_path=tmp_path).student == "1"  # idempotent


def test_register_is_idempotent_on_cycle_id_and_tags_pairs(registry, tmp_path):
    registry.bootstrap_base("tiny", config_hash="abc", base_path=tmp_path)
    run = registry.cycle_run("c1")
    assert registry.cycle_run("c1") == run
    s, c = _dirs(tmp_path, "c1")
    pair = registry.register_pair(s, c, run_id=run, cycle_id="c1", tags={"experience_table_version": 3})
    again = registry.register_pair(s, c, run_id=run, cycle_id="c1", tags={})
    assert (pair.student, pair.composer) == (again.student, again.composer) == ("2", "2")
    assert pair.tags["paired_version"] == "2" and pair.tags["experience_table_version"] == "3"
    assert (registry.download("student", pair.student) / "weights.txt").read_text() == "c1"


def test_gate_refuses_worse_challenger_and_rollback_restores(registry, tmp_path):
    cfg = load_config("demo").registry
    base = registry.bootstrap_base("tiny", config_hash="abc", base_path=tmp_path)
    good = registry.register_pair(*_dirs(tmp_path, "good"), run_id=registry.cycle_run("c1"), cycle_id="c1", tags={})
    decision = decide_promotion(_summary(0.5), _summary(0.25), cfg)
    assert decision.promote
    registry.promote(good, decision=decision)
    assert registry.champion().student == good.student

    worse = registry.register_pair(*_dirs(tmp_path, "worse"), run_id=registry.cycle_run("c2"), cycle_id="c2", tags={})
    registry.set_challenger(worse)
    refused = decide_promotion(_summary(0.3), _summary(0.5), cfg)
    assert not refused.promote and "gain -0.200" in refused.summary()
    assert registry.champion().student == good.student and registry.challenger().student == worse.student

    old, new = registry.rollback()
    assert old.student == good.student and new.student == base.student
    with pytest.raises(RuntimeError, match="nothing to roll back"):
        registry.rollback()


def test_gate_blocks_drift_and_forgetting():
    cfg = load_config("demo").registry
    assert not decide_promotion(_summary(0.9, length=200), _summary(0.2, length=50), cfg).promote
    assert not decide_promotion(_summary(0.9, malformed=0.5), _summary(0.2), cfg).promote
    forgetful = {**_summary(0.9), "eval/probe_success_rate": 0.1}
    assert not decide_promotion(forgetful, {**_summary(0.2), "eval/probe_success_rate": 0.6}, cfg).promote
    assert not decide_promotion(_summary(0.25), _summary(0.25), cfg).promote  # a tie keeps the champion
