"""Shared prompt prefixes: the student's step and the teacher's log-probs are the same with a prefix run once.

Real forwards and backwards of the tiny Llama under its LoRA student; rollouts of two "domains" (two long
system prompts) so that micro-batches share prefixes within a domain and not across.
"""

from __future__ import annotations

import torch

from lopd_core.algorithms.batch import student_batch
from lopd_core.algorithms.grouping import grouped_slices, prefix_groups, prefix_order
from lopd_core.algorithms.logprobs import gather_tokens, student_logprobs
from lopd_core.algorithms.prefix import FrozenPrefixCache, StudentForwards, plan_prefixes
from lopd_core.algorithms.synthetic import make_trajectory
from lopd_core.config import load_config
from lopd_core.models.policy import build_policy_set

SYSTEMS = {"bank": "You are a bank assistant. " + "Tools: get_balance(account) returns the balance. " * 6,
           "shop": "You are a shop assistant. " + "Tools: get_order(id) returns the order and its status. " * 6}


def rollouts(tok):
    rows = []
    for domain, system in SYSTEMS.items():
        for k, reply in enumerate(["It is 5.", "The answer is twenty.", "Done: 7 items were found here."]):
            rows.append(make_trajectory(tok, task_id=f"{domain}-{k}", instruction=f"Question {k} about {domain}?",
                                        replies=[reply], system=system, family=domain, reward=float(k % 2)))
    return rows


def policy_set(models_dir, seed=0):
    torch.manual_seed(seed)
    cfg = load_config("smoke")
    policies = build_policy_set(cfg.model, cfg.distill.lopd, models_dir, device="cpu")
    with torch.no_grad():  # a LoRA student that differs from the base, so its gradient is not trivial
        for p in policies.student_parameters():
            p.add_(0.05 * torch.randn_like(p))
    return policies


def nll_step_gradients(policies, batches, *, share: bool):
    for p in policies.student_parameters():
        p.grad = None
    n_tokens = sum(b.n_tokens for b in batches)
    forwards = StudentForwards(policies, batches, share=share, min_length=16)
    values = []
    for i, batch in enumerate(batches):
        lp = forwards.logprobs(i)
        values.append(lp.detach())
        (-gather_tokens(lp, batch.target_ids[batch.mask.bool()]).sum() / n_tokens).backward()
    forwards.finish()
    return values, [p.grad.clone() for p in policies.student_parameters()], forwards


def test_ordering_groups_rollouts_by_prefix_and_slices_stop_at_group_boundaries(tiny_tokenizer):
    rows = rollouts(tiny_tokenizer)
    mixed = [rows[i] for i in (0, 3, 1, 4, 2, 5)]
    order = prefix_order([r.token_ids for r in mixed], min_length=16)
    domains = [mixed[i].family for i in order]
    assert domains in (["bank"] * 3 + ["shop"] * 3, ["shop"] * 3 + ["bank"] * 3)
    lengths = [len(mixed[i].token_ids) for i in order]
    assert lengths[:3] == sorted(lengths[:3]) and lengths[3:] == sorted(lengths[3:])
    groups = prefix_groups([mixed[i].token_ids for i in order], min_length=16)
    assert groups == [0, 0, 0, 1, 1, 1]
    assert grouped_slices(groups, 2) == [slice(0, 2), slice(2, 3), slice(3, 5), slice(5, 6)]
    assert grouped_slices(groups, 3) == [slice(0, 3), slice(3, 6)] and grouped_slices(groups, 0) == [slice(0, 6)]


def test_student_step_with_shared_prefixes_equals_the_whole_sequence_step(tiny_tokenizer, models_dir):
    rows = rollouts(tiny_tokenizer)
    pad = tiny_tokenizer.pad_token_id
    parts = [slice(0, 2), slice(2, 3), slice(3, 5), slice(5, 6)]
    batches = [student_batch(rows[p], pad_id=pad, device="cpu") for p in parts]
    plan = plan_prefixes(batches, min_length=16)
    assert [g for g, _ in plan] == [0, 0, 1, 1] and all(length >= 16 for _, length in plan)
    policies = policy_set(models_dir)
    whole_values, whole_grads, _ = nll_step_gradients(policies, batches, share=False)
    shared_values, shared_grads, forwards = nll_step_gradients(policies, batches, share=True)
    assert forwards.saved_positions > forwards.prefix_positions > 0
    for a, b in zip(whole_values, shared_values, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert sum(float(g.abs().sum()) for g in whole_grads) > 0
    for a, b in zip(whole_grads, shared_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    # without the prefix's own backward the gradient is wrong: finish() is what makes it exact
    for p in policies.student_parameters():
        p.grad = None
    forwards = StudentForwards(policies, batches, min_length=16)
    n_tokens = sum(b.n_tokens for b in batches)
    lp = forwards.logprobs(0)
    (-gather_tokens(lp, batches[0].target_ids[batches[0].mask.bool()]).sum() / n_tokens).backward()
    truncated = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in policies.student_parameters()]
    forwards.finish()
    assert any(not torch.allclose(t, p.grad) for t, p in zip(truncated, policies.student_parameters(), strict=True))


def test_without_gradients_the_prefix_is_plain_and_logprobs_match(tiny_tokenizer, models_dir):
    rows = rollouts(tiny_tokenizer)
    batch = student_batch(rows[:3], pad_id=tiny_tokenizer.pad_token_id, device="cpu")
    policies = policy_set(models_dir)
    with torch.no_grad():
        forwards = StudentForwards(policies, [batch], min_length=16)
        torch.testing.assert_close(forwards.logprobs(0), student_logprobs(policies, batch), atol=1e-5, rtol=1e-5)
        forwards.finish()


def test_frozen_prefix_cache_computes_each_prefix_once(tiny_tokenizer, models_dir):
    from lopd_core.algorithms.prefix import hidden_after_prefix
    from lopd_core.models.policy import hidden_states

    rows = rollouts(tiny_tokenizer)
    batch = student_batch([rows[0], rows[3], rows[1]], pad_id=tiny_tokenizer.pad_token_id, device="cpu")
    policies = policy_set(models_dir)
    cache = FrozenPrefixCache(limit=4)
    length = 16
    with torch.no_grad(), policies.teacher() as teacher:
        whole = hidden_states(teacher, input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        for _ in range(2):
            kv = cache.rows(teacher, batch.input_ids[:, :length])
            after = hidden_after_prefix(teacher, kv, batch.attention_mask, input_ids=batch.input_ids[:, length:])
            real = batch.attention_mask[:, length:].bool()
            torch.testing.assert_close(after[real], whole[:, length:][real], atol=1e-5, rtol=1e-5)
    assert cache.misses == 2 and cache.hits == 4  # rows 0 and 2 share their first 16 tokens (one domain)


def test_lopd_step_with_shared_prefixes_and_one_teacher_forward_equals_the_plain_step(tiny_tokenizer, models_dir):
    """distill.share_prefix and distill.lopd.reuse_teacher_forward change which forwards run, not the step."""
    import pytest

    from lopd_core.algorithms.base import StepInputs
    from lopd_core.algorithms.lopd import LOPD
    from lopd_core.algorithms.synthetic import experience_of, task_of
    from lopd_core.models.composer import freeze_phi0, new_composer_state

    rows = rollouts(tiny_tokenizer)
    rows = [rows[i] for i in (0, 3, 1, 4, 2, 5)]
    exps = {d: [experience_of(make_trajectory(tiny_tokenizer, task_id=f"{d}-old", instruction="Earlier question?",
                                              replies=["It was 3."], system=s, family=d))] for d, s in SYSTEMS.items()}
    tasks, retrieved = [task_of(r) for r in rows], [exps[r.family] for r in rows]
    runs = []
    for fast in (False, True):
        cfg = load_config("smoke").with_overrides({"distill.micro_batch": 2, "distill.share_prefix": fast,
                                                   "distill.lopd.reuse_teacher_forward": fast,
                                                   "distill.lopd.lr_composer": 1e-3, "distill.lr_student": 1e-3})
        torch.manual_seed(0)
        policies = build_policy_set(cfg.model, cfg.distill.lopd, models_dir, device="cpu")
        with torch.no_grad():
            policies.base.get_input_embeddings().weight.mul_(30.0)  # peaked distributions: KL and δ are not ≈ 0
            for p in policies.student_parameters():  # a student that differs from the teacher
                p.add_(1.0 * torch.randn_like(p))
        composer = new_composer_state(policies, cfg.distill.lopd, seed=0)
        freeze_phi0(policies, composer)
        algo = LOPD(cfg.distill, policies, composer)
        start = [p.detach().clone() for p in [*policies.student_parameters(), *composer.compressor.parameters()]]
        metrics = [algo.step(StepInputs(step=s, trajectories=rows, tasks=tasks, retrieved=retrieved)) for s in range(2)]
        end = [p.detach() for p in [*policies.student_parameters(), *composer.compressor.parameters()]]
        runs.append((metrics, torch.cat([(e - s).flatten() for s, e in zip(start, end, strict=True)])))
    (plain, moved_plain), (fast, moved_fast) = runs
    assert fast[0]["distill/prefix_saved_positions"] > 0 == plain[0]["distill/prefix_saved_positions"]
    assert plain[0]["distill/kl_topk"] > 1e-4 and plain[1]["distill/composer_grad_norm"] > 1e-4
    for a, b in zip(plain, fast, strict=True):
        for key in ("distill/kl_topk", "distill/composer_kl", "distill/privilege_delta", "distill/student_grad_norm",
                    "distill/composer_grad_norm", "distill/beta", "distill/supervised_tokens"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), key
    # Adam normalises each element's gradient, so elements whose gradient is ~0 move by float noise: compare
    # the whole update instead of element by element
    assert float((moved_fast - moved_plain).norm() / moved_plain.norm()) < 0.02
