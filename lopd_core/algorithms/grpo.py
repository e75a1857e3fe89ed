"""GRPO (RLVR baseline): PPO-clip with group-normalised advantages, no teacher, no privileged context.

What it is: B/G tasks × G rollouts per step; each rollout's advantage is ``(r − mean_group) / std_group``
over the group's usable (non-errored) rollouts; loss = PPO-clip (ε = ``distill.grpo.clip_eps``) on every
supervised token, global token mean; one AdamW step. The "old" log-probs are the trainer's own
temperature-1 forward before the step (the rollout engine's temperature-0.7 log-probs are only
diagnostics), so with one update per batch the ratio is 1 at the gradient and the clip is inactive; the
clip matters only if a caller runs several epochs on a batch.

What it is not: no KL penalty to a reference model (the LOPD paper's GRPO baseline has none).
"""

from __future__ import annotations

from typing import Any

import torch

from lopd_core import losses
from lopd_core.algorithms.base import StepInputs, skipped_metrics, usable_rollouts
from lopd_core.algorithms.batch import to_padded
from lopd_core.algorithms.logprobs import (
    gather_tokens,
    micro_batches,
    plain_student_batch,
    rewards_tensor,
    student_logprobs,
)
from lopd_core.algorithms.optim import clip_and_step, make_adamw
from lopd_core.config import DistillConfig
from lopd_core.metrics import Timer
from lopd_core.models.policy import PolicySet


def group_advantages(inputs: StepInputs, usable: list[int], device) -> torch.Tensor:
    """Advantage of every usable rollout, normalised within its group over the group's usable members."""
    usable_set = set(usable)
    out = torch.zeros(len(usable), device=device)
    position = {i: n for n, i in enumerate(usable)}
    g = inputs.group_size
    for start in range(0, len(inputs.trajectories), g):
        members = [i for i in range(start, start + g) if i in usable_set]
        if len(members) < 2:
            continue
        rewards = rewards_tensor([inputs.trajectories[i] for i in members], device)
        adv = losses.group_normalized_advantages(rewards, group_size=len(members))
        for i, a in zip(members, adv, strict=True):
            out[position[i]] = a
    return out


class GRPO:
    name = "grpo"

    def __init__(self, cfg: DistillConfig, policies: PolicySet):
        self.cfg, self.policies = cfg, policies
        self.episodes_per_task = cfg.group_size
        self.optimizer = make_adamw(policies.student_parameters(), lr=cfg.lr_student, weight_decay=cfg.weight_decay)

    def step(self, inputs: StepInputs) -> dict[str, Any]:
        timer = Timer()
        usable = usable_rollouts(inputs.trajectories)
        metrics = skipped_metrics("distill", total=len(inputs.trajectories), errored=len(inputs.trajectories) - len(usable))
        if not usable:
            return {**metrics, "distill/updated": 0.0}
        rows = [inputs.trajectories[i] for i in usable]
        advantages = group_advantages(inputs, usable, self.policies.device)
        parts = micro_batches(len(rows), self.cfg.micro_batch)
        batches = [plain_student_batch(self.policies, rows[part]) for part in parts]
        n_tokens = sum(b.n_tokens for b in batches)
        loss_sum = 0.0
        with timer("student"):
            self.policies.train_mode(True)
            for part, batch in zip(parts, batches, strict=True):  # Σ (slice token sum / all tokens): the global mean
                lp = student_logprobs(self.policies, batch)
                token_lp = to_padded(gather_tokens(lp, batch.target_ids[batch.mask.bool()]), batch.mask)
                per_token = losses.ppo_clip_loss(token_lp, token_lp.detach(), advantages[part][:, None],
                                                 clip_low=self.cfg.grpo.clip_eps)
                loss = (per_token * batch.mask).sum() / max(n_tokens, 1)
                loss.backward()
                loss_sum += float(loss.detach())
                del lp, token_lp, per_token, loss
            grad_norm = clip_and_step(self.policies.student_parameters(), self.optimizer, max_norm=self.cfg.grad_clip)
            self.policies.train_mode(False)
        return {**metrics, "distill/updated": 1.0, "distill/loss": loss_sum,
                "distill/student_grad_norm": grad_norm, "distill/supervised_tokens": float(n_tokens),
                "distill/micro_batches": float(len(parts)),
                "grpo/advantage_abs_mean": float(advantages.abs().mean()),
                "grpo/zero_advantage_rate": float((advantages == 0).float().mean()),
                "distill/time_student_s": timer.total(),
                "distill/tokens_per_s": n_tokens / max(timer.total(), 1e-9)}

    def state_dict(self) -> dict[str, Any]:
        return {"student_optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["student_optimizer"])
