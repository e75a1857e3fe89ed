"""OPSD: on-policy self-distillation toward the frozen initial model that sees a reference solution.

What it is: one rollout per task (B tasks × 1). The teacher is the frozen base model (every adapter off)
prompted with a reference solution of the same task in the SYSTEM message: the task's successful
trajectory from the experience bank when there is one (never this episode, only older than the current
step), else the task generator's scripted oracle; rollouts with neither get no loss. The counts of each
source are metrics (``opsd/reference_from_bank`` …). Loss: a full-vocabulary divergence per supervised
token, global token mean — forward KL(p^T ‖ p^S) as LOPD ran it, or ``distill.opsd.divergence = 'jsd'``
with ``jsd_beta`` (TRL GKD convention) as the OPSD paper; the teacher side is a constant.

What it is not: no learned context, no margin; the reference is text, rendered with the chat template.
"""

from __future__ import annotations

from typing import Any

import torch

from lopd_core import losses
from lopd_core.algorithms.base import StepInputs, by_length, skipped_metrics, usable_rollouts
from lopd_core.algorithms.context import opsd_reference
from lopd_core.algorithms.logprobs import model_logprobs, paired_micro_batches
from lopd_core.algorithms.optim import clip_and_step, make_adamw
from lopd_core.algorithms.prefix import StudentForwards
from lopd_core.config import DistillConfig
from lopd_core.metrics import Timer
from lopd_core.models.latent import system_reference_prompt
from lopd_core.models.policy import PolicySet


def full_vocab_divergence(student_lp, teacher_lp, opsd_cfg) -> torch.Tensor:
    if opsd_cfg.divergence == "forward_kl":
        return losses.forward_kl(student_lp, teacher_lp)
    if opsd_cfg.divergence == "reverse_kl":
        return losses.reverse_kl(student_lp, teacher_lp)
    return losses.generalized_jsd(student_lp, teacher_lp, jsd_beta=opsd_cfg.jsd_beta)


class OPSD:
    name = "opsd"
    episodes_per_task = 1

    def __init__(self, cfg: DistillConfig, policies: PolicySet):
        self.cfg, self.policies = cfg, policies
        self.optimizer = make_adamw(policies.student_parameters(), lr=cfg.student_lr(), weight_decay=cfg.weight_decay)

    def step(self, inputs: StepInputs) -> dict[str, Any]:
        tok, timer = self.policies.tokenizer, Timer()
        usable = by_length(usable_rollouts(inputs.trajectories), inputs.trajectories, enabled=self.cfg.sort_by_length,
                           by_prefix=self.cfg.share_prefix)
        sources = {"bank": 0, "oracle": 0, "none": 0}
        chosen, prompts = [], []
        for i in usable:
            traj, task = inputs.trajectories[i], inputs.tasks[i]
            reference, source = opsd_reference(tok, task, traj, inputs.retriever, step=inputs.step,
                                               max_tokens=self.cfg.lopd.experience_max_tokens)
            sources[source] += 1
            if source != "none":
                chosen.append(i)
                prompts.append(system_reference_prompt(tok, traj.messages[: traj.initial_messages], traj.tools, reference))
        metrics = {**skipped_metrics("distill", total=len(inputs.trajectories),
                                     errored=len(inputs.trajectories) - len(usable), without_context=sources["none"]),
                   **{f"opsd/reference_from_{k}": float(v) for k, v in sources.items()}}
        if not chosen:
            return {**metrics, "distill/updated": 0.0}
        rows = [inputs.trajectories[i] for i in chosen]
        batches, n_tokens = paired_micro_batches(self.policies, rows, prompts, self.cfg.micro_batch,
                                                 by_prefix=self.cfg.share_prefix)
        loss_sum = 0.0
        forwards = StudentForwards(self.policies, [s for _, s in batches], share=self.cfg.share_prefix)
        for k, (t_batch, _) in enumerate(batches):  # Σ (slice divergence sum / all tokens): the global token mean
            # --- teacher: frozen base + reference in the system message (no grad) ---------------------
            with timer("teacher"), torch.no_grad():
                self.policies.train_mode(False)
                teacher_lp = model_logprobs(self.policies, None, t_batch)
            # --- student: full-vocabulary divergence ------------------------------------------------------
            with timer("student"):
                self.policies.train_mode(True)
                s_lp = forwards.logprobs(k)
                loss = full_vocab_divergence(s_lp, teacher_lp, self.cfg.opsd).sum() / max(n_tokens, 1)
                loss.backward()
                loss_sum += float(loss.detach())
                del teacher_lp, s_lp, loss
        with timer("student"):  # one optimizer step for the whole batch
            forwards.finish()
            grad_norm = clip_and_step(self.policies.student_parameters(), self.optimizer, max_norm=self.cfg.grad_clip)
        self.policies.train_mode(False)
        return {**metrics, "distill/updated": 1.0, "distill/loss": loss_sum,
                f"opsd/{self.cfg.opsd.divergence}": loss_sum,
                "distill/student_grad_norm": grad_norm, "distill/supervised_tokens": float(n_tokens),
                "distill/micro_batches": float(len(batches)),
                "distill/time_teacher_s": timer.seconds["teacher"], "distill/time_student_s": timer.seconds["student"],
                "distill/tokens_per_s": n_tokens / max(timer.total(), 1e-9)}

    def state_dict(self) -> dict[str, Any]:
        return {"student_optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["student_optimizer"])
