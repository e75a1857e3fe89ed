"""Cold start of the composer on the tiny model: the leakage rule, what trains, and that the NLL goes down."""

from __future__ import annotations

import pytest
import torch

from lopd_core.algorithms.cold_start import ColdStart, ColdStartExample, batches, cold_start_examples
from lopd_core.algorithms.synthetic import experience_of, make_trajectory
from lopd_core.config import load_config
from lopd_core.memory.in_memory import InMemoryRetriever
from lopd_core.models.composer import new_composer_state
from lopd_core.models.policy import ENCODER, STUDENT, build_policy_set


def bank(tok):
    rows = [make_trajectory(tok, task_id=f"t{i}", instruction=f"What is {i}+{i}? Use the calculator.",
                            replies=[f'<tool_call>{{"name": "add", "arguments": {{"a": {i}, "b": {i}}}}}</tool_call>',
                                     f"It is {2 * i}."], observations=[f"<tool_response>{2 * i}</tool_response>"])
            for i in range(1, 5)]
    return rows, InMemoryRetriever([experience_of(r) for r in rows])


def test_a_trajectory_is_never_among_its_own_experiences(tiny_tokenizer):
    rows, retriever = bank(tiny_tokenizer)
    failed = make_trajectory(tiny_tokenizer, task_id="t9", instruction="What is 9+9?", replies=["no"], reward=0.0)
    examples, skipped = cold_start_examples([*rows, failed], retriever, n_retrieved=2, exclude_same_task=False)
    assert skipped == {"not_successful": 1, "no_experience": 0} and len(examples) == 4
    for ex in examples:
        assert len(ex.experiences) == 2
        assert all(e.episode_id != ex.trajectory.episode_id for e in ex.experiences)
    # the same task id allowed, but not the same episode: a second success of t1 is retrievable for the first
    again = make_trajectory(tiny_tokenizer, task_id="t1", instruction=rows[0].instruction, replies=["It is 2."])
    retriever.add(experience_of(again))
    examples, _ = cold_start_examples(rows[:1], retriever, n_retrieved=1, exclude_same_task=False)
    assert examples[0].experiences[0].episode_id == again.episode_id


def test_cold_start_trains_only_the_composer_and_lowers_the_nll(tiny_tokenizer, models_dir):
    cfg = load_config("smoke").with_overrides({"distill.lopd.cold_start.lr": 3e-3})
    torch.manual_seed(0)
    policies = build_policy_set(cfg.model, cfg.distill.lopd, models_dir, device="cpu")
    composer = new_composer_state(policies, cfg.distill.lopd)
    rows, retriever = bank(tiny_tokenizer)
    examples, _ = cold_start_examples(rows, retriever, n_retrieved=1, exclude_same_task=True)
    trainer = ColdStart(cfg.distill, policies, composer)
    frozen = {n: p.detach().clone() for n, p in policies.base.named_parameters() if "lora_" not in n}
    student0 = [p.detach().clone() for p in policies.adapter_parameters(STUDENT)]
    encoder0 = [p.detach().clone() for p in policies.adapter_parameters(ENCODER)]
    compressor0 = [p.detach().clone() for p in composer.compressor.parameters()]
    nll = [trainer.step(examples[:2])["cold_start/nll"] for _ in range(8)]
    assert nll[-1] < nll[0], nll
    assert all(torch.equal(a, b) for a, b in zip(student0, policies.adapter_parameters(STUDENT), strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(encoder0, policies.adapter_parameters(ENCODER), strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(compressor0, composer.compressor.parameters(), strict=True))
    for n, p in policies.base.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, frozen[n])
    leaked = ColdStartExample(rows[0], [experience_of(rows[0])])
    with pytest.raises(ValueError, match="among its own retrieved experiences"):
        trainer.step([leaked])


def test_cold_start_batches_cycle_deterministically():
    examples = list(range(5))
    first = list(batches(examples, batch_size=2, steps=6, seed=3))
    assert first == list(batches(examples, batch_size=2, steps=6, seed=3))
    assert sorted(x for b in first[:2] for x in b) != [] and all(len(b) == 2 for b in first)
    seen = [x for b in first for x in b]
    assert sorted(seen[:5]) == examples  # one full pass before any repeat
    with pytest.raises(ValueError, match="no usable example"):
        next(batches([], batch_size=2, steps=1, seed=0))


def test_cold_start_step_is_the_same_with_gradient_checkpointing(tiny_tokenizer, models_dir):
    rows, retriever = bank(tiny_tokenizer)
    nll = []
    for checkpointing in (False, True):
        cfg = load_config("smoke").with_overrides({"model.gradient_checkpointing": checkpointing,
                                                   "distill.lopd.cold_start.lr": 3e-3})
        torch.manual_seed(0)
        policies = build_policy_set(cfg.model, cfg.distill.lopd, models_dir, device="cpu")
        composer = new_composer_state(policies, cfg.distill.lopd)
        examples, _ = cold_start_examples(rows, retriever, n_retrieved=1, exclude_same_task=True)
        trainer = ColdStart(cfg.distill, policies, composer)
        nll.append([trainer.step(examples[:2])["cold_start/nll"] for _ in range(2)])
    assert nll[0] == pytest.approx(nll[1], rel=1e-5)


def test_cold_start_micro_batches_give_the_same_step(tiny_tokenizer, models_dir):
    rows, retriever = bank(tiny_tokenizer)
    nll = []
    for micro_batch in (0, 1):
        cfg = load_config("smoke").with_overrides({"distill.micro_batch": micro_batch, "distill.lopd.cold_start.lr": 3e-3})
        torch.manual_seed(0)
        policies = build_policy_set(cfg.model, cfg.distill.lopd, models_dir, device="cpu")
        composer = new_composer_state(policies, cfg.distill.lopd)
        examples, _ = cold_start_examples(rows, retriever, n_retrieved=1, exclude_same_task=True)
        trainer = ColdStart(cfg.distill, policies, composer)
        nll.append([trainer.step(examples[:3])["cold_start/nll"] for _ in range(2)])
    assert nll[0] == pytest.approx(nll[1], rel=1e-5)


def test_cold_start_holds_out_tasks_keeps_its_best_composer_and_stops_early(tiny_tokenizer, models_dir, tmp_path):
    from lopd_core.algorithms.cold_start import validation_split
    from lopd_core.training import cold_start

    rows, retriever = bank(tiny_tokenizer)
    examples, _ = cold_start_examples(rows, retriever, n_retrieved=1, exclude_same_task=True)
    train, held = validation_split(examples, fraction=0.5, seed=0)
    assert len(train) == len(held) == 2 and not {e.trajectory.task_id for e in train} & {e.trajectory.task_id for e in held}
    assert validation_split(examples[:1], fraction=0.5, seed=0) == (examples[:1], [])  # a lone task trains

    cfg = load_config("smoke").with_overrides({
        "workspace.models_dir": str(models_dir), "distill.lopd.retrieval_family": "any",
        "distill.lopd.cold_start.steps": 30, "distill.lopd.cold_start.lr": 1.0,  # too large: it overshoots
        "distill.lopd.cold_start.validation_fraction": 0.5, "distill.lopd.cold_start.eval_every": 1,
        "distill.lopd.cold_start.patience": 2})
    result = cold_start(cfg, retriever=retriever, out_dir=tmp_path / "composer", trajectories=rows, progress=False)
    assert result.validation_examples == 2 and result.stopped_early and result.steps < 30
    assert result.val_nll_best <= result.val_nll_first and result.best_step == result.steps - 2
    assert result.val_nll_without_latents > 0
    assert [h.get("cold_start/val_nll") is not None for h in result.history] == [True] * result.steps


def test_the_cold_start_learns_from_every_stored_success_and_retrieves_only_curated_ones(tmp_path, models_dir,
                                                                                         tiny_tokenizer):
    """LanceDB bank: curation keeps one success per task; the cold start's y* are every stored success."""
    from dataclasses import replace

    from lopd_core.envs import get_suite
    from lopd_core.memory.curation import curate_store
    from lopd_core.memory.indexing import index_store
    from lopd_core.memory.store import ExperienceStore
    from lopd_core.recipe import bank_from_store, cold_start_composer, cold_start_y_star
    from lopd_core.rollout.oracle import oracle_episode

    cfg = load_config("smoke").with_overrides({
        "workspace.home": str(tmp_path / "ws"), "workspace.models_dir": str(models_dir),
        "curation.success_threshold_tool": 0.8, "curation.per_task_cap": 1, "distill.lopd.retrieval_family": "any",
        "distill.lopd.cold_start.steps": 1, "distill.lopd.cold_start.validation_fraction": 0.0})
    suite = get_suite("toolworld")
    tasks = suite.tasks("train", 4, level=1, seed=321)
    played = [oracle_episode(tiny_tokenizer, suite, t) for t in tasks for _ in range(2)]  # two successes per task
    played.append(replace(played[0], reward=0.0, success=False))  # a failure
    played.append(oracle_episode(tiny_tokenizer, suite, suite.tasks("test", 1, level=1, seed=321)[0]))  # held out
    for i, t in enumerate(played):
        t.cycle_id, t.trajectory_id, t.episode_id = "seed", f"seed-{i}", f"seed-{i}"
    store = ExperienceStore.from_config(cfg)
    store.write_trajectories(played, cycle_id="seed")
    curate_store(store, cfg)
    bank = bank_from_store(store, version=index_store(store).experiences_version, episodes=len(played))
    successes = {f"seed-{i}" for i in range(8)}
    assert played[0].reward >= 0.8 and {t.trajectory_id for t in bank.successes} < successes
    assert len(bank.successes) <= len(tasks)  # the per-task cap

    y_star = cold_start_y_star(cfg, bank, suite_name="toolworld")
    assert [t.trajectory_id for t in y_star] == sorted(successes)
    curated = cfg.with_overrides({"distill.lopd.cold_start.y_star": "curated"})
    assert [t.trajectory_id for t in cold_start_y_star(curated, bank, suite_name="toolworld")] == \
        [t.trajectory_id for t in bank.successes]

    result = cold_start_composer(cfg, bank, suite_name="toolworld", out_dir=tmp_path / "composer",
                                 models_dir=models_dir, progress=False)
    assert result.examples == 8 and result.skipped == {"not_successful": 0, "no_experience": 0}
    # every y* retrieves curated experiences only, never its own task (exclude_same_task)
    examples, _ = cold_start_examples(y_star, bank.retriever, n_retrieved=cfg.distill.lopd.n_retrieved,
                                      exclude_same_task=True)
    kept = {t.trajectory_id for t in bank.successes}
    assert all(e.experience_id in kept and e.task_id != ex.trajectory.task_id
               for ex in examples for e in ex.experiences)


def test_the_opener_weight_weighs_each_first_action_opener_and_the_validation_reports_it(tiny_tokenizer, models_dir):
    """``cold_start.opener_weight``: the first tokens of each y*'s first action (as many as the tool-call tag
    has) weigh ``w`` in the NLL, every other token 1; validation reports the δ (latents − none) there."""
    from lopd_core.algorithms.lopd import opener_length

    rows, retriever = bank(tiny_tokenizer)
    examples, _ = cold_start_examples(rows, retriever, n_retrieved=1, exclude_same_task=True)
    opener, results = opener_length(tiny_tokenizer), {}
    for weight in (1.0, 20.0):
        cfg = load_config("smoke").with_overrides({"distill.lopd.cold_start.lr": 3e-3,
                                                   "distill.lopd.cold_start.opener_weight": weight})
        torch.manual_seed(0)
        policies = build_policy_set(cfg.model, cfg.distill.lopd, models_dir, device="cpu")
        trainer = ColdStart(cfg.distill, policies, new_composer_state(policies, cfg.distill.lopd))
        if weight != 1:
            mask = torch.tensor([[0, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]])
            assert trainer._weights(mask).tolist() == [weight] * 3 + [weight] * opener + [1.0] * (7 - opener)
        before = trainer.validation_nll(examples)
        assert len(before["opener"]) == opener == 5
        assert (before["score"] == before["nll"]) == (weight == 1)
        for _ in range(6):
            trainer.step(examples[:2])
        results[weight] = (before, trainer.validation_nll(examples))
    # the same start; weighting the opener raises its δ more than the plain NLL does
    assert results[1.0][0]["opener"] == pytest.approx(results[20.0][0]["opener"])
    gain = {w: sum(after["opener"]) - sum(before["opener"]) for w, (before, after) in results.items()}
    assert gain[20.0] > gain[1.0], gain
