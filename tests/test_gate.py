"""Promotion integrity on a real MLflow sqlite store: the gate fails closed, compares with the champion of the
moment (re-evaluated when it moved: a resumed cycle, two cycles promoting at once in two processes), moves
@champion only by compare-and-set, never re-promotes a rolled-back pair without a recorded --force; one
champion record; registration that completes instead of repeating.

The only stand-in is the model evaluation of a champion that moved (`lopd_core.cycle._score_champion`): it
returns the score that version was registered with, so that the scores of the scenarios are known."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from lopd_core.config import ConfigError, load_config
from lopd_core.registry import (
    GATE_METRICS,
    ModelRegistry,
    PairVersion,
    PromotionRefused,
    decide_promotion,
    run_gate,
)


def summary(success, length=50.0, malformed=0.0, probe=0.5, forgetting=0.0):
    return {"eval/success_rate": success, "eval/mean_response_tokens": length, "eval/malformed_call_rate": malformed,
            "eval/probe_success_rate": probe, "eval/forgetting_delta": forgetting}


@pytest.fixture
def registry(tmp_path):
    return ModelRegistry(f"sqlite:///{tmp_path / 'mlflow.db'}", (tmp_path / "art").as_uri(), load_config("demo").registry)


def _pair(registry, tmp_path, name: str, score: float | None = None) -> PairVersion:
    dirs = []
    for role in ("s", "c"):
        d = tmp_path / f"{name}-{role}"
        d.mkdir()
        (d / "weights.txt").write_text(name)
        dirs.append(d)
    tags = {} if score is None else {"eval_summary": json.dumps(summary(score))}
    return registry.register_pair(*dirs, run_id=registry.cycle_run(name), cycle_id=name, tags=tags)


# --- the gate fails closed -----------------------------------------------------------------------------
@pytest.mark.parametrize("metric", GATE_METRICS)
@pytest.mark.parametrize("bad", [None, math.nan, math.inf, "0.9"])
@pytest.mark.parametrize("side", ["challenger", "champion"])
def test_missing_or_non_finite_metric_refuses_and_names_it(metric, bad, side):
    cfg = load_config("demo").registry
    challenger, champion = summary(0.9), summary(0.1)
    target = challenger if side == "challenger" else champion
    if bad is None:
        del target[metric]
    else:
        target[metric] = bad
    decision = decide_promotion(challenger, champion, cfg)
    assert not decision.promote
    assert metric in decision.summary() and side in decision.summary()
    assert decide_promotion(summary(0.9), summary(0.1), cfg).promote  # the same pair with clean metrics promotes


def test_gate_requires_what_the_evaluation_config_measures():
    from lopd_core.cycle import gate_metrics

    cfg = load_config("smoke")
    assert set(gate_metrics(cfg)) == set(GATE_METRICS)
    off = load_config("smoke", ["evaluate.probe_n_tasks=0", "evaluate.probe_prompts=0"])
    assert set(gate_metrics(off)) == {"eval/success_rate", "eval/mean_response_tokens", "eval/malformed_call_rate"}
    bare = {k: v for k, v in summary(0.9).items() if k in gate_metrics(off)}
    assert decide_promotion(bare, {k: v for k, v in summary(0.1).items() if k in gate_metrics(off)}, off.registry,
                            required=gate_metrics(off)).promote
    # not required, but measured for one side only: the two cannot be compared
    one_sided = decide_promotion(summary(0.9), {k: v for k, v in summary(0.1).items() if k in bare}, off.registry,
                                 required=gate_metrics(off))
    assert not one_sided.promote and "eval/probe_success_rate was measured for the challenger only" in one_sided.summary()
    # a missing length no longer counts as "no drift"
    no_length = {k: v for k, v in summary(0.9).items() if k != "eval/mean_response_tokens"}
    assert "eval/mean_response_tokens is missing for the challenger" in decide_promotion(
        no_length, summary(0.1), off.registry, required=gate_metrics(off)).summary()


def test_negative_margin_is_refused_by_the_config():
    with pytest.raises(ConfigError, match=r"registry\.gate_margin: Input should be greater than or equal to 0"):
        load_config("smoke", ["registry.gate_margin=-1"])
    with pytest.raises(ConfigError, match=r"registry\.gate_margin"):
        load_config("smoke", ["registry.gate_margin=nan"])
    with pytest.raises(ConfigError, match=r"registry\.stale_after_seconds .* registry\.heartbeat_seconds"):
        load_config("smoke", ["registry.heartbeat_seconds=60", "registry.stale_after_seconds=90"])
    assert load_config("smoke", ["registry.gate_margin=0"]).registry.gate_margin == 0


# --- compare-and-set, rollback, force --------------------------------------------------------------------
def test_rolled_back_pair_is_not_promoted_again_without_a_recorded_force(registry, tmp_path):
    base = registry.bootstrap_base("tiny", config_hash="abc", base_path=tmp_path)
    good = _pair(registry, tmp_path, "good")
    outcome = run_gate(registry, good, summary(0.5), lambda champion: summary(0.25))
    assert outcome.promoted and registry.champion().student == good.student
    old, new = registry.rollback(flow_run_id="operator-run")
    assert (old.student, new.student) == (good.student, base.student)
    tags = registry.version_tags("student", good.student)
    assert tags["rolled_back"] == "true" and tags["rolled_back_by"] == "operator-run"

    # the scheduled promote that used to undo the rollback
    refused = run_gate(registry, good, summary(0.5), lambda champion: summary(0.25))
    assert not refused.promoted and "rolled back" in refused.decision.summary() and "--force" in refused.decision.summary()
    with pytest.raises(PromotionRefused, match="--force"):
        registry.promote(good)
    assert registry.champion().student == base.student

    forced = run_gate(registry, good, summary(0.5), lambda champion: summary(0.25), force=True, flow_run_id="op-2")
    assert forced.promoted and forced.decision.summary().startswith("PROMOTE: --force")
    tags = registry.version_tags("student", good.student)
    assert tags["rolled_back"] == "false" and "--force" in tags["forced"] and "op-2" in tags["forced"]
    assert registry.version_tags("composer", good.composer)["forced"] == tags["forced"]
    # force lifts the rollback bar only: a worse rolled-back pair still fails the gate
    registry.rollback()
    assert not run_gate(registry, good, summary(0.1), lambda champion: summary(0.25), force=True).promoted


def test_decision_is_remade_when_the_champion_moves_during_it(registry, tmp_path):
    registry.bootstrap_base("tiny", config_hash="abc", base_path=tmp_path)
    strong, weak = _pair(registry, tmp_path, "strong", 0.6), _pair(registry, tmp_path, "weak", 0.2)
    scored = []

    def champion_metrics(champion):
        scored.append(champion.student)
        if len(scored) == 1:  # while the gate scores the base, another process promotes the strong pair
            registry.promote(strong)
            return summary(0.1)
        return json.loads(registry.version_tags("student", champion.student)["eval_summary"])

    outcome = run_gate(registry, weak, summary(0.2), champion_metrics)
    assert scored == ["1", strong.student] and outcome.attempts == 2
    assert not outcome.promoted and "vs champion 0.600" in outcome.decision.summary()
    assert registry.champion().student == strong.student
    with pytest.raises(PromotionRefused, match="moved"):
        registry.promote(weak, expected_champion="1")


# --- one champion record; registration -------------------------------------------------------------------
def test_champion_pair_is_one_record_and_a_lagging_mirror_is_flagged_and_repaired(registry, tmp_path, smoke_config):
    from lopd_core.status import workspace_status
    from lopd_core.workspace import Workspace

    registry.bootstrap_base("tiny", config_hash="abc", base_path=tmp_path)
    a = _pair(registry, tmp_path, "a")
    registry.client.create_model_version(registry.cfg.composer_model, source=(tmp_path / "a-c").as_uri())  # skew
    b = _pair(registry, tmp_path, "b")
    assert (b.student, b.composer) == ("3", "4")
    registry.promote(a)
    # a crash between the two alias writes of the old code: the student moved, the composer did not
    registry.client.set_registered_model_alias(registry.cfg.student_model, "champion", b.student)
    champion = registry.champion()
    assert (champion.student, champion.composer) == (b.student, b.composer)  # still one registered pair
    problems = registry.alias_mismatches()
    assert len(problems) == 1 and f"paired with composer v{b.composer}" in problems[0]

    ws = Workspace.from_config(smoke_config.workspace)
    ws.home.mkdir(parents=True)
    (ws.home / "mlflow.db").symlink_to(tmp_path / "mlflow.db")
    status = workspace_status(smoke_config, ws)
    assert status["registry"]["champion_pair"].startswith("MISMATCH")
    assert registry.repair_aliases() == [f"@champion: composer v{a.composer} -> v{b.composer}"]
    assert registry.alias_mismatches() == []


def test_interrupted_registration_is_completed_not_repeated(registry, tmp_path):
    registry.bootstrap_base("tiny", config_hash="abc", base_path=tmp_path)
    run_id = registry.cycle_run("c1")
    s, c = tmp_path / "s", tmp_path / "c"
    for d in (s, c):
        d.mkdir()
        (d / "weights.txt").write_text(d.name)
    (c / "adapter.bin").symlink_to(tmp_path / "gone")  # the composer's files vanish mid-copy
    with pytest.raises(FileNotFoundError):
        registry.register_pair(s, c, run_id=run_id, cycle_id="c1", tags={"eval_summary": "{}"})
    assert [v["version"] for v in registry.versions("student")] == ["1", "2"]
    assert [v["version"] for v in registry.versions("composer")] == ["1"]
    assert registry.pair_for_cycle("c1") is None

    (c / "adapter.bin").unlink()
    pair = registry.register_pair(s, c, run_id=run_id, cycle_id="c1", tags={"eval_summary": "{}"})
    assert (pair.student, pair.composer) == ("2", "2")  # the half was completed, no orphan
    assert registry.register_pair(s, c, run_id=run_id, cycle_id="c1", tags={}).student == "2"
    nxt = _pair(registry, tmp_path, "c2")
    assert (nxt.student, nxt.composer) == ("3", "3")  # the version numbers stay in step
    assert len(registry.versions("student")) == len(registry.versions("composer")) == 3
    assert registry.version_tags("student", "2")["paired_with"] == "2"


# --- the promote stage: a stale or resumed cycle ----------------------------------------------------------
def _evaluated_cycle(cfg, tmp_path, cycle_id: str, challenger: float, champion_student: str, champion: float):
    """A cycle whose distill and evaluate stages are recorded (as a resumed or concurrent cycle has them)."""
    from lopd_core.cycle import CycleContext

    ctx = CycleContext(cfg, cycle_id)
    dirs = {}
    for role in ("student", "composer"):
        d = tmp_path / f"{cycle_id}-{role}"
        d.mkdir()
        (d / "weights.txt").write_text(cycle_id)
        dirs[role] = str(d)
    ctx.record.stages["distill"] = {"student_dir": dirs["student"], "composer_dir": dirs["composer"],
                                    "experiences_version": 1, "steps": 1}
    ctx.record.stages["evaluate"] = {"challenger": summary(challenger), "champion": summary(champion),
                                     "champion_student": champion_student, "champion_composer": champion_student}
    ctx.record.save(ctx.record_path)


def registered_score(ctx, champion):
    """Stand-in for evaluating a champion again: the score its cycle recorded (the base scores 0.1)."""
    tags = ctx.registry.version_tags("student", champion.student)
    return json.loads(tags["eval_summary"]) if "eval_summary" in tags else summary(0.1)


def test_resumed_cycle_compares_with_the_champion_of_now(smoke_config, tmp_path, monkeypatch):
    import lopd_core.cycle as cycle

    monkeypatch.setattr(cycle, "_score_champion", registered_score)
    cfg = smoke_config.with_overrides({"registry.gate_margin": 0.01})
    # both cycles were evaluated against the base (v1, 0.1); "slow" stopped before its promote stage
    _evaluated_cycle(cfg, tmp_path, "strong", 0.6, "1", 0.1)
    _evaluated_cycle(cfg, tmp_path, "slow", 0.2, "1", 0.1)
    first = cycle.run_stage(cfg, "strong", "promote")
    assert first["promoted"] and first["champion_after"] == first["student_version"]

    resumed = cycle.run_stage(cfg, "slow", "promote")
    assert not resumed["promoted"], resumed["decision"]
    assert "held-out success 0.200 vs champion 0.600" in resumed["decision"]  # not "vs 0.100" from the record
    assert resumed["champion_before"] == first["student_version"] and resumed["champion_evaluated"] == "1"
    assert set(resumed["champion_rescored"]) == {first["student_version"]}
    assert resumed["champion_after"] == first["student_version"]
    report = (cycle.CycleContext(cfg, "slow").dir / "report.md").read_text()
    assert "@champion moved after the evaluate stage" in report
    record = json.loads((cycle.CycleContext(cfg, "slow").record_path).read_text())
    assert record["state"] == "completed" and record["owner"]["stage"] == "promote"
    # the challenger alias still names the latest registered pair, and its decision is on it
    reg = cycle.CycleContext(cfg, "slow").registry
    assert reg.challenger().student == resumed["student_version"]
    assert reg.version_tags("student", resumed["student_version"])["gate"].startswith("KEEP CHAMPION")


_CYCLE_PROMOTE = """
import json, sys, time
from pathlib import Path
import data_contracts  # noqa: F401  (imported before the start signal, as the stage will need it)
import lopd_core.cycle as cycle
from lopd_core.config import load_config

def registered_score(ctx, champion):
    tags = ctx.registry.version_tags("student", champion.student)
    return json.loads(tags["eval_summary"])

cycle._score_champion = registered_score
cfg = load_config("smoke", json.loads(sys.argv[1]))
go = Path(sys.argv[3])
print("ready", flush=True)
while not go.exists():
    time.sleep(0.005)
print(json.dumps(cycle.run_stage(cfg, sys.argv[2], "promote")), flush=True)
"""


def test_two_cycles_promoting_at_once_never_leave_the_worse_one_champion(tmp_path, models_dir):
    overrides = [f"workspace.home={tmp_path / 'ws'}", f"workspace.models_dir={models_dir}", "registry.gate_margin=0.01"]
    cfg = load_config("smoke", overrides)
    from lopd_core.cycle import CycleContext

    setup = CycleContext(cfg, "setup")
    base, base_reg = setup.champion(), setup.registry
    base_reg.set_version_tag("student", base.student, "eval_summary", json.dumps(summary(0.1)))
    # both evaluated against the base (0.1): the strong challenger scores 0.6, the weak one 0.2
    _evaluated_cycle(cfg, tmp_path, "strong", 0.6, base.student, 0.1)
    _evaluated_cycle(cfg, tmp_path, "weak", 0.2, base.student, 0.1)
    go = tmp_path / "go"
    procs = {}
    for cycle_id in ("strong", "weak"):
        procs[cycle_id] = subprocess.Popen([sys.executable, "-c", _CYCLE_PROMOTE, json.dumps(overrides), cycle_id,
                                            str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for p in procs.values():
        assert p.stdout.readline().strip() == "ready", p.stderr.read()[-3000:]
    go.touch()  # both start their promote stage at the same moment
    results = {}
    for cycle_id, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results[cycle_id] = json.loads(out.strip().splitlines()[-1])
    strong, weak = results["strong"], results["weak"]
    champion = base_reg.champion()
    print({k: (r["promoted"], r["champion_before"], r["gate_attempts"], r["decision"]) for k, r in results.items()})
    assert champion.student == strong["student_version"] and strong["promoted"]
    if weak["promoted"]:  # it went first and beat the base; the strong one then beat it
        assert strong["champion_before"] == weak["student_version"] and "vs champion 0.200" in strong["decision"]
    else:  # it compared with the strong champion, not with the base it was evaluated against
        assert "held-out success 0.200 vs champion 0.600" in weak["decision"]
    assert champion.composer == base_reg.version_tags("student", champion.student)["paired_with"]
