"""The training driver end to end on the tiny model: real toolworld tasks, the real agent loop and hf engine.

The tiny random model never solves a task, so the experience bank and the cold-start targets are built by
playing each task's scripted oracle through the real environment (:func:`lopd_core.rollout.oracle.oracle_episode`;
its verifier gives the reward).
"""

from __future__ import annotations

import pytest

from lopd_core.algorithms.synthetic import experience_of
from lopd_core.checkpoint import list_checkpoints, read_checkpoint
from lopd_core.config import load_config
from lopd_core.envs import get_suite
from lopd_core.memory.in_memory import InMemoryRetriever
from lopd_core.metrics import JsonlLogger
from lopd_core.recipe import HeldOutCurve
from lopd_core.records.experience import Bank
from lopd_core.rollout.oracle import oracle_episode
from lopd_core.training import cold_start, train


@pytest.fixture
def bank(tiny_tokenizer):
    suite = get_suite("toolworld")
    tasks = suite.tasks("train", 6, level=1, seed=123)
    trajectories = [oracle_episode(tiny_tokenizer, suite, t) for t in tasks]
    assert all(t.success for t in trajectories), [t.reward for t in trajectories]
    return suite, trajectories, InMemoryRetriever([experience_of(t) for t in trajectories])


def pinned(retriever, trajectories, version: int | None = 7) -> Bank:
    """The oracle bank as a training run sees it, "pinned" at a table version (the in-memory one has none)."""
    return Bank(retriever=retriever, successes=trajectories, version=version, episodes=6, source="in-memory")


def smoke(tmp_path, models_dir, **overrides):
    """The smoke profile; retrieval across families, since the oracle bank holds one task of most families."""
    return load_config("smoke").with_overrides({"workspace.home": str(tmp_path / "ws"),
                                                "workspace.models_dir": str(models_dir), "rollout.max_turns": 1,
                                                "rollout.max_new_tokens": 12, "distill.lopd.retrieval_family": "any",
                                                **overrides})


KEYS = ("distill/kl_topk", "distill/composer_kl", "distill/privilege_delta", "distill/beta", "distill/anchor",
        "rollout/mean_tokens")


def test_lopd_resume_equals_an_uninterrupted_run(tmp_path, models_dir, bank):
    suite, trajectories, retriever = bank
    cfg = smoke(tmp_path, models_dir, **{"distill.steps": 2, "distill.lopd.lr_composer": 1e-3,
                                         "distill.keep_checkpoints": 1})
    cold = cold_start(cfg, retriever=retriever, out_dir=tmp_path / "cold" / "composer", trajectories=trajectories,
                      progress=False)
    assert cold.examples == len(trajectories) and cold.steps == cfg.distill.lopd.cold_start.steps

    full = train(cfg, suite=suite, bank=pinned(retriever, trajectories), run_dir=tmp_path / "full",
                 composer_init=cold.composer_dir, progress=False)
    assert [h["budget/episodes"] for h in full.history] == [2.0, 4.0]
    assert all(h["memory/hit_rate"] == 1.0 and h["memory/same_task_rate"] == 0.0 for h in full.history)

    part = smoke(tmp_path, models_dir, **{"distill.steps": 1, "distill.lopd.lr_composer": 1e-3})
    first = train(part, suite=suite, bank=pinned(retriever, trajectories), run_dir=tmp_path / "split",
                  composer_init=cold.composer_dir, progress=False)
    assert first.last_step == 0 and not first.resumed
    with pytest.raises(ValueError, match="table version 7"):
        train(cfg, suite=suite, bank=pinned(retriever, trajectories, 8), run_dir=tmp_path / "split", progress=False)
    logger = JsonlLogger(tmp_path / "split" / "metrics.jsonl")
    rest = train(cfg, suite=suite, bank=pinned(retriever, trajectories), run_dir=tmp_path / "split", progress=False,
                 logger=logger)
    assert rest.resumed and rest.first_step == 1 and rest.table_version == 7
    assert [r["step"] for r in logger.read()] == [1]
    for uninterrupted, resumed in zip(full.history[1:], rest.history, strict=True):
        for key in KEYS:
            assert resumed[key] == pytest.approx(uninterrupted[key], rel=1e-5, abs=1e-7), key
    assert rest.budget["episodes"] == full.budget["episodes"] == 4

    # checkpoints: the last keep_checkpoints (1) step directories, complete, with the manifest fields
    kept = list_checkpoints(tmp_path / "full")
    assert [p.name for p in kept] == ["step_000001"]
    info = read_checkpoint(kept[-1])
    assert (info.step, info.cursor, info.table_version, info.method) == (1, 4, 7, "lopd")
    assert info.beta == pytest.approx(full.history[-1]["distill/beta"])
    assert (info.path / "composer" / "phi0" / "anchor_cache.safetensors").exists()
    assert (full.student_dir / "adapter_model.safetensors").exists() and full.composer_dir is not None


@pytest.mark.parametrize("method", ["grpo", "none"])
def test_budget_is_b_episodes_per_step_for_every_method(tmp_path, models_dir, bank, method):
    suite, trajectories, retriever = bank
    cfg = smoke(tmp_path, models_dir, **{"distill.method": method, "distill.steps": 1})
    result = train(cfg, suite=suite, bank=pinned(retriever, trajectories), run_dir=tmp_path / method, progress=False)
    h = result.history[0]
    assert h["budget/episodes_step"] == cfg.distill.tasks_per_step
    assert h["budget/pretraining_episodes"] == 6 and h["budget/total_units"] == cfg.distill.tasks_per_step + 6
    assert result.composer_dir is None and (result.student_dir / "lopd_student.json").exists()


def test_grpo_top_ups_are_paid_from_the_episode_budget(tmp_path, models_dir, bank):
    suite, trajectories, retriever = bank
    # the tiny model never succeeds, so every group lacks reward spread and asks for its top-ups
    cfg = smoke(tmp_path, models_dir, **{"distill.method": "grpo", "distill.steps": 3, "distill.grpo.top_up": 2})
    b, g = cfg.distill.tasks_per_step, cfg.distill.group_size
    assert b // g == 1  # one group per step, so two top-up groups cost two steps' worth of episodes
    curve = HeldOutCurve(cfg, None, "toolworld", every=20, label="grpo",
                         score=lambda n, last: ({"success_rate": 0.0, "last": last}, {"eval/success_rate": 0.0}))
    result = train(cfg, suite=suite, bank=pinned(retriever, trajectories), run_dir=tmp_path / "grpo", progress=False,
                   on_step=curve)
    assert [(p["step"], p["last"]) for p in curve.points] == [(1, True)]  # the curve scores the real last step
    played = [h["budget/episodes_step"] for h in result.history]
    assert played[0] == 3 * b and result.history[0]["grpo/top_up_groups"] == 2.0  # the step tops up twice
    assert result.budget["episodes"] == 3 * b and len(played) == 1 and result.last_step == 0  # and spends the budget
    assert read_checkpoint(list_checkpoints(tmp_path / "grpo")[-1]).step == 0  # the last step is checkpointed
    spent = result.overheads  # the time outside rollouts and updates, by part
    assert set(spent) == {"engine_start", "gate", "retrieval", "hooks", "checkpoint", "engine_sync", "final_save"}
    assert spent["checkpoint"] > 0 and spent["final_save"] > 0 and spent["hooks"] > 0


def test_lopd_without_a_cold_started_composer_says_what_to_do(tmp_path, models_dir, bank):
    suite, trajectories, retriever = bank
    with pytest.raises(ValueError, match="cold-started composer"):
        train(smoke(tmp_path, models_dir), suite=suite, bank=pinned(retriever, trajectories), run_dir=tmp_path / "r",
              progress=False)


def test_the_privilege_gate_stops_a_teacher_at_the_wrong_fork_and_trains_a_teacher_at_the_right_one(
        tmp_path, models_dir, bank, monkeypatch):
    """The gate's wiring in a real run (text teacher, no composer needed). The tiny random model's δ is noise,
    so the probe's summary is replaced by the two measured teachers' figures (report 2026-12-07 §11): the
    latent teacher lowering `call` at the opener's fourth token, the text teacher with a slightly negative
    mean δ whose interval reaches 0."""
    import lopd_core.training as training

    suite, trajectories, retriever = bank
    measured = {"fork": {"successes": 8, "privilege_success": 0.008, "success_ci95_high": 0.019,
                         "privilege_first_token": 0.299, "opener_by_token": [0.299, -0.010, 0.0, -0.145, 0.0]},
                "text": {"successes": 8, "privilege_success": -0.040, "success_ci95_high": 0.006,
                         "privilege_first_token": 0.439, "opener_by_token": [0.439, 0.001, 0.0, 0.101, 0.0]}}
    cfg = smoke(tmp_path, models_dir, **{"distill.steps": 1, "distill.lopd.context": "text",
                                         "distill.lopd.privilege_gate": "stop"})
    monkeypatch.setattr(training, "probe_teacher", lambda *a, **k: measured["fork"])
    with pytest.raises(training.NotPrivilegedError, match=r"\+0\.299, -0\.010, \+0\.000, -0\.145"):
        train(cfg, suite=suite, bank=pinned(retriever, trajectories), run_dir=tmp_path / "fork", progress=False)
    assert not list_checkpoints(tmp_path / "fork")  # refused before any rollout or step

    monkeypatch.setattr(training, "probe_teacher", lambda *a, **k: measured["text"])
    result = train(cfg, suite=suite, bank=pinned(retriever, trajectories), run_dir=tmp_path / "text", progress=False)
    first = result.history[0]
    assert first["gate/privileged"] == 1.0 and first["gate/privilege_success_ci95_high"] == 0.006
    assert first["gate/privilege_opener_min"] == 0.0


def test_retrieval_stays_in_the_task_family_and_the_oracle_fills_in_only_when_asked(tiny_tokenizer):
    from lopd_core.rollout.oracle import oracle_episode, oracle_experience
    from lopd_core.training import retrieve_for

    suite = get_suite("toolworld")
    tasks = suite.tasks("train", 8, level=1, seed=11)
    episodes = [oracle_episode(tiny_tokenizer, suite, t) for t in tasks]
    assert all(e.success and e.reward == 1.0 for e in episodes)  # the oracle solves every task
    bank_family = tasks[0].family
    retriever = InMemoryRetriever([experience_of(e) for e, t in zip(episodes, tasks, strict=True)
                                   if t.family == bank_family][:3])
    others = [t for t in tasks if t.family != bank_family][:2]
    rollouts = [e for e, t in zip(episodes, tasks, strict=True) if t in others]
    same, metrics = retrieve_for(retriever, others, rollouts, step=0, k=2, exclude_same_task=True, group_size=1,
                                 same_family=True)
    assert same == [[], []] and metrics["memory/hit_rate"] == 0.0  # no experience of their family: nothing
    anything, _ = retrieve_for(retriever, others, rollouts, step=0, k=2, exclude_same_task=True, group_size=1)
    assert all(anything)  # the paper's rule hands them another family's experiences
    filled, metrics = retrieve_for(retriever, others, rollouts, step=0, k=2, exclude_same_task=True, group_size=1,
                                   same_family=True,
                                   fallback=lambda task: oracle_experience(tiny_tokenizer, suite, task, max_chars=400))
    assert metrics["memory/fallback_contexts"] == 2.0
    assert [e[0].experience_id for e in filled] == [f"oracle/{t.task_id}" for t in others]
    assert filled[0][0].messages[0] == {"role": "user", "content": others[0].instruction}


def test_family_weights_shape_the_task_order_and_the_capacity_control_trains_without_rollouts(tmp_path, models_dir):
    from lopd_core.training import task_order

    suite = get_suite("toolworld")
    plain = smoke(tmp_path, models_dir)
    weighted = smoke(tmp_path, models_dir, **{"distill.family_weights": {"bank/account_of": 0.0,
                                                                        "weather/convert_only": 20.0}})
    order = task_order(suite, weighted, n_tasks=40)
    families = [t.family for t in order]
    assert len(order) == 40 and "bank/account_of" not in families
    assert families.count("weather/convert_only") > [t.family for t in task_order(suite, plain, n_tasks=40)].count(
        "weather/convert_only")
    assert [t.task_id for t in task_order(suite, weighted, n_tasks=40)] == [t.task_id for t in order]  # deterministic

    cfg = smoke(tmp_path, models_dir, **{"distill.method": "sft_oracle", "distill.steps": 2})
    result = train(cfg, suite=suite, bank=None, run_dir=tmp_path / "oracle", progress=False)
    assert [h["budget/episodes"] for h in result.history] == [2.0, 4.0]  # B oracle transcripts per step
    assert all(h["distill/updated"] == 1.0 and h["rollout/n_episodes"] == 0 for h in result.history)
