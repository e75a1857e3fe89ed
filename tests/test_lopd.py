"""The LOPD step on the tiny model: latent span by position, injection, composer, three real steps, ablations.

The tiny random Llama has nearly uniform next-token distributions (embedding std 0.02), which makes every
KL ≈ 0. Tests that need peaked distributions scale its (tied) embedding matrix, still a real model.
"""

from __future__ import annotations

import math

import pytest
import torch

from lopd_core import losses
from lopd_core.algorithms.base import StepInputs
from lopd_core.algorithms.batch import student_batch, teacher_batch
from lopd_core.algorithms.lopd import LOPD
from lopd_core.algorithms.synthetic import experience_of, make_trajectory, task_of
from lopd_core.config import load_config
from lopd_core.memory.in_memory import InMemoryRetriever
from lopd_core.models.composer import (
    ComposerPair,
    compose,
    freeze_phi0,
    load_composer,
    new_composer_state,
    save_composer,
)
from lopd_core.models.latent import CONTEXT_AFTER, CONTEXT_BEFORE, inject_latents, latent_prompt
from lopd_core.models.policy import ENCODER, ENCODER_PHI0, STUDENT, build_policy_set


def smoke(**overrides):
    return load_config("smoke").with_overrides(overrides)


def build(cfg, models_dir, *, sharpen: float = 30.0, phi0: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    policies = build_policy_set(cfg.model, cfg.distill.lopd, models_dir, device="cpu")
    if sharpen != 1.0:
        with torch.no_grad():
            policies.base.get_input_embeddings().weight.mul_(sharpen)
    composer = new_composer_state(policies, cfg.distill.lopd, seed=seed)
    if phi0:
        freeze_phi0(policies, composer)
    return policies, composer


def toy_rollouts(tok):
    rows = [
        make_trajectory(tok, task_id="t-add", instruction="What is 2+3? Use the calculator.",
                        replies=['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "It is 5."],
                        observations=["<tool_response>5</tool_response>"], reward=1.0),
        make_trajectory(tok, task_id="t-mul", instruction="What is 4*6?", replies=["It is 20."], reward=0.0),
    ]
    exps = [experience_of(make_trajectory(tok, task_id="t-old", instruction="What is 7+1?", replies=["It is 8."]))]
    return rows, [task_of(r) for r in rows], [exps, exps]


# --------------------------------------------------------------------------------------------------
def test_latent_span_is_located_by_position_and_teacher_aligns(tiny_tokenizer):
    tok = tiny_tokenizer
    rows, _, _ = toy_rollouts(tok)
    traj = rows[0]
    prompt = latent_prompt(tok, traj.messages[:2], traj.tools, n_latents=6, placeholder_id=tok.pad_token_id)
    before = tok.decode(prompt.ids[: prompt.span_start])
    after = tok.decode(prompt.ids[prompt.span_start + prompt.span_length:])
    assert before.endswith(CONTEXT_BEFORE) and "<|im_start|>user" in before
    assert after.startswith(CONTEXT_AFTER + traj.instruction) and after.endswith("<|im_start|>assistant\n")
    # the placeholder is the pad id, which also ends every turn: position, not id, marks the span
    assert prompt.ids.count(tok.pad_token_id) > prompt.span_length
    s = student_batch(rows, pad_id=tok.pad_token_id, device="cpu")
    t = teacher_batch(rows, [prompt, latent_prompt(tok, rows[1].messages[:2], [], n_latents=6,
                                                   placeholder_id=tok.pad_token_id)], pad_id=tok.pad_token_id, device="cpu")
    assert torch.equal(s.target_ids, t.target_ids) and torch.equal(s.mask, t.mask)
    for b in range(2):
        n = int(s.mask[b].sum())
        assert torch.equal(t.input_ids[b, t.predict_index[b, :n] + 1], s.target_ids[b, :n])
        assert torch.equal(s.input_ids[b, s.predict_index[b, :n] + 1], s.target_ids[b, :n])
    # the attention mask comes from lengths: the pad-valued ids inside the sequence are attended
    assert int(t.attention_mask[0].sum()) == len(prompt.ids) + len(traj.continuation_ids())


def test_inject_latents_is_out_of_place_and_carries_gradients():
    embeds = torch.randn(2, 10, 8)
    original = embeds.clone()
    latents = torch.randn(3, 8, requires_grad=True)
    out = inject_latents(embeds, [latents, None], [4, 0])
    assert torch.equal(embeds, original)
    assert torch.equal(out[0, 4:7], latents.detach()) and torch.equal(out[0, :4], embeds[0, :4])
    assert torch.equal(out[1], embeds[1])
    out.sum().backward()
    assert torch.equal(latents.grad, torch.ones(3, 8))
    with pytest.raises(ValueError, match="does not fit"):
        inject_latents(embeds, [latents, None], [8, 0])


def test_compressor_output_scale_shape_and_padding_invariance(tiny_tokenizer, models_dir):
    cfg = smoke()
    policies, composer = build(cfg, models_dir, sharpen=1.0, phi0=False)
    rows, tasks, exps = toy_rollouts(tiny_tokenizer)
    pairs = [ComposerPair("t-add", tasks[0].instruction, exps[0][0]), ComposerPair("t-mul", tasks[1].instruction, exps[0][0])]
    with torch.no_grad():
        both = compose(policies, composer.compressor, pairs, adapter=ENCODER, max_tokens=64)
        alone = compose(policies, composer.compressor, pairs[:1], adapter=ENCODER, max_tokens=64)
    k, d = cfg.distill.lopd.n_latents, policies.base.get_base_model().config.hidden_size
    assert both.shape == (2, k, d)
    # the two pairs pad differently in one batch; the mask makes the result independent of padding
    torch.testing.assert_close(both[:1], alone, atol=1e-5, rtol=1e-4)
    rms = policies.base.get_input_embeddings().weight.pow(2).mean().sqrt()
    assert float(both.pow(2).mean().sqrt()) == pytest.approx(float(rms), rel=0.05)


@pytest.mark.parametrize("form", ["signed", "balanced"])
def test_three_lopd_steps_train_student_and_composer_but_not_the_teacher(tiny_tokenizer, models_dir, form):
    cfg = smoke(**{"distill.lopd.lr_composer": 1e-3, "distill.lr_student": 1e-3, "distill.lopd.margin_form": form})
    policies, composer = build(cfg, models_dir)
    algo = LOPD(cfg.distill, policies, composer)
    rows, tasks, retrieved = toy_rollouts(tiny_tokenizer)
    frozen = {n: p.detach().clone() for n, p in policies.base.named_parameters() if "lora_" not in n}
    phi0 = [p.detach().clone() for p in policies.adapter_parameters(ENCODER_PHI0)]
    student0 = [p.detach().clone() for p in policies.adapter_parameters(STUDENT)]
    encoder0 = [p.detach().clone() for p in policies.adapter_parameters(ENCODER)]
    compressor0 = [p.detach().clone() for p in composer.compressor.parameters()]
    beta = cfg.distill.lopd.beta_init
    for step in range(3):
        m = algo.step(StepInputs(step=step, trajectories=rows, tasks=tasks, retrieved=retrieved))
        assert all(math.isfinite(v) for v in m.values()), m
        lopd = cfg.distill.lopd
        margin, estimate = ((lopd.margin, m["distill/privilege_delta"]) if form == "signed"
                            else (lopd.balanced_margin, m["distill/margin_delta"]))
        assert m["distill/margin_signal"] == 1.0  # toy_rollouts has a success and a failure
        expected = max(0.0, beta + lopd.dual_lr * (margin - estimate))
        assert m["distill/beta"] == pytest.approx(expected)
        beta = m["distill/beta"]
        assert m["distill/kl_topk"] >= -1e-6 and m["distill/supervised_tokens"] == sum(r.n_generated for r in rows)
    assert beta > 0  # Δ̂ stays below m = 0.05 on this random model, so β must have grown
    changed = lambda before, after: any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))  # noqa: E731
    assert changed(student0, policies.adapter_parameters(STUDENT))
    assert changed(encoder0, policies.adapter_parameters(ENCODER))
    assert changed(compressor0, list(composer.compressor.parameters()))
    assert not changed(phi0, policies.adapter_parameters(ENCODER_PHI0))
    for n, p in policies.base.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, frozen[n]), f"teacher weight {n} changed"


def test_reusing_the_teacher_forward_gives_the_same_step(tiny_tokenizer, models_dir):
    rows, tasks, retrieved = toy_rollouts(tiny_tokenizer)
    runs = []
    for reuse in (False, True):
        cfg = smoke(**{"distill.lopd.reuse_teacher_forward": reuse, "distill.lopd.lr_composer": 1e-3})
        policies, composer = build(cfg, models_dir)
        algo = LOPD(cfg.distill, policies, composer)
        runs.append([algo.step(StepInputs(step=s, trajectories=rows, tasks=tasks, retrieved=retrieved)) for s in range(2)])
    for a, b in zip(*runs, strict=True):
        for key in ("distill/kl_topk", "distill/composer_kl", "distill/privilege_delta", "distill/beta", "distill/anchor"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_rollouts_without_context_or_errored_get_no_loss(tiny_tokenizer, models_dir):
    cfg = smoke()
    policies, composer = build(cfg, models_dir)
    algo = LOPD(cfg.distill, policies, composer)
    rows, tasks, retrieved = toy_rollouts(tiny_tokenizer)
    broken = make_trajectory(tiny_tokenizer, task_id="t-err", instruction="?", replies=["x"], status="error")
    m = algo.step(StepInputs(step=0, trajectories=[*rows, broken], tasks=[*tasks, task_of(broken)],
                             retrieved=[retrieved[0], [], retrieved[0]]))
    assert m["distill/rollouts_errored"] == 1 and m["distill/rollouts_without_context"] == 1
    assert m["distill/supervised_tokens"] == rows[0].n_generated
    before = [p.detach().clone() for p in policies.adapter_parameters(STUDENT)]
    m = algo.step(StepInputs(step=1, trajectories=rows, tasks=tasks, retrieved=[[], []]))
    assert m["distill/updated"] == 0 and m["distill/rollouts_without_context"] == 2
    assert all(torch.equal(a, b) for a, b in zip(before, policies.adapter_parameters(STUDENT), strict=True))


def test_frozen_composer_and_text_context_ablations(tiny_tokenizer, models_dir):
    rows, tasks, retrieved = toy_rollouts(tiny_tokenizer)
    cfg = smoke(**{"distill.lopd.frozen_composer": True})
    policies, composer = build(cfg, models_dir)
    compressor0 = [p.detach().clone() for p in composer.compressor.parameters()]
    m = LOPD(cfg.distill, policies, composer).step(StepInputs(step=0, trajectories=rows, tasks=tasks, retrieved=retrieved))
    assert m["distill/composer_updated"] == 0 and m["distill/beta"] == cfg.distill.lopd.beta_init
    assert all(torch.equal(a, b) for a, b in zip(compressor0, composer.compressor.parameters(), strict=True))
    cfg = smoke(**{"distill.lopd.context": "text"})
    policies, _ = build(cfg, models_dir, phi0=False)
    m = LOPD(cfg.distill, policies, None).step(StepInputs(step=0, trajectories=rows, tasks=tasks, retrieved=retrieved))
    assert m["distill/updated"] == 1 and m["distill/kl_topk"] > 0 and math.isfinite(m["distill/privilege_delta"])


@pytest.mark.parametrize(("form", "field", "measure"), [("signed", "margin", "distill/privilege_delta"),
                                                       ("balanced", "balanced_margin", "distill/margin_delta")])
def test_margin_raises_the_privilege_on_a_constructed_case(tiny_tokenizer, models_dir, form, field, measure):
    """A fixed student (lr ≈ 0), a toy composer, 50 steps: with m = 0.05 Δ ends higher than with m = 0."""
    rows, tasks, retrieved = toy_rollouts(tiny_tokenizer)
    finals, betas_while_below = {}, []
    for margin in (0.0, 0.05):
        cfg = smoke(**{"distill.lopd.margin_form": form, f"distill.lopd.{field}": margin, "distill.lr_student": 1e-12,
                       "distill.lopd.lr_composer": 3e-3, "distill.lopd.anchor_weight": 0.0, "distill.lopd.dual_lr": 2.0})
        policies, composer = build(cfg, models_dir, sharpen=10.0)
        algo = LOPD(cfg.distill, policies, composer)
        history = []
        for step in range(50):
            m = algo.step(StepInputs(step=step, trajectories=rows, tasks=tasks, retrieved=retrieved))
            history.append(m)
            if margin > 0 and step > 0 and history[-2][measure] < margin:
                betas_while_below.append(history[-2]["distill/beta"])
        finals[margin] = sum(h[measure] for h in history[-5:]) / 5
        if margin == 0:
            assert all(h["distill/beta"] == 0 for h in history)
    assert finals[0.05] > finals[0.0] + 0.01, finals
    assert betas_while_below and all(b > 0 for b in betas_while_below)


def test_a_step_without_success_rescores_bank_successes_for_the_balanced_margin(tiny_tokenizer, models_dir):
    cfg = smoke(**{"distill.lopd.margin_form": "balanced", "distill.lopd.rescore_successes": 2})
    policies, composer = build(cfg, models_dir)
    rows, tasks, retrieved = toy_rollouts(tiny_tokenizer)
    failed = [rows[1], rows[1]]
    bank = [make_trajectory(tiny_tokenizer, task_id=f"t-bank{i}", instruction=f"What is {i}+{i}?", family="toy",
                            replies=[f"It is {2 * i}."], reward=1.0) for i in range(3)]
    retriever = InMemoryRetriever([experience_of(t) for t in bank])
    inputs = StepInputs(step=0, trajectories=failed, tasks=[tasks[1], tasks[1]], retrieved=[retrieved[1]] * 2,
                        retriever=retriever, bank_successes=bank)
    m = LOPD(cfg.distill, policies, composer).step(inputs)
    # two bank successes entered Δ (each retrieving only the other bank tasks), so the step has a signal
    assert m["distill/rescored_successes"] == 2 and m["distill/successes_scored"] == 2
    assert m["distill/margin_signal"] == 1.0 and math.isfinite(m["distill/privilege_success"])
    assert math.isfinite(m["distill/privilege_opener"]) and math.isfinite(m["distill/privilege_opener_failure"])
    assert m["distill/supervised_tokens"] == sum(r.n_generated for r in failed)  # the student learns from its own only
    alone = LOPD(cfg.distill, policies, composer).step(StepInputs(step=0, trajectories=failed, tasks=[tasks[1]] * 2,
                                                                  retrieved=[retrieved[1]] * 2))
    assert alone["distill/rescored_successes"] == 0 and alone["distill/margin_signal"] == 0.0


def test_composer_directory_roundtrip(tiny_tokenizer, models_dir, tmp_path):
    cfg = smoke()
    policies, composer = build(cfg, models_dir, sharpen=1.0)
    rows, tasks, retrieved = toy_rollouts(tiny_tokenizer)
    LOPD(cfg.distill, policies, composer).step(StepInputs(step=0, trajectories=rows, tasks=tasks, retrieved=retrieved))
    pairs = [ComposerPair("t-add", tasks[0].instruction, retrieved[0][0])]
    with torch.no_grad():
        want = compose(policies, composer.compressor, pairs, adapter=ENCODER, max_tokens=64)
    save_composer(policies, composer, tmp_path / "composer")
    other, _ = build(cfg, models_dir, sharpen=1.0, phi0=False, seed=1)
    loaded = load_composer(other, tmp_path / "composer", cfg.distill.lopd)
    with torch.no_grad():
        got = compose(other, loaded.compressor, pairs, adapter=ENCODER, max_tokens=64)
    torch.testing.assert_close(got, want)
    assert loaded.beta == composer.beta and set(loaded.anchor_cache) == set(composer.anchor_cache)
    for key, value in composer.anchor_cache.items():
        torch.testing.assert_close(loaded.anchor_cache[key], value)
    bad = cfg.with_overrides({"distill.lopd.n_latents": 5})
    with pytest.raises(ValueError, match="n_latents"):
        load_composer(other, tmp_path / "composer", bad.distill.lopd)


def test_anchor_is_zero_at_phi0_and_grows_as_phi_moves(tiny_tokenizer, models_dir):
    cfg = smoke(**{"distill.lopd.lr_composer": 1e-2})
    policies, composer = build(cfg, models_dir)
    algo = LOPD(cfg.distill, policies, composer)
    rows, tasks, retrieved = toy_rollouts(tiny_tokenizer)
    first = algo.step(StepInputs(step=0, trajectories=rows, tasks=tasks, retrieved=retrieved))
    second = algo.step(StepInputs(step=1, trajectories=rows, tasks=tasks, retrieved=retrieved))
    assert first["distill/anchor"] == pytest.approx(0.0, abs=1e-12)
    assert second["distill/anchor"] > 0
    assert losses.latent_anchor(torch.ones(2), torch.ones(2)).item() == 0


def test_teacher_prefix_cache_gives_the_same_logprobs_and_gradients(tiny_tokenizer, models_dir):
    from lopd_core.algorithms.lopd import latent_teacher_logprobs, teacher_prefix

    cfg = smoke()
    policies, composer = build(cfg, models_dir, sharpen=10.0)
    rows, tasks, retrieved = toy_rollouts(tiny_tokenizer)
    tok, k = policies.tokenizer, cfg.distill.lopd.n_latents
    prompts = [latent_prompt(tok, r.messages[:2], r.tools, n_latents=k, placeholder_id=tok.pad_token_id) for r in rows]
    batch = teacher_batch(rows, prompts, pad_id=tok.pad_token_id, device="cpu")
    pairs = [ComposerPair(t.task_id, t.instruction, e[0]) for t, e in zip(tasks, retrieved, strict=True)]
    prefix = teacher_prefix(policies, batch)
    assert prefix is not None and prefix.length == min(p.span_start for p in prompts) > 8
    results = []
    for use in (None, prefix, prefix):  # the prefix is reusable: the forward must not append to it
        lp, _ = latent_teacher_logprobs(policies, composer, batch, pairs, [[0], [1]], max_tokens=64, prefix=use)
        (grad,) = torch.autograd.grad(lp.gather(-1, batch.target_ids[batch.mask.bool()][:, None]).sum(),
                                      composer.compressor.proj_out.weight)
        results.append((lp.detach(), grad))
    for lp, grad in results[1:]:
        torch.testing.assert_close(lp, results[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad, results[0][1], atol=1e-5, rtol=1e-4)


def test_gradient_checkpointing_gives_the_same_step(tiny_tokenizer, models_dir):
    rows, tasks, retrieved = toy_rollouts(tiny_tokenizer)
    runs = []
    for checkpointing in (False, True):
        cfg = smoke(**{"model.gradient_checkpointing": checkpointing, "distill.lopd.lr_composer": 1e-3})
        policies, composer = build(cfg, models_dir)
        assert policies.gradient_checkpointing == checkpointing
        algo = LOPD(cfg.distill, policies, composer)
        runs.append([algo.step(StepInputs(step=s, trajectories=rows, tasks=tasks, retrieved=retrieved)) for s in range(2)])
    for a, b in zip(*runs, strict=True):
        for key in ("distill/kl_topk", "distill/composer_kl", "distill/privilege_delta", "distill/beta"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_full_fine_tune_student_keeps_a_frozen_teacher(tiny_tokenizer, models_dir, tmp_path):
    cfg = smoke(**{"model.student": "full", "distill.lr_student": 1e-3})
    policies, composer = build(cfg, models_dir)
    assert policies.full_student is not None and STUDENT not in policies.adapter_names()
    teacher = {n: p.detach().clone() for n, p in policies.base.named_parameters() if "lora_" not in n}
    student0 = {n: p.detach().clone() for n, p in policies.full_student.named_parameters()}
    rows, tasks, retrieved = toy_rollouts(tiny_tokenizer)
    algo = LOPD(cfg.distill, policies, composer)
    for step in range(2):
        m = algo.step(StepInputs(step=step, trajectories=rows, tasks=tasks, retrieved=retrieved))
        assert math.isfinite(m["distill/kl_topk"]) and m["distill/student_grad_norm"] > 0
    assert any(not torch.equal(p, student0[n]) for n, p in policies.full_student.named_parameters())
    assert all(torch.equal(p, teacher[n]) for n, p in policies.base.named_parameters() if "lora_" not in n)
    policies.save_student(tmp_path / "student")
    other, _ = build(cfg, models_dir, phi0=False)
    other.load_student(tmp_path / "student")
    for (n, a), (_, b) in zip(policies.full_student.named_parameters(), other.full_student.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    lora_cfg = smoke()
    lora_policies, _ = build(lora_cfg, models_dir, phi0=False)
    with pytest.raises(ValueError, match="model.student"):
        lora_policies.load_student(tmp_path / "student")


def test_rollouts_sorted_by_length_pad_less_and_give_the_same_step(tiny_tokenizer, models_dir):
    """distill.sort_by_length: micro-batches of similar lengths (long, short, long, short → short, short |
    long, long) pad less, and the step is the same up to the order of float sums."""
    rows, tasks, retrieved = toy_rollouts(tiny_tokenizer)
    rows, tasks, retrieved = rows * 2, tasks * 2, retrieved * 2
    assert len(rows[0].token_ids) > len(rows[1].token_ids)
    runs = []
    for sort in (False, True):
        cfg = smoke(**{"distill.micro_batch": 2, "distill.sort_by_length": sort, "distill.lopd.lr_composer": 1e-3,
                       "distill.lr_student": 1e-3, "distill.share_prefix": False})
        policies, composer = build(cfg, models_dir)
        algo = LOPD(cfg.distill, policies, composer)
        metrics = algo.step(StepInputs(step=0, trajectories=rows, tasks=tasks, retrieved=retrieved))
        runs.append((metrics, [p.detach().clone() for p in policies.student_parameters()]))
    (plain, p_plain), (packed, p_packed) = runs
    assert packed["distill/padded_positions"] < plain["distill/padded_positions"]
    assert packed["distill/micro_batches"] == plain["distill/micro_batches"] == 2
    for key in ("distill/kl_topk", "distill/composer_kl", "distill/supervised_tokens", "distill/student_grad_norm"):
        assert packed[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(p_plain, p_packed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_micro_batches_give_the_same_step_as_the_whole_batch(tiny_tokenizer, models_dir):
    rows, tasks, retrieved = toy_rollouts(tiny_tokenizer)
    runs = []
    for micro_batch in (0, 1):
        cfg = smoke(**{"distill.micro_batch": micro_batch, "distill.lopd.lr_composer": 1e-3, "distill.lr_student": 1e-3})
        policies, composer = build(cfg, models_dir)
        algo = LOPD(cfg.distill, policies, composer)
        runs.append([algo.step(StepInputs(step=s, trajectories=rows, tasks=tasks, retrieved=retrieved)) for s in range(2)])
    assert runs[1][0]["distill/micro_batches"] == 2 and runs[0][0]["distill/micro_batches"] == 1
    # Δ, the margin term and β (driven by Δ) are means of differences of float32 token log-probs of size
    # ~log(vocab) ≈ 11, so summation order alone moves them by ~1e-6; a wrong micro-batch weighting moves
    # them by their own size (~1e-3).
    loose = {"distill/privilege_delta", "distill/margin_delta", "distill/beta"}
    for a, b in zip(*runs, strict=True):
        for key in ("distill/kl_topk", "distill/composer_kl", "distill/privilege_delta", "distill/margin_delta",
                    "distill/beta", "distill/anchor", "distill/composer_grad_norm", "distill/student_grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5 if key in loose else 1e-7), key


def test_privilege_summary_splits_by_outcome_and_sums_the_opener():
    from lopd_core.algorithms.lopd import privilege_summary

    rewards = torch.tensor([1.0, 0.6, 0.0, 0.0])  # a success, partial credit (neither), two failures
    m = privilege_summary(torch.tensor([0.1, 9.0, -0.2, -0.4]), torch.tensor([0.5, 9.0, -1.0, 0.0]),
                          torch.tensor([2.0, 9.0, 1.0, -3.0]), rewards, success_reward=0.8, failure_reward=0.5)
    assert m["distill/privilege_success"] == pytest.approx(0.1) and m["distill/privilege_failure"] == pytest.approx(-0.3)
    assert m["distill/privilege_first_token"] == pytest.approx(0.5) and m["distill/successes_scored"] == 1
    assert m["distill/privilege_opener"] == pytest.approx(2.0) and m["distill/privilege_opener_failure"] == pytest.approx(-1.0)
    assert math.isnan(privilege_summary(*(torch.zeros(1),) * 3, torch.zeros(1), success_reward=0.8,
                                        failure_reward=0.5)["distill/privilege_opener"])  # no success: undefined
