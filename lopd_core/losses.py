"""The losses of LOPD and of its baselines, as pure functions of log-prob tensors.

What this module is: the maths of docs/method.md ("Objectives" and the baselines table), one function
per term, each returning *per-token* values (no reduction) over arbitrary leading dimensions, plus the
two reductions the method uses (a global token mean and a per-rollout token mean). Tensors are
positional, hyper-parameters keyword-only; invalid hyper-parameters raise ``ValueError`` naming the value.

What it is not: nothing here runs a model, builds a mask from token ids or knows about trajectories. The
caller gathers log-probs at supervised positions (temperature 1, from the trainer's own forward pass) and
passes a ``mask`` that is 1 on real supervised tokens and 0 on padding.

Conventions used throughout:

- ``*_logprobs`` over the vocabulary have shape ``[..., V]``; ``*_topm_logprobs`` are log-probs of the
  same M token ids for both models, shape ``[..., M]``; ``*_token_logprobs`` are log-probs of the sampled
  token, shape ``[...]``.
- Full-vocabulary functions accept logits or log-probs: ``log_softmax`` is applied, and it is idempotent on
  log-probs.
- Where the spec says one side of a divergence is a constant, the function has a ``grad_to`` argument and
  detaches the other side itself, so a caller cannot get the gradient placement wrong by forgetting a
  ``.detach()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

GradTo = Literal["student", "teacher", "both"]


def _check_grad_to(grad_to: str) -> None:
    if grad_to not in ("student", "teacher", "both"):
        raise ValueError(f"grad_to must be 'student', 'teacher' or 'both', got {grad_to!r}")


def _place_gradient(student: Tensor, teacher: Tensor, grad_to: str) -> tuple[Tensor, Tensor]:
    _check_grad_to(grad_to)
    if grad_to == "student":
        teacher = teacher.detach()
    elif grad_to == "teacher":
        student = student.detach()
    return student, teacher


def _kl(p_logprobs: Tensor, q_logprobs: Tensor) -> Tensor:
    """KL(p‖q) over the last dimension, from finite log-probs (one fused elementwise kernel, ~1.5× faster
    than the unfused form on [N, 49152]); a bucket whose probability underflows to 0 contributes 0."""
    return F.kl_div(q_logprobs, p_logprobs, reduction="none", log_target=True).sum(-1)


# --------------------------------------------------------------------------------------------------
# Top-M + tail bucket
def append_tail_bucket(topm_logprobs: Tensor, *, tail_floor: float = 1e-12) -> Tensor:
    """Project a distribution onto M ids plus one tail bucket: ``[..., M]`` → ``[..., M + 1]`` log-probs.

    The tail bucket holds ``1 − Σ_m p_m`` (the mass outside the M ids), computed as
    ``log(−expm1(logsumexp))`` which stays accurate when the M ids carry almost all the mass. The tail is
    floored at ``tail_floor`` so that M = V (tail mass exactly 0 for both models) gives identical tails on
    both sides and a zero contribution instead of ``log 0``.
    """
    if not tail_floor > 0:
        raise ValueError(f"tail_floor must be > 0, got {tail_floor}")
    mass_logprob = torch.logsumexp(topm_logprobs, dim=-1, keepdim=True).clamp(max=0.0)
    tail = torch.log((-torch.expm1(mass_logprob)).clamp(min=tail_floor))
    return torch.cat([topm_logprobs, tail], dim=-1)


def topm_tail_reverse_kl(student_topm_logprobs: Tensor, teacher_topm_logprobs: Tensor, *,
                         grad_to: GradTo = "student", tail_floor: float = 1e-12) -> Tensor:
    """Reverse KL ``KL(p̃^S ‖ p̃^T)`` on an M-id support plus a tail bucket, per token: ``[..., M]`` → ``[...]``.

    Both inputs are full-vocabulary log-probs (temperature 1) gathered at the same M ids: the teacher's
    top-M for LOPD, the student's top-K for SDPO. Projecting both models onto the same M + 1 buckets makes
    this an exact KL between two proper distributions; with M = V it equals the full-vocabulary reverse KL.
    ``grad_to='student'`` (student phase: the teacher is a constant), ``'teacher'`` (composer phase: the
    student's pre-update distribution is a constant) or ``'both'``.
    """
    if student_topm_logprobs.shape != teacher_topm_logprobs.shape:
        raise ValueError(f"student and teacher top-M log-probs must have the same shape, got "
                         f"{tuple(student_topm_logprobs.shape)} and {tuple(teacher_topm_logprobs.shape)}")
    student, teacher = _place_gradient(student_topm_logprobs, teacher_topm_logprobs, grad_to)
    return _kl(append_tail_bucket(student, tail_floor=tail_floor), append_tail_bucket(teacher, tail_floor=tail_floor))


# --------------------------------------------------------------------------------------------------
# Full-vocabulary divergences (OPSD, the memory benchmark)
def forward_kl(student_logits: Tensor, teacher_logits: Tensor, *, grad_to: GradTo = "student") -> Tensor:
    """``KL(p^T ‖ p^S)`` over the full vocabulary, per token (mode-covering; OPSD as LOPD ran it)."""
    student, teacher = _place_gradient(student_logits, teacher_logits, grad_to)
    return _kl(torch.log_softmax(teacher, -1), torch.log_softmax(student, -1))


def reverse_kl(student_logits: Tensor, teacher_logits: Tensor, *, grad_to: GradTo = "student") -> Tensor:
    """``KL(p^S ‖ p^T)`` over the full vocabulary, per token (mode-seeking)."""
    student, teacher = _place_gradient(student_logits, teacher_logits, grad_to)
    return _kl(torch.log_softmax(student, -1), torch.log_softmax(teacher, -1))


def generalized_jsd(student_logits: Tensor, teacher_logits: Tensor, *, jsd_beta: float,
                    grad_to: GradTo = "student") -> Tensor:
    """Generalized Jensen–Shannon divergence with TRL GKD's convention, per token.

    With the mixture ``μ = jsd_beta·p^T + (1 − jsd_beta)·p^S``:
    ``JSD = jsd_beta·KL(p^T ‖ μ) + (1 − jsd_beta)·KL(p^S ‖ μ)``. The endpoints, where that expression
    vanishes, are defined as the limits' named divergences: ``jsd_beta = 0`` → forward ``KL(p^T ‖ p^S)``,
    ``jsd_beta = 1`` → reverse ``KL(p^S ‖ p^T)``. ``jsd_beta = 0.5`` is the symmetric JSD (≤ log 2).
    """
    if not 0.0 <= jsd_beta <= 1.0:
        raise ValueError(f"jsd_beta must be in [0, 1], got {jsd_beta}")
    if jsd_beta == 0.0:
        return forward_kl(student_logits, teacher_logits, grad_to=grad_to)
    if jsd_beta == 1.0:
        return reverse_kl(student_logits, teacher_logits, grad_to=grad_to)
    student, teacher = _place_gradient(student_logits, teacher_logits, grad_to)
    student_logprobs, teacher_logprobs = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    mixture_logprobs = torch.logsumexp(
        torch.stack([teacher_logprobs + math.log(jsd_beta), student_logprobs + math.log(1.0 - jsd_beta)]), dim=0)
    return jsd_beta * _kl(teacher_logprobs, mixture_logprobs) + (1.0 - jsd_beta) * _kl(student_logprobs, mixture_logprobs)


# --------------------------------------------------------------------------------------------------
# Sampled-token terms (importance sampling, policy gradient)
def clipped_importance_weight(token_logprobs: Tensor, behaviour_logprobs: Tensor, *, clip: float) -> Tensor:
    """``min(π(a)/μ(a), clip)``, detached: corrects for sampling at temperature 0.7 / top-p / top-k (μ)."""
    if not clip > 0:
        raise ValueError(f"importance-sampling clip must be > 0, got {clip}")
    return torch.exp(token_logprobs.detach() - behaviour_logprobs).clamp(max=clip)


def sampled_token_reverse_kl(student_token_logprobs: Tensor, teacher_token_logprobs: Tensor,
                             behaviour_logprobs: Tensor, *, is_clip: float) -> Tensor:
    """Importance-weighted single-sample estimate of ``KL(p^S ‖ p^T)`` at the sampled token, per token.

    With ``k = log p^S(a) − log p^T(a)`` and ``w = min(p^S(a)/μ(a), is_clip)`` (detached), the value is
    ``w·k`` and the gradient w.r.t. the student is the score-function estimator ``w·k·∇log p^S(a)``: the
    pathwise gradient of ``k`` alone, ``∇log p^S(a)``, has zero expectation under the student, so it would
    not move the student toward the teacher. The teacher side is a constant.
    """
    weight = clipped_importance_weight(student_token_logprobs, behaviour_logprobs, clip=is_clip)
    k1 = (student_token_logprobs - teacher_token_logprobs).detach()
    score = student_token_logprobs - student_token_logprobs.detach()  # value 0, gradient ∇log p^S(a)
    return weight * k1 * (1.0 + score)


def group_normalized_advantages(rewards: Tensor, *, group_size: int, eps: float = 1e-4) -> Tensor:
    """GRPO advantages ``(r − mean_group) / (std_group + eps)`` for rewards laid out group after group.

    ``std`` is the unbiased sample standard deviation (as TRL's GRPO); a group whose rewards are all equal
    gets advantage 0 for every member (no signal, no update).
    """
    if group_size < 1 or rewards.shape[-1] % group_size:
        raise ValueError(f"group_size ({group_size}) must divide the number of rewards ({rewards.shape[-1]})")
    grouped = rewards.reshape(*rewards.shape[:-1], -1, group_size)
    mean = grouped.mean(-1, keepdim=True)
    std = grouped.std(-1, keepdim=True, unbiased=True) if group_size > 1 else torch.zeros_like(mean)
    return ((grouped - mean) / (std + eps)).reshape(rewards.shape)


def ppo_clip_loss(token_logprobs: Tensor, old_token_logprobs: Tensor, advantages: Tensor, *,
                  clip_low: float, clip_high: float | None = None) -> Tensor:
    """PPO-clip surrogate loss ``−min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A)`` per token.

    ``ρ = exp(log π_θ(a) − log π_old(a))``; ``old_token_logprobs`` are detached. ``clip_high`` defaults to
    ``clip_low`` (symmetric, GRPO's ε = 0.2); Skill-SD uses clip-higher 0.2 / 0.28. ``advantages`` broadcast
    against the token tensor (e.g. ``[B, 1]`` for one advantage per rollout).
    """
    clip_high = clip_low if clip_high is None else clip_high
    if not (0 < clip_low < 1 and clip_high > 0):
        raise ValueError(f"PPO clip range must satisfy 0 < clip_low < 1 and clip_high > 0, got {clip_low}, {clip_high}")
    ratio = torch.exp(token_logprobs - old_token_logprobs.detach())
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


# --------------------------------------------------------------------------------------------------
# Privilege, margin, anchor, dual step (LOPD's constraint; depend on φ only)
def privilege_delta(teacher_token_logprobs: Tensor, student_token_logprobs: Tensor) -> Tensor:
    """Per-token privilege ``δ = log p^T(a | latents) − stopgrad(log p^S(a))`` (a gather, no extra forward)."""
    return teacher_token_logprobs - student_token_logprobs.detach()


def outcome_advantage(rewards: Tensor) -> Tensor:
    """``A(τ) = 2·r(τ) − 1`` for rewards in [0, 1]: +1 for a success, −1 for a failure."""
    return 2.0 * rewards - 1.0


def outcome_signed_margin(delta: Tensor, rewards: Tensor, mask: Tensor) -> Tensor:
    """``Δ(φ)``: per rollout the token mean of ``A·δ``, then the mean over rollouts that have tokens.

    ``delta`` and ``mask`` are ``[B, S]`` (supervised tokens of each rollout, padded), ``rewards`` ``[B]``.
    A positive Δ means the latent-conditioned teacher raises the student's successful tokens and lowers
    its failed ones: the context carries information the student lacks.
    """
    per_rollout = rollout_token_mean(delta * outcome_advantage(rewards)[..., None], mask)
    return mean_over_rollouts(per_rollout, mask)


def token_weighted_margin(delta: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """``Δ̂ = Σ_i A_i Σ_t δ_it / Σ_i T_i``, the token-weighted batch estimate the dual step uses (detached).

    ``advantages`` broadcast against ``delta`` (``[B, 1]`` for padded ``[B, S]`` tensors, or one value per
    token for flat ones with a mask of ones): micro-batches concatenated flat give the step's estimate.
    """
    return (delta.detach() * advantages * mask).sum() / mask.sum().clamp(min=1)


def margin_weights(rewards: Tensor, *, form: Literal["signed", "balanced"] = "signed", success_reward: float = 0.8,
                   failure_reward: float = 0.5) -> Tensor:
    """Per-rollout weights ``w_i`` with ``Δ = Σ_i w_i · mean_t δ_it`` over a step's rollouts.

    ``signed`` (the paper): ``w_i = (2r_i − 1)/n``. Since E_student[δ] = −KL(S‖T), this Δ is about
    (1 − 2r̄)·KL + Cov(A, δ): at a low success rate a teacher that is merely less confident everywhere
    meets the margin. ``balanced``: ``+1/n_s`` for the ``n_s`` successes (r ≥ ``success_reward``), ``−1/n_f``
    for the ``n_f`` failures (r < ``failure_reward``), 0 for partial credit, so Δ = mean δ on successes − mean
    δ on failures, which a uniform shift of δ does not move; all zero when either group is empty (no
    signal). Written as weights so that each micro-batch adds its share and the shares sum to the step's Δ.
    """
    if form == "signed":
        return outcome_advantage(rewards) / max(rewards.shape[-1], 1)
    if form != "balanced":
        raise ValueError(f"margin form must be 'signed' or 'balanced', got {form!r}")
    if not failure_reward <= success_reward:
        raise ValueError(f"failure_reward ({failure_reward}) must not exceed success_reward ({success_reward})")
    success, failure = (rewards >= success_reward).float(), (rewards < failure_reward).float()
    n_success, n_failure = success.sum(), failure.sum()
    if n_success == 0 or n_failure == 0:
        return torch.zeros_like(rewards)
    return success / n_success - failure / n_failure


def privilege_margin(delta: Tensor, mask: Tensor, weights: Tensor) -> Tensor:
    """``Σ_i w_i · (token mean of δ over rollout i)`` for ``delta``/``mask`` ``[B, S]`` and ``weights`` ``[B]``."""
    return (rollout_token_mean(delta, mask) * weights).sum()


@dataclass
class ComposerObjective:
    """One micro-batch's share of the composer's loss and of each of its terms (shares add up over a step)."""

    loss: Tensor
    kl: Tensor
    margin: Tensor
    """Its share of Δ (:func:`privilege_margin`)."""
    anchor: Tensor


def composer_objective(kl_tokens: Tensor, delta: Tensor, mask: Tensor, weights: Tensor, *, n_rollouts: int,
                       beta: float, margin: float, latents: Tensor | None = None,
                       anchor_latents: Tensor | None = None, anchor_weight: float = 0.0,
                       n_anchor_values: int = 1, anchor_scale: float = 1.0,
                       margin_share: float | None = None) -> ComposerObjective:
    """LOPD's loss for φ on a micro-batch of ``B`` of the step's ``n_rollouts`` rollouts.

    ``KL + β·(m − Δ) + λ·anchor`` where KL is the per-rollout token mean of ``kl_tokens`` (the top-M + tail
    ``KL(p̃^S_old ‖ p̃^T)``, teacher side differentiable) averaged over rollouts, Δ the weighted privilege
    margin with ``weights`` (:func:`margin_weights`) and the anchor the mean squared distance of the latents
    to the cold-start composer's (over ``n_anchor_values`` elements in the step). Each term is this
    micro-batch's share of the step's mean, so backpropagating every micro-batch's ``loss`` accumulates the
    gradient of the whole step. ``margin = 0`` drops the constraint (the paper's ablation); the anchor needs
    ``latents`` and ``anchor_latents`` (it is 0 without them or with ``anchor_weight = 0``). ``anchor_scale``
    measures the squared distance in other units (``1/gain²``: units of the input-embedding RMS).
    ``margin_share`` is the share of the constant β·m this micro-batch carries (default ``B / n_rollouts``;
    0 for rows that only enter Δ, such as re-scored bank successes).
    """
    if n_rollouts < 1:
        raise ValueError(f"n_rollouts must be at least 1, got {n_rollouts}")
    kl = rollout_token_mean(kl_tokens, mask).sum() / n_rollouts
    delta_share = privilege_margin(delta, mask, weights)
    loss = kl
    if margin > 0:
        constant = mask.shape[0] / n_rollouts if margin_share is None else margin_share
        loss = loss + beta * (margin * constant - delta_share)
    anchor = kl.new_zeros(())
    if anchor_weight > 0 and latents is not None and anchor_latents is not None:
        if latents.shape != anchor_latents.shape:
            raise ValueError(f"latents {tuple(latents.shape)} and anchor latents {tuple(anchor_latents.shape)} differ")
        anchor = (latents - anchor_latents.detach()).pow(2).sum() * anchor_scale / n_anchor_values
        loss = loss + anchor_weight * anchor
    return ComposerObjective(loss=loss, kl=kl, margin=delta_share, anchor=anchor)


def latent_anchor(latents: Tensor, anchor_latents: Tensor) -> Tensor:
    """``mean((c_φ − stopgrad(c_φ0))²)`` over all elements: keeps the latents near the cold-start composer's."""
    if latents.shape != anchor_latents.shape:
        raise ValueError(f"latents {tuple(latents.shape)} and anchor latents {tuple(anchor_latents.shape)} differ in shape")
    return (latents - anchor_latents.detach()).pow(2).mean()


def dual_ascent(beta: float, margin_estimate: float, *, margin: float, lr: float) -> float:
    """Projected dual ascent on the margin constraint: ``β ← max(0, β + η·(m − Δ̂))``."""
    if not lr > 0:
        raise ValueError(f"dual step size (distill.lopd.dual_lr) must be > 0, got {lr}")
    return max(0.0, float(beta) + lr * (margin - float(margin_estimate)))


# --------------------------------------------------------------------------------------------------
# Reductions
def global_token_mean(values: Tensor, mask: Tensor) -> Tensor:
    """``Σ values·mask / Σ mask`` over everything: the student loss's global token mean (0 when no tokens)."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def rollout_token_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Token mean over the last dimension, per rollout: ``[B, S]`` → ``[B]`` (0 for a rollout without tokens)."""
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def mean_over_rollouts(per_rollout: Tensor, mask: Tensor) -> Tensor:
    """Mean of per-rollout values over the rollouts that have at least one supervised token."""
    has_tokens = (mask.sum(-1) > 0).to(per_rollout.dtype)
    return (per_rollout * has_tokens).sum() / has_tokens.sum().clamp(min=1)
