"""The loss functions against closed forms and hand-computed cases, and where their gradients go."""

import math

import pytest
import torch

from lopd_core import losses as L

torch.manual_seed(0)


def _logits(*shape):
    return torch.randn(*shape, dtype=torch.float64) * 2


def test_topm_with_m_equal_v_is_the_full_vocabulary_reverse_kl():
    student, teacher = _logits(3, 5, 11), _logits(3, 5, 11)
    s_lp, t_lp = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    ids = t_lp.argsort(-1, descending=True)  # the teacher's top-V = every id
    got = L.topm_tail_reverse_kl(s_lp.gather(-1, ids), t_lp.gather(-1, ids))
    want = L.reverse_kl(student, teacher)
    torch.testing.assert_close(got, want)
    manual = (s_lp.exp() * (s_lp - t_lp)).sum(-1)
    torch.testing.assert_close(want, manual)


def test_tail_bucket_holds_the_missing_mass_and_sums_to_one():
    lp = torch.log_softmax(_logits(4, 20), -1)
    ids = lp.topk(5, -1).indices
    projected = L.append_tail_bucket(lp.gather(-1, ids))
    assert projected.shape == (4, 6)
    torch.testing.assert_close(projected.exp().sum(-1), torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(projected[:, -1].exp(), 1 - lp.gather(-1, ids).exp().sum(-1))


def test_topm_tail_hand_computed_case():
    # teacher support {0, 1}: teacher p = (0.5, 0.3 | tail 0.2); student p = (0.2, 0.2 | tail 0.6)
    s = torch.log(torch.tensor([0.2, 0.2]))
    t = torch.log(torch.tensor([0.5, 0.3]))
    want = 0.2 * math.log(0.2 / 0.5) + 0.2 * math.log(0.2 / 0.3) + 0.6 * math.log(0.6 / 0.2)
    assert L.topm_tail_reverse_kl(s, t).item() == pytest.approx(want, rel=1e-5)
    assert L.topm_tail_reverse_kl(t, t).item() == pytest.approx(0.0, abs=1e-7)


def test_topm_tail_gradient_goes_only_where_asked():
    s = torch.log_softmax(torch.randn(2, 7), -1)[:, :3].clone().requires_grad_()
    t = torch.log_softmax(torch.randn(2, 7), -1)[:, :3].clone().requires_grad_()
    L.topm_tail_reverse_kl(s, t, grad_to="student").sum().backward()
    assert s.grad is not None and s.grad.abs().sum() > 0 and t.grad is None
    s.grad = None
    L.topm_tail_reverse_kl(s, t, grad_to="teacher").sum().backward()
    assert s.grad is None and t.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="grad_to"):
        L.topm_tail_reverse_kl(s, t, grad_to="nobody")


def test_jsd_endpoints_and_symmetric_midpoint():
    student, teacher = _logits(6, 9), _logits(6, 9)
    torch.testing.assert_close(L.generalized_jsd(student, teacher, jsd_beta=0.0), L.forward_kl(student, teacher))
    torch.testing.assert_close(L.generalized_jsd(student, teacher, jsd_beta=1.0), L.reverse_kl(student, teacher))
    p, q = torch.softmax(teacher, -1), torch.softmax(student, -1)
    m = 0.5 * (p + q)
    manual = 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)
    mid = L.generalized_jsd(student, teacher, jsd_beta=0.5)
    torch.testing.assert_close(mid, manual)
    assert (mid <= math.log(2) + 1e-9).all() and (mid >= 0).all()
    # near the endpoints the mixture form tends to 0, which is why the endpoints are special-cased
    assert L.generalized_jsd(student, teacher, jsd_beta=1e-6).max() < 1e-3
    with pytest.raises(ValueError, match="jsd_beta"):
        L.generalized_jsd(student, teacher, jsd_beta=1.5)


def test_forward_kl_hand_case_and_logprob_idempotence():
    t = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    s = torch.log(torch.tensor([0.4, 0.4, 0.2]))
    want = 0.7 * math.log(0.7 / 0.4) + 0.2 * math.log(0.2 / 0.4) + 0.1 * math.log(0.1 / 0.2)
    assert L.forward_kl(s, t).item() == pytest.approx(want, rel=1e-5)
    assert L.forward_kl(s + 3.0, t - 1.0).item() == pytest.approx(want, rel=1e-5)  # logits shift-invariant


def test_full_vocab_divergences_keep_the_teacher_constant():
    s, t = torch.randn(4, 10, requires_grad=True), torch.randn(4, 10, requires_grad=True)
    for fn in (L.forward_kl, L.reverse_kl, lambda a, b: L.generalized_jsd(a, b, jsd_beta=0.5)):
        s.grad = None
        fn(s, t).sum().backward()
        assert s.grad.abs().sum() > 0 and t.grad is None


def test_sampled_token_reverse_kl_value_and_score_function_gradient():
    logits = torch.randn(5, 8, requires_grad=True)
    a = torch.randint(0, 8, (5,))
    s_tok = torch.log_softmax(logits, -1).gather(-1, a[:, None])[:, 0]
    t_tok = torch.log_softmax(torch.randn(5, 8), -1).gather(-1, a[:, None])[:, 0]
    behaviour = s_tok.detach() - torch.tensor([0.0, 0.5, 1.0, 2.0, -1.0])  # ratios 1, e^.5, e, e^2 (clipped), e^-1
    out = L.sampled_token_reverse_kl(s_tok, t_tok, behaviour, is_clip=2.0)
    w = torch.tensor([1.0, math.exp(0.5), 2.0, 2.0, math.exp(-1.0)])
    torch.testing.assert_close(out, w * (s_tok - t_tok).detach())
    (got,) = torch.autograd.grad(out.sum(), logits, retain_graph=True)
    (expected,) = torch.autograd.grad((w * (s_tok - t_tok).detach() * s_tok).sum(), logits)
    torch.testing.assert_close(got, expected)
    assert got.abs().sum() > 0


def test_group_normalized_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    adv = L.group_normalized_advantages(r, group_size=4)
    std = torch.tensor([1.0, 0.0, 0.0, 0.0]).std()
    torch.testing.assert_close(adv[:4], (torch.tensor([1.0, 0, 0, 0]) - 0.25) / (std + 1e-4))
    assert torch.all(adv[4:] == 0)
    with pytest.raises(ValueError, match="group_size"):
        L.group_normalized_advantages(r, group_size=3)


def test_ppo_clip_sign_and_clipping():
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.0, 1.5, 0.5, 1.5])).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss = L.ppo_clip_loss(new, old, adv, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([-1.0, -1.28, 0.8, 1.5]))
    loss.sum().backward()
    # at ratio 1 the gradient is −A; clipped tokens get none; the pessimistic unclipped one keeps it
    torch.testing.assert_close(new.grad, torch.tensor([-1.0, 0.0, 0.0, 1.5]))


def test_privilege_margin_and_dual_step():
    teacher = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    student = torch.tensor([[-1.5, -2.5, -9.0], [-1.0, 0.0, -9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    rewards = torch.tensor([1.0, 0.0])
    delta = L.privilege_delta(teacher, student)
    torch.testing.assert_close(delta * mask, torch.tensor([[0.5, 0.5, 0.0], [0.5, -0.5, 0.0]]))
    margin = L.outcome_signed_margin(delta, rewards, mask)
    # rollout 0: A=+1, mean δ = 0.5; rollout 1: A=−1, mean δ = 0 → Δ = 0.25
    assert margin.item() == pytest.approx(0.25)
    margin.backward()
    assert student.grad is None and teacher.grad.abs().sum() > 0
    uneven = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    hat = L.token_weighted_margin(torch.ones(2, 3), L.outcome_advantage(rewards)[:, None], uneven)
    assert hat.item() == pytest.approx((3 - 1) / 4)
    assert L.dual_ascent(0.0, 0.0, margin=0.05, lr=0.5) == pytest.approx(0.025)
    assert L.dual_ascent(0.01, 1.0, margin=0.05, lr=0.5) == 0.0


def test_the_weighted_margin_is_the_outcome_signed_margin_and_micro_batch_shares_add_up():
    torch.manual_seed(0)
    delta, rewards = torch.randn(5, 7), torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0])
    mask = (torch.rand(5, 7) > 0.3).float()
    mask[:, 0] = 1.0
    weights = L.margin_weights(rewards)
    whole = L.privilege_margin(delta, mask, weights)
    torch.testing.assert_close(whole, L.outcome_signed_margin(delta, rewards, mask))
    shares = L.privilege_margin(delta[:2], mask[:2], weights[:2]) + L.privilege_margin(delta[2:], mask[2:], weights[2:])
    torch.testing.assert_close(shares, whole)


def test_composer_objective_is_kl_plus_margin_plus_anchor_and_splits_over_micro_batches():
    torch.manual_seed(1)
    kl, delta = torch.rand(4, 6), torch.randn(4, 6, requires_grad=True)
    mask = torch.ones(4, 6)
    mask[3, 4:] = 0.0
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    latents, anchor = torch.randn(8, 3, requires_grad=True), torch.randn(8, 3)
    weights = L.margin_weights(rewards)
    kw = dict(n_rollouts=4, beta=0.7, margin=0.05, anchor_weight=0.2, n_anchor_values=latents.numel())
    full = L.composer_objective(kl, delta, mask, weights, latents=latents, anchor_latents=anchor, **kw)
    expected_kl = L.mean_over_rollouts(L.rollout_token_mean(kl, mask), mask)
    expected = expected_kl + 0.7 * (0.05 - L.outcome_signed_margin(delta, rewards, mask)) + \
        0.2 * L.latent_anchor(latents, anchor)
    torch.testing.assert_close(full.loss, expected)
    halves = [L.composer_objective(kl[s], delta[s], mask[s], weights[s], latents=latents[t], anchor_latents=anchor[t],
                                   **kw) for s, t in ((slice(0, 2), slice(0, 4)), (slice(2, 4), slice(4, 8)))]
    torch.testing.assert_close(halves[0].loss + halves[1].loss, full.loss)
    full.loss.backward()
    assert delta.grad.abs().sum() > 0 and latents.grad.abs().sum() > 0
    no_margin = L.composer_objective(kl, delta, mask, weights, n_rollouts=4, beta=0.7, margin=0.0)
    torch.testing.assert_close(no_margin.loss, expected_kl)
    with pytest.raises(ValueError, match="n_rollouts"):
        L.composer_objective(kl, delta, mask, weights, n_rollouts=0, beta=0.0, margin=0.0)


def test_anchor_and_reductions():
    c = torch.ones(2, 4, 3, requires_grad=True)
    c0 = torch.zeros(2, 4, 3, requires_grad=True)
    anchor = L.latent_anchor(c, c0)
    assert anchor.item() == pytest.approx(1.0)
    anchor.backward()
    assert c0.grad is None and c.grad.abs().sum() > 0
    v = torch.tensor([[1.0, 3.0, 100.0], [2.0, 100.0, 100.0], [5.0, 5.0, 5.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert L.global_token_mean(v, m).item() == pytest.approx(2.0)
    torch.testing.assert_close(L.rollout_token_mean(v, m), torch.tensor([2.0, 2.0, 0.0]))
    assert L.mean_over_rollouts(L.rollout_token_mean(v, m), m).item() == pytest.approx(2.0)


def test_balanced_margin_ignores_a_uniform_shift_and_needs_both_outcomes():
    torch.manual_seed(2)
    delta, mask = torch.randn(4, 5), torch.ones(4, 5)
    rewards = torch.tensor([1.0, 0.9, 0.2, 0.6])  # two successes, one failure, one partial credit
    weights = L.margin_weights(rewards, form="balanced")
    torch.testing.assert_close(weights, torch.tensor([0.5, 0.5, -1.0, 0.0]))
    balanced = L.privilege_margin(delta, mask, weights)
    expected = delta[:2].mean(-1).mean() - delta[2].mean()
    torch.testing.assert_close(balanced, expected)
    # a teacher that is merely less confident everywhere (δ shifted down) neither meets nor misses it more
    torch.testing.assert_close(L.privilege_margin(delta - 0.3, mask, weights), balanced)
    # the paper's signed form at a low success rate is met by a less confident teacher
    rare = torch.tensor([1.0, 0.0, 0.0, 0.0])
    signed = L.margin_weights(rare, form="signed")
    assert L.privilege_margin(delta - 0.3, mask, signed) > L.privilege_margin(delta, mask, signed) + 0.1
    rare_balanced = L.margin_weights(rare, form="balanced")
    torch.testing.assert_close(L.privilege_margin(delta - 0.3, mask, rare_balanced),
                               L.privilege_margin(delta, mask, rare_balanced))
    assert not L.margin_weights(torch.tensor([1.0, 0.9, 0.6]), form="balanced").any()  # no failure: no signal
    with pytest.raises(ValueError, match="margin form"):
        L.margin_weights(rewards, form="other")
