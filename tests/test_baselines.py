"""Each baseline runs two real steps on the tiny model; its loss has the sign and gradients its definition says."""

from __future__ import annotations

import math

import pytest
import torch

from lopd_core.algorithms import NoUpdate, make_algorithm
from lopd_core.algorithms.base import StepInputs
from lopd_core.algorithms.context import sdpo_context
from lopd_core.algorithms.logprobs import gather_tokens, model_logprobs, plain_student_batch, student_logprobs
from lopd_core.algorithms.skill_sd import SkillBank, template_skill
from lopd_core.algorithms.synthetic import experience_of, make_trajectory, task_of
from lopd_core.config import load_config
from lopd_core.memory.in_memory import InMemoryRetriever
from lopd_core.models.policy import STUDENT, STUDENT_EMA, build_policy_set

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def setup(models_dir, method, **overrides):
    cfg = load_config("smoke").with_overrides({"distill.method": method, **overrides})
    torch.manual_seed(0)
    policies = build_policy_set(cfg.model, cfg.distill.lopd, models_dir, device="cpu")
    with torch.no_grad():  # peaked distributions (the random tiny model is near uniform)
        policies.base.get_input_embeddings().weight.mul_(10.0)
    return cfg, policies


def group(tok, *, feedback_on_failure: str = ""):
    """One task, G = 2 rollouts: a success and a failure (contiguous, as the driver lays groups out)."""
    good = make_trajectory(tok, task_id="t-add", instruction="What is 2+3?", replies=[CALL, "It is 5."],
                           observations=["<tool_response>5</tool_response>"], reward=1.0)
    bad = make_trajectory(tok, task_id="t-add", instruction="What is 2+3?", replies=["It is 7."], reward=0.0,
                          feedback=feedback_on_failure)
    return [good, bad], [task_of(good), task_of(bad)]


def token_logprobs(policies, rows):
    batch = plain_student_batch(policies, rows)
    with torch.no_grad():
        lp = student_logprobs(policies, batch)
    flat = gather_tokens(lp, batch.target_ids[batch.mask.bool()])
    rows_of = torch.nonzero(batch.mask.bool(), as_tuple=True)[0]
    return [float(flat[rows_of == b].sum()) for b in range(len(rows))]


def student_snapshot(policies):
    return [p.detach().clone() for p in policies.student_parameters()]


def changed(before, policies):
    return any(not torch.equal(a, b) for a, b in zip(before, policies.student_parameters(), strict=True))


# --------------------------------------------------------------------------------------------------
def test_grpo_pushes_up_the_success_and_down_the_failure(tiny_tokenizer, models_dir):
    cfg, policies = setup(models_dir, "grpo", **{"distill.lr_student": 1e-2})
    algo = make_algorithm(cfg.distill, policies)
    assert algo.episodes_per_task == cfg.distill.group_size == 2
    rows, tasks = group(tiny_tokenizer)
    before = token_logprobs(policies, rows)
    m = algo.step(StepInputs(step=0, trajectories=rows, tasks=tasks, retrieved=[[], []], group_size=2))
    # ratio 1 at the gradient: loss = −Σ_i A_i·T_i / Σ_i T_i with A = ±1/√2 (unbiased std of {1, 0})
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    t_good, t_bad = rows[0].n_generated, rows[1].n_generated
    assert m["distill/loss"] == pytest.approx(-(a * t_good - a * t_bad) / (t_good + t_bad), rel=1e-4)
    after = token_logprobs(policies, rows)
    assert after[0] > before[0] and after[1] < before[1]
    m2 = algo.step(StepInputs(step=1, trajectories=rows, tasks=tasks, retrieved=[[], []], group_size=2))
    assert math.isfinite(m2["distill/loss"]) and m2["distill/updated"] == 1
    # a group whose rewards are all equal carries no signal
    same = [rows[0], make_trajectory(tiny_tokenizer, task_id="t-add", instruction="What is 2+3?", replies=["5"], reward=1.0)]
    m3 = algo.step(StepInputs(step=2, trajectories=same, tasks=tasks, retrieved=[[], []], group_size=2))
    assert m3["grpo/zero_advantage_rate"] == 1.0 and m3["distill/updated"] == 0.0  # no signal: no update counted


def test_grpo_clips_in_later_epochs_and_tops_up_groups_without_signal(tiny_tokenizer, models_dir):
    cfg, policies = setup(models_dir, "grpo", **{"distill.lr_student": 5e-2, "distill.grpo.epochs": 3,
                                                 "distill.grpo.top_up": 2})
    algo = make_algorithm(cfg.distill, policies)
    rows, tasks = group(tiny_tokenizer)
    m = algo.step(StepInputs(step=0, trajectories=rows, tasks=tasks, retrieved=[[], []], group_size=2))
    assert m["distill/updated"] == 1.0 and m["grpo/clipped_fraction_last_epoch"] > 0  # the ratio left [1 ± ε]
    flat = [rows[0], make_trajectory(tiny_tokenizer, task_id="t-add", instruction="What is 2+3?", replies=["5"],
                                     reward=1.0)]
    asked = []

    def play_more(groups):  # the training loop's top-up: the next groups, with a reward spread
        asked.append(groups)
        return tasks * groups, rows * groups

    m = algo.step(StepInputs(step=1, trajectories=flat, tasks=tasks, retrieved=[[], []], group_size=2,
                             play_more=play_more))
    assert asked == [1] and m["grpo/top_up_groups"] == 1.0 and m["budget/extra_episodes"] == 2.0
    assert m["grpo/zero_advantage_group_rate"] == 1.0 and m["distill/updated"] == 1.0


def test_rft_trains_on_its_successes_so_far_and_hinted_rft_on_their_plain_prompt_twins(tiny_tokenizer, models_dir):
    from lopd_core.algorithms.rft import plain_prompt_twin
    from lopd_core.envs import get_suite
    from lopd_core.rollout.context import ContextSuite

    cfg, policies = setup(models_dir, "rft", **{"distill.lr_student": 1e-2})
    algo = make_algorithm(cfg.distill, policies)
    rows, tasks = group(tiny_tokenizer)
    before = token_logprobs(policies, rows)
    m = algo.step(StepInputs(step=0, trajectories=rows, tasks=tasks, retrieved=[[], []], group_size=2))
    assert m["rft/new_successes"] == 1 and m["rft/buffer"] == 1 and m["distill/updated"] == 1
    assert token_logprobs(policies, rows)[0] > before[0]  # the success became likelier
    m = algo.step(StepInputs(step=1, trajectories=rows[1:], tasks=tasks[1:], retrieved=[[]], group_size=1))
    assert m["rft/new_successes"] == 0 and m["distill/updated"] == 1  # the buffer still trains
    assert algo.state_dict()["buffer"][0]["trajectory_id"] == rows[0].trajectory_id

    # hinted: the suite plays each task behind a sibling's oracle (chat turns); successes return to the plain prompt
    suite = get_suite("toolworld")
    hinted_cfg, _ = setup(models_dir, "rft", **{"distill.rft.hint": True})
    hinted = make_algorithm(hinted_cfg.distill, policies)
    played = hinted.rollout_suite(suite)
    assert isinstance(played, ContextSuite)
    # hinted rollouts may run past the cap by the hint's length (the engine's context allows for it); no other
    assert played.allowance_tokens == hinted_cfg.distill.rft.hint_max_tokens == hinted_cfg.context_allowance() > 0
    assert cfg.context_allowance() == 0
    task = suite.tasks("train", 1, level=1, seed=3)[0]
    plain, with_hint = suite.make_env(task).reset(task), played.make_env(task).reset(task)
    assert len(with_hint) > len(plain) and with_hint[-1] == plain[-1] and with_hint[: len(plain) - 1] == plain[:-1]
    from lopd_core.rollout.oracle import scripted_trajectory
    episode = scripted_trajectory(tiny_tokenizer, initial=with_hint, replies=["It is done."], observations=[],
                                  task=task, reward=1.0, success=True)
    twin = plain_prompt_twin(tiny_tokenizer, suite, task, episode)
    assert twin.messages[: twin.initial_messages] == plain and twin.messages[-1]["content"] == "It is done."
    assert twin.prompt_len < episode.prompt_len and twin.n_generated == episode.n_generated


def test_the_capacity_control_fine_tunes_on_oracle_transcripts_without_rollouts(tiny_tokenizer, models_dir):
    from lopd_core.envs import get_suite

    cfg, policies = setup(models_dir, "sft_oracle", **{"distill.lr_student": 1e-2})
    algo = make_algorithm(cfg.distill, policies)
    assert algo.plays_rollouts is False
    suite = get_suite("toolworld")
    algo.rollout_suite(suite)
    tasks = suite.tasks("train", 2, level=1, seed=5)
    before = student_snapshot(policies)
    m = algo.step(StepInputs(step=0, trajectories=[], tasks=tasks, retrieved=[[], []]))
    assert m["distill/updated"] == 1 and m["distill/rollouts"] == 2 and m["sft_oracle/mean_reward"] == 1.0
    assert changed(before, policies)


def test_opsd_reference_sources_and_forward_kl_decreases(tiny_tokenizer, models_dir):
    cfg, policies = setup(models_dir, "opsd", **{"distill.lr_student": 1e-3})
    algo = make_algorithm(cfg.distill, policies)
    tok = tiny_tokenizer
    banked = make_trajectory(tok, task_id="t-add", instruction="What is 2+3?", replies=[CALL, "It is 5."],
                             observations=["<tool_response>5</tool_response>"])
    retriever = InMemoryRetriever([experience_of(banked)])
    rows = [make_trajectory(tok, task_id="t-add", instruction="What is 2+3?", replies=["It is 7."], reward=0.0),
            make_trajectory(tok, task_id="t-sub", instruction="What is 9-4?", replies=["It is 3."], reward=0.0),
            make_trajectory(tok, task_id="t-mul", instruction="What is 3*3?", replies=["It is 6."], reward=0.0)]
    tasks = [task_of(rows[0]), task_of(rows[1], oracle="It is 5."), task_of(rows[2])]
    base_before = {n: p.detach().clone() for n, p in policies.base.named_parameters() if "lora_" not in n}
    inputs = StepInputs(step=0, trajectories=rows, tasks=tasks, retrieved=[[], [], []], retriever=retriever)
    m1 = algo.step(inputs)
    assert (m1["opsd/reference_from_bank"], m1["opsd/reference_from_oracle"], m1["opsd/reference_from_none"]) == (1, 1, 1)
    assert m1["distill/supervised_tokens"] == rows[0].n_generated + rows[1].n_generated
    assert m1["distill/loss"] > 0
    m2 = algo.step(StepInputs(step=1, trajectories=rows, tasks=tasks, retrieved=[[], [], []], retriever=retriever))
    assert m2["distill/loss"] < m1["distill/loss"]  # the student moved toward the reference-conditioned teacher
    for n, p in policies.base.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base_before[n]) and p.grad is None


def test_opsd_jsd_option_runs(tiny_tokenizer, models_dir):
    cfg, policies = setup(models_dir, "opsd", **{"distill.opsd.divergence": "jsd"})
    rows = [make_trajectory(tiny_tokenizer, task_id="t", instruction="Say hi.", replies=["hello"], reward=0.0)]
    m = make_algorithm(cfg.distill, policies).step(
        StepInputs(step=0, trajectories=rows, tasks=[task_of(rows[0], oracle="hi")], retrieved=[[]]))
    assert 0 < m["opsd/jsd"] <= math.log(2)


def test_sdpo_context_never_shows_the_sample_itself(tiny_tokenizer):
    rows, _ = group(tiny_tokenizer, feedback_on_failure="expected 5, got 7")
    text_for_bad, sibling, feedback = sdpo_context(tiny_tokenizer, rows, 1, max_tokens=200)
    assert sibling and feedback and "It is 5." in text_for_bad and "It is 7." not in text_for_bad
    text_for_good, sibling, feedback = sdpo_context(tiny_tokenizer, rows, 0, max_tokens=200)
    assert (text_for_good, sibling, feedback) == ("", False, False)  # no successful sibling, no feedback → no loss


@pytest.mark.parametrize("placement", ["user_framing", "chat_turn"])
def test_sdpo_steps_with_ema_teacher(tiny_tokenizer, models_dir, placement):
    cfg, policies = setup(models_dir, "sdpo", **{"distill.lr_student": 1e-2, "distill.sdpo.context_placement": placement})
    algo = make_algorithm(cfg.distill, policies)
    rows, tasks = group(tiny_tokenizer, feedback_on_failure="expected 5, got 7")
    ema_before = [p.detach().clone() for p in policies.adapter_parameters(STUDENT_EMA)]
    m = algo.step(StepInputs(step=0, trajectories=rows, tasks=tasks, retrieved=[[], []], group_size=2))
    assert m["distill/rollouts_without_context"] == 1 and m["sdpo/with_sibling"] == 1
    assert m["distill/supervised_tokens"] == rows[1].n_generated and m["distill/loss"] >= 0
    # EMA: ema ← ema + rate·(student − ema), after the student step
    for old, ema, live in zip(ema_before, policies.adapter_parameters(STUDENT_EMA), policies.adapter_parameters(STUDENT),
                              strict=True):
        torch.testing.assert_close(ema, old + cfg.distill.sdpo.ema_rate * (live - old))
    assert any(not torch.equal(a, b) for a, b in zip(ema_before, policies.adapter_parameters(STUDENT_EMA), strict=True))
    m2 = algo.step(StepInputs(step=1, trajectories=rows, tasks=tasks, retrieved=[[], []], group_size=2))
    assert math.isfinite(m2["distill/loss"])
    # the teacher (EMA adapter) gets no gradient
    assert all(p.grad is None and not p.requires_grad for p in policies.adapter_parameters(STUDENT_EMA))


def test_skill_templates_and_ucb1(tiny_tokenizer):
    rows, _ = group(tiny_tokenizer)
    skill = template_skill(experience_of(rows[0]))
    assert "`add`" in skill and "What is 2+3?" in skill
    bank = SkillBank()
    for s in ("a", "b"):
        bank.add(s, s)
    assert bank.choose(["a", "b"], c=math.sqrt(2)) == "a"
    bank.update("a", 0.1)
    assert bank.choose(["a", "b"], c=math.sqrt(2)) == "b"  # untried arm first
    bank.update("b", 0.9)
    for _ in range(3):
        bank.update("b", 0.9)
    # a: 0.1 + √2·√(ln 5 / 1) ≈ 1.89 ; b: 0.9 + √2·√(ln 5 / 4) ≈ 1.80 → exploration picks a
    assert bank.choose(["a", "b"], c=math.sqrt(2)) == "a"
    assert bank.choose(["a", "b"], c=0.0) == "b"


def test_skill_sd_steps_with_template_and_policy_skills(tiny_tokenizer, models_dir):
    from lopd_core.rollout.engines.hf import HFEngine

    for source in ("template", "policy"):
        cfg, policies = setup(models_dir, "skill_sd", **{"distill.lr_student": 1e-2, "distill.skill_sd.skill_source": source,
                                                          "distill.skill_sd.max_skill_tokens": 12})
        engine = HFEngine(policies.student_module(), tiny_tokenizer, batch_size=2)
        algo = make_algorithm(cfg.distill, policies, engine=engine)
        rows, tasks = group(tiny_tokenizer)
        exps = [experience_of(make_trajectory(tiny_tokenizer, task_id="t-old", instruction="What is 1+1?",
                                              replies=[CALL, "It is 2."], observations=["<tool_response>2</tool_response>"]))]
        before = token_logprobs(policies, rows)
        m = algo.step(StepInputs(step=0, trajectories=rows, tasks=tasks, retrieved=[exps, exps], group_size=2))
        assert m["skill_sd/groups_with_skill"] == 1 and m["skill_sd/bank_size"] == 1
        assert m["budget/skill_generations"] == (1 if source == "policy" else 0)
        after = token_logprobs(policies, rows)
        assert after[0] > before[0] and after[1] < before[1]  # the PPO term dominates (λ = 0.001)
        m2 = algo.step(StepInputs(step=1, trajectories=rows, tasks=tasks, retrieved=[exps, exps], group_size=2))
        assert m2["budget/skill_generations"] == 0  # a skill is written once per experience
        assert math.isfinite(m2["distill/loss"]) and algo.bank.total_pulls == 2


def test_none_trains_nothing(tiny_tokenizer, models_dir):
    cfg, policies = setup(models_dir, "none")
    algo = make_algorithm(cfg.distill, policies)
    assert isinstance(algo, NoUpdate)
    rows, tasks = group(tiny_tokenizer)
    before = student_snapshot(policies)
    for step in range(2):
        assert algo.step(StepInputs(step=step, trajectories=rows, tasks=tasks, retrieved=[[], []]))["distill/updated"] == 0
    assert not changed(before, policies)


def test_teacher_views_share_one_set_of_base_weights(models_dir, tiny_tokenizer):
    cfg, policies = setup(models_dir, "sdpo")
    make_algorithm(cfg.distill, policies)
    rows, _ = group(tiny_tokenizer)
    batch = plain_student_batch(policies, rows)
    with torch.no_grad():
        with torch.no_grad():
            for p in policies.adapter_parameters(STUDENT):
                p.add_(0.05 * torch.randn_like(p))
        teacher = model_logprobs(policies, None, batch)
        student = model_logprobs(policies, STUDENT, batch)
        plain = policies.base.get_base_model()
    assert not torch.allclose(teacher, student)
    # one parameter tensor for the base weights, whichever view runs
    ids = {id(p) for n, p in plain.named_parameters() if "lora_" not in n}
    assert len(ids) == len([n for n, _ in plain.named_parameters() if "lora_" not in n])
    assert policies.student_module() is policies.base


@pytest.mark.parametrize("method", ["grpo", "opsd", "sdpo", "skill_sd"])
def test_micro_batches_give_the_same_step_as_the_whole_batch(method, tiny_tokenizer, models_dir):
    """distill.micro_batch only changes memory: one rollout per forward/backward gives the whole batch's step."""
    steps = []
    for micro_batch in (0, 1):
        cfg, policies = setup(models_dir, method, **{"distill.lr_student": 1e-2, "distill.micro_batch": micro_batch})
        algo = make_algorithm(cfg.distill, policies)
        (good, bad), _ = group(tiny_tokenizer, feedback_on_failure="expected 5, got 7")
        rows = [good, bad, good, bad]  # two groups of G = 2
        tasks = [task_of(r, oracle="It is 5.") for r in rows]
        exps = [experience_of(good)]
        before = student_snapshot(policies)
        m = algo.step(StepInputs(step=0, trajectories=rows, tasks=tasks, retrieved=[exps] * 4, group_size=2))
        assert changed(before, policies)
        steps.append((m, [p.detach().clone() for p in policies.student_parameters()]))
    (whole, p_whole), (micro, p_micro) = steps
    assert micro["distill/micro_batches"] > whole["distill/micro_batches"] == 1
    for key in ("distill/loss", "distill/student_grad_norm", "distill/supervised_tokens"):
        assert micro[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-7), key
    for a, b in zip(p_whole, p_micro, strict=True):  # Adam's first step is ≈ lr·sign(g): 1e-2 per element here
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
