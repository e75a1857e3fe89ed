"""SDPO: self-distillation toward an EMA of the student that sees a sibling's success and the feedback.

What it is: B/G tasks × G rollouts per step. The teacher is an exponential moving average of the student
(rate ``distill.sdpo.ema_rate`` = 0.05, updated after every student step; a LoRA student keeps the EMA as
the adapter ``student_ema`` on the shared base, a full student as a frozen copy). The teacher's privileged
context, as text in the task's user message: a successful *sibling* rollout of the same group plus the
environment's feedback on the sample — never the sample itself; a sample with no successful sibling and
no feedback gets no loss. Loss per supervised token: reverse KL(p̃^S ‖ p̃^T) on the student's top-K ids
(K = ``distill.sdpo.top_k``) + a tail bucket, times the importance weight ``min(p^S(a)/μ(a), 2.0)`` for
the sampled token a (μ = the engine's sampling distribution), global token mean; the teacher is a constant.

What it is not: the SDPO paper's full trainer (no reward-weighted extras); this is the loss the LOPD paper
compares against.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from lopd_core import losses
from lopd_core.algorithms.base import StepInputs, by_length, skipped_metrics, usable_rollouts
from lopd_core.algorithms.context import SDPO_FRAMING_BEFORE, sdpo_context
from lopd_core.algorithms.logprobs import (
    gather_tokens,
    model_logprobs,
    paired_micro_batches,
)
from lopd_core.algorithms.optim import clip_and_step, make_adamw
from lopd_core.algorithms.prefix import StudentForwards
from lopd_core.config import DistillConfig
from lopd_core.metrics import Timer
from lopd_core.models.latent import experiences_prompt, text_context_prompt
from lopd_core.models.policy import STUDENT, STUDENT_EMA, PolicySet, hidden_states, logprobs_at

SDPO_FRAMING_AFTER = "\n\nNow the task:\n"


def sdpo_teacher_prompt(tokenizer, trajectory, context: str | list[dict]):
    """The SDPO teacher's prompt: the trajectory's initial prompt with ``context`` (a sibling's success and
    the feedback, :func:`~lopd_core.algorithms.context.sdpo_context`): text goes into the task's user
    message, turns are played before the task."""
    messages = trajectory.messages[: trajectory.initial_messages]
    if isinstance(context, list):
        return experiences_prompt(tokenizer, messages, trajectory.tools, [context], placement="chat_turn")
    return text_context_prompt(tokenizer, messages, trajectory.tools, context,
                               framing_before=SDPO_FRAMING_BEFORE, framing_after=SDPO_FRAMING_AFTER)


class SDPO:
    name = "sdpo"

    def __init__(self, cfg: DistillConfig, policies: PolicySet):
        self.cfg, self.policies, self.sdpo = cfg, policies, cfg.sdpo
        self.episodes_per_task = cfg.group_size
        self.optimizer = make_adamw(policies.student_parameters(), lr=cfg.student_lr(), weight_decay=cfg.weight_decay)
        self.ema_model = None
        if policies.student_kind == "lora":
            lora = policies.base.peft_config[STUDENT]
            if STUDENT_EMA not in policies.adapter_names():
                policies.add_adapter(STUDENT_EMA, rank=lora.r, alpha=lora.lora_alpha,
                                     targets=sorted(lora.target_modules), trainable=False, copy_from=STUDENT)
        else:
            self.ema_model = copy.deepcopy(policies.full_student).requires_grad_(False).eval()

    # --- the EMA teacher ------------------------------------------------------------------------------
    def _ema_pairs(self):
        if self.ema_model is not None:
            return list(zip(self.ema_model.parameters(), self.policies.full_student.parameters(), strict=True))
        student = {n.replace(f".{STUDENT}.", "."): p for n, p in self.policies.base.named_parameters() if f".{STUDENT}." in n}
        return [(p, student[n.replace(f".{STUDENT_EMA}.", ".")]) for n, p in self.policies.base.named_parameters()
                if f".{STUDENT_EMA}." in n]

    @torch.no_grad()
    def _update_ema(self) -> None:
        for ema, live in self._ema_pairs():
            ema.lerp_(live.detach(), self.sdpo.ema_rate)

    def _teacher_logprobs(self, batch):
        if self.ema_model is None:
            return model_logprobs(self.policies, STUDENT_EMA, batch)
        hidden = hidden_states(self.ema_model, input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        return logprobs_at(self.ema_model, hidden, batch.predict_index, batch.mask)

    # ----------------------------------------------------------------------------------------------
    def step(self, inputs: StepInputs) -> dict[str, Any]:
        tok, timer, g = self.policies.tokenizer, Timer(), inputs.group_size
        usable = set(usable_rollouts(inputs.trajectories))
        chosen, prompts, with_sibling, with_feedback = [], [], 0, 0
        for i in by_length(sorted(usable), inputs.trajectories, enabled=self.cfg.sort_by_length,
                           by_prefix=self.cfg.share_prefix):
            start = (i // g) * g
            group = inputs.trajectories[start:start + g]
            context, sibling, feedback = sdpo_context(tok, group, i - start, max_tokens=self.cfg.lopd.experience_max_tokens,
                                                      redact=self.sdpo.feedback == "redacted",
                                                      placement=self.sdpo.context_placement)
            if not context:
                continue
            traj = inputs.trajectories[i]
            chosen.append(i)
            with_sibling += sibling
            with_feedback += feedback
            prompts.append(sdpo_teacher_prompt(tok, traj, context))
        metrics = {**skipped_metrics("distill", total=len(inputs.trajectories), errored=len(inputs.trajectories) - len(usable),
                                     without_context=len(usable) - len(chosen)),
                   "sdpo/with_sibling": float(with_sibling), "sdpo/with_feedback": float(with_feedback)}
        if not chosen:
            return {**metrics, "distill/updated": 0.0}
        rows = [inputs.trajectories[i] for i in chosen]
        batches, n_tokens = paired_micro_batches(self.policies, rows, prompts, self.cfg.micro_batch,
                                                 by_prefix=self.cfg.share_prefix)
        loss_sum, kl_sum, weight_sum = 0.0, 0.0, 0.0
        forwards = StudentForwards(self.policies, [s for _, s in batches], share=self.cfg.share_prefix)
        for k, (t_batch, s_batch) in enumerate(batches):  # Σ (slice sum / all tokens): the global token mean
            mask, targets = s_batch.mask, s_batch.target_ids[s_batch.mask.bool()]
            # --- teacher: EMA student + sibling/feedback text (no grad) --------------------------------
            with timer("teacher"), torch.no_grad():
                self.policies.train_mode(False)
                teacher_lp = self._teacher_logprobs(t_batch)
            # --- student: IS-weighted top-K + tail reverse KL ---------------------------------------------
            with timer("student"):
                self.policies.train_mode(True)
                s_lp = forwards.logprobs(k)
                support = s_lp.detach().topk(self.sdpo.top_k, dim=-1).indices
                kl = losses.topm_tail_reverse_kl(s_lp.gather(-1, support), teacher_lp.gather(-1, support),
                                                 grad_to="student")
                weight = losses.clipped_importance_weight(gather_tokens(s_lp, targets),
                                                          s_batch.behaviour_logprobs[mask.bool()], clip=self.sdpo.is_clip)
                loss = (weight * kl).sum() / max(n_tokens, 1)
                loss.backward()
                loss_sum += float(loss.detach())
                kl_sum += float(kl.detach().sum())
                weight_sum += float(weight.detach().sum())
                del teacher_lp, s_lp, kl, weight, loss
        # --- one optimizer step for the whole batch, then the EMA update ---------------------------------
        with timer("student"):
            forwards.finish()
            grad_norm = clip_and_step(self.policies.student_parameters(), self.optimizer, max_norm=self.cfg.grad_clip)
            self._update_ema()
            self.policies.train_mode(False)
        return {**metrics, "distill/updated": 1.0, "distill/loss": loss_sum,
                "sdpo/kl_topk": kl_sum / max(n_tokens, 1),
                "sdpo/is_weight_mean": weight_sum / max(n_tokens, 1),
                "distill/student_grad_norm": grad_norm, "distill/supervised_tokens": float(n_tokens),
                "distill/micro_batches": float(len(batches)),
                "distill/time_teacher_s": timer.seconds["teacher"], "distill/time_student_s": timer.seconds["student"],
                "distill/tokens_per_s": n_tokens / max(timer.total(), 1e-9)}

    def state_dict(self) -> dict[str, Any]:
        return {"student_optimizer": self.optimizer.state_dict(),
                "ema": [ema.detach().cpu().clone() for ema, _ in self._ema_pairs()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["student_optimizer"])
        with torch.no_grad():
            for (ema, _), saved in zip(self._ema_pairs(), state["ema"], strict=True):
                ema.copy_(saved)
