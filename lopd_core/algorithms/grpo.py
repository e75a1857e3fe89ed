"""GRPO (RLVR baseline): PPO-clip with group-normalised advantages, no teacher, no privileged context.

What it is: B/G tasks × G rollouts per step; each rollout's advantage is ``(r − mean_group) / std_group``
over the group's usable (non-errored) rollouts; loss = PPO-clip (ε = ``distill.grpo.clip_eps``) on every
supervised token, global token mean; ``distill.grpo.epochs`` AdamW steps on the same rollouts. The "old"
log-probs are the trainer's own temperature-1 forward before the first epoch (the rollout engine's
temperature-0.7 log-probs are only diagnostics): the first epoch's ratio is 1 and the clip inactive, later
epochs clip.

A group whose rewards do not vary has advantage 0 for every member: it teaches nothing and is left out
of the update. With ``distill.grpo.top_up`` such groups are replaced by fresh groups of the next tasks
(played by the current student), up to that many per step. They are paid from the run's episode
budget (steps × B): a run that tops up ends after fewer steps, never with more episodes; the rate of
zero-advantage rollouts is reported either way, and a step with no signal at all is not an update.

What it is not: no KL penalty to a reference model (the LOPD paper's GRPO baseline has none).
"""

from __future__ import annotations

from typing import Any

import torch

from lopd_core import losses
from lopd_core.algorithms.base import StepInputs, by_length, skipped_metrics, step_slices, usable_rollouts
from lopd_core.algorithms.batch import to_padded
from lopd_core.algorithms.logprobs import (
    gather_tokens,
    plain_student_batch,
    rewards_tensor,
)
from lopd_core.algorithms.optim import clip_and_step, make_adamw
from lopd_core.algorithms.prefix import StudentForwards
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


def _zero_variance_groups(trajectories, group_size: int) -> int:
    """Groups whose usable members all got the same reward (or fewer than two usable members): no signal."""
    usable = set(usable_rollouts(trajectories))
    flat = 0
    for start in range(0, len(trajectories), group_size):
        rewards = {trajectories[i].reward for i in range(start, start + group_size) if i in usable}
        members = sum(i in usable for i in range(start, start + group_size))
        flat += members < 2 or len(rewards) < 2
    return flat


class GRPO:
    name = "grpo"

    def __init__(self, cfg: DistillConfig, policies: PolicySet):
        self.cfg, self.policies = cfg, policies
        self.episodes_per_task = cfg.group_size
        self.optimizer = make_adamw(policies.student_parameters(), lr=cfg.student_lr(), weight_decay=cfg.weight_decay)

    def step(self, inputs: StepInputs) -> dict[str, Any]:
        timer = Timer()
        grpo, g = self.cfg.grpo, inputs.group_size
        trajectories, tasks = list(inputs.trajectories), list(inputs.tasks)
        extra_groups = 0
        n_groups = len(trajectories) // g
        zero_rate = _zero_variance_groups(trajectories, g) / max(n_groups, 1)
        while grpo.top_up and inputs.play_more is not None and extra_groups < grpo.top_up:
            missing = n_groups - (len(trajectories) // g - _zero_variance_groups(trajectories, g))
            if missing <= 0:
                break
            more_tasks, more = inputs.play_more(min(missing, grpo.top_up - extra_groups))
            if not more:  # the run's episode budget is spent
                break
            extra_groups += len(more) // g
            trajectories, tasks = trajectories + more, tasks + more_tasks
        usable = usable_rollouts(trajectories)
        metrics = skipped_metrics("distill", total=len(trajectories), errored=len(trajectories) - len(usable))
        metrics.update({"grpo/zero_advantage_group_rate": zero_rate, "grpo/top_up_groups": float(extra_groups),
                        "budget/extra_episodes": float(extra_groups * g)})
        grouped = StepInputs(step=inputs.step, trajectories=trajectories, tasks=tasks, retrieved=[[]] * len(trajectories),
                             group_size=g)
        advantages = group_advantages(grouped, usable, self.policies.device)
        keep = [n for n in range(len(usable)) if float(advantages[n]) != 0.0]
        metrics["grpo/zero_advantage_rate"] = 1.0 - len(keep) / max(len(usable), 1)
        keep = by_length(keep, [trajectories[u] for u in usable], enabled=self.cfg.sort_by_length,
                         by_prefix=self.cfg.share_prefix)
        if not keep:
            return {**metrics, "distill/updated": 0.0}
        rows = [trajectories[usable[n]] for n in keep]
        advantages = advantages[keep]
        parts = step_slices(rows, self.cfg.micro_batch, by_prefix=self.cfg.share_prefix)
        batches = [plain_student_batch(self.policies, rows[part]) for part in parts]
        n_tokens = sum(b.n_tokens for b in batches)
        with timer("student"):
            with torch.no_grad():  # π_old: the student before this step's first epoch
                forwards = StudentForwards(self.policies, batches, share=self.cfg.share_prefix)
                old = [to_padded(gather_tokens(forwards.logprobs(k), b.target_ids[b.mask.bool()]), b.mask)
                       for k, b in enumerate(batches)]
            self.policies.train_mode(True)
            for _ in range(grpo.epochs):
                loss_sum, clipped = 0.0, 0.0
                forwards = StudentForwards(self.policies, batches, share=self.cfg.share_prefix)
                for k, (part, batch, old_lp) in enumerate(zip(parts, batches, old, strict=True)):  # Σ (slice sum / all tokens)
                    lp = forwards.logprobs(k)
                    token_lp = to_padded(gather_tokens(lp, batch.target_ids[batch.mask.bool()]), batch.mask)
                    per_token = losses.ppo_clip_loss(token_lp, old_lp, advantages[part][:, None], clip_low=grpo.clip_eps)
                    loss = (per_token * batch.mask).sum() / max(n_tokens, 1)
                    loss.backward()
                    loss_sum += float(loss.detach())
                    ratio = torch.exp(token_lp.detach() - old_lp)
                    clipped += float(((ratio - 1).abs() > grpo.clip_eps).float().mul(batch.mask).sum())
                    del lp, token_lp, per_token, loss
                forwards.finish()
                grad_norm = clip_and_step(self.policies.student_parameters(), self.optimizer, max_norm=self.cfg.grad_clip)
            self.policies.train_mode(False)
        return {**metrics, "distill/updated": 1.0, "distill/loss": loss_sum,
                "distill/student_grad_norm": grad_norm, "distill/supervised_tokens": float(n_tokens),
                "distill/micro_batches": float(len(parts)),
                "grpo/advantage_abs_mean": float(advantages.abs().mean()),
                "grpo/clipped_fraction_last_epoch": clipped / max(n_tokens, 1),
                "distill/time_student_s": timer.total(),
                "distill/tokens_per_s": grpo.epochs * n_tokens / max(timer.total(), 1e-9)}

    def state_dict(self) -> dict[str, Any]:
        return {"student_optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["student_optimizer"])
