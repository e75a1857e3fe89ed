"""The teacher-privilege probe (benchmarks/teacher_privilege.py): its δ figures are what they say they are.

The end-to-end run of the script on a finished comparison is in tests/test_compare.py; here the pieces its
numbers rest on are checked against values computed another way: the base model's token log-probs and the
text-context teacher's (against plain forward passes of the model on the sequences they should score) and
the summary of δ = log p_teacher − log p_base (against hand-made log-probs whose summary is known).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from benchmarks.teacher_privilege import base_logprobs, summarize
from lopd_core.algorithms.synthetic import make_trajectory
from lopd_core.config import load_config
from lopd_core.models.policy import build_policy_set


def scored(logprobs: list[float], top1: list[int]) -> torch.Tensor:
    """One episode as the probe carries it: row 0 the token log-probs, row 1 the top-1 token ids."""
    return torch.tensor([logprobs, [float(t) for t in top1]])


def assert_forward_scores(policies, ids: list[int], positions: list[int], scores: torch.Tensor) -> None:
    """``scores`` (the probe's rows: token log-probs, top-1 ids) are the base model's own, from one plain
    forward pass over ``ids``, at the action tokens ``positions``."""
    with torch.no_grad():
        logits = policies.base(input_ids=torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits[[p - 1 for p in positions]], -1)
    want = expected[torch.arange(len(positions)), [ids[p] for p in positions]]
    assert scores.shape == (2, len(positions))
    torch.testing.assert_close(scores[0], want, atol=1e-4, rtol=1e-4)
    assert scores[1].tolist() == expected.argmax(-1).float().tolist()  # the model's top-1 at each action


def test_summary_of_deltas_matches_hand_computed_values():
    rows = [SimpleNamespace(success=True, reward=1.0), SimpleNamespace(success=False, reward=0.25)]
    base = [scored([-1.0, -2.0, -3.0], [5, 6, 7]), scored([-1.0, -1.0], [8, 9])]
    teacher = [scored([-0.5, -2.5, -2.0], [5, 1, 1]), scored([-3.0, -1.5], [4, 9])]
    # δ: success episode [+0.5, −0.5, +1.0], failed episode [−2.0, −0.5]
    got = summarize(teacher, base, rows)
    assert got["delta_success_tokens"] == pytest.approx(1.0 / 3)
    assert got["delta_failure_tokens"] == pytest.approx(-1.25)
    # A = 2r − 1: +1 for the success, −0.5 for the failure; token-weighted over the 5 tokens
    assert got["outcome_signed_delta"] == pytest.approx((1.0 * 1.0 + -0.5 * -2.5) / 5)
    assert got["delta_first_token"] == pytest.approx((0.5 - 2.0) / 2)
    assert got["delta_first_token_successes"] == pytest.approx(0.5)
    assert got["first_token_top1_agreement"] == pytest.approx(0.5)  # 5 == 5, 4 != 8
    # no failed episodes: the failure figure is undefined, not zero
    assert math.isnan(summarize(teacher[:1], base[:1], rows[:1])["delta_failure_tokens"])


def test_base_logprobs_are_the_models_own_next_token_logprobs(models_dir):
    cfg = load_config("smoke")
    torch.manual_seed(0)
    policies = build_policy_set(cfg.model, cfg.distill.lopd, models_dir, device="cpu")
    tok = policies.tokenizer
    rows = [make_trajectory(tok, task_id=f"t{i}", instruction=f"What is {i}+3?",
                            replies=['<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', f"It is {i + 3}."],
                            observations=[f"<tool_response>{i + 3}</tool_response>"], reward=float(i % 2))
            for i in range(5)]  # 5 rows: two batches of the probe (it scores four at a time)
    got = base_logprobs(policies, rows)

    assert len(got) == len(rows)
    for row, scores in zip(rows, got, strict=True):
        assert_forward_scores(policies, row.token_ids, [i for i, m in enumerate(row.assistant_mask) if m], scores)


def test_text_teacher_logprobs_are_the_models_logprobs_behind_the_text_context(models_dir):
    """The text-context teacher's per-episode scores: a plain forward pass of the base model on the task
    prompt with the experiences as text, followed by the episode's own continuation, read at its actions."""
    from benchmarks.teacher_privilege import token_logprobs
    from lopd_core.algorithms.lopd import LOPD
    from lopd_core.algorithms.synthetic import experience_of
    from lopd_core.models.composer import experience_turns
    from lopd_core.models.latent import experiences_prompt

    cfg = load_config("smoke").with_overrides({"distill.lopd.context": "text", "distill.micro_batch": 2})
    torch.manual_seed(0)
    policies = build_policy_set(cfg.model, cfg.distill.lopd, models_dir, device="cpu")
    tok = policies.tokenizer
    rows = [make_trajectory(tok, task_id=f"t{i}", instruction=f"What is {i}+3?" + " Be brief." * i,
                            replies=['<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
                                     f"It is {i + 3}." + " Done." * i],
                            observations=[f"<tool_response>{i + 3}</tool_response>"], reward=float(i % 2))
            for i in range(3)]  # prompts and replies of different lengths over two micro-batches: padding and row splits
    experiences = [[experience_of(rows[(i + 1) % 3]), experience_of(rows[(i + 2) % 3])][: i + 1] for i in range(3)]
    got = token_logprobs(LOPD(cfg.distill, policies, None), rows, experiences)

    assert len(got) == len(rows)
    max_tokens = cfg.distill.lopd.experience_max_tokens
    for row, exps, scores in zip(rows, experiences, got, strict=True):
        turns = [experience_turns(tok, e, max_tokens=max_tokens) for e in exps]
        prompt = experiences_prompt(tok, row.messages[: row.initial_messages], row.tools, turns,
                                    placement=cfg.distill.lopd.context_placement).ids
        shift = len(prompt) - row.prompt_len
        assert_forward_scores(policies, [*prompt, *row.token_ids[row.prompt_len:]],
                              [i + shift for i, m in enumerate(row.assistant_mask) if m], scores)
