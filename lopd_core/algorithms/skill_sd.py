"""Skill-SD: PPO-clip plus a light distillation toward the live student conditioned on a written skill.

What it is (reconstructed: the Skill-SD paper's exact loss was not available, see docs/method.md):

- B/G tasks × G rollouts per step; group-normalised advantages as GRPO;
- a skill bank of natural-language skills, one per past successful trajectory (an experience), written by
  a template (:func:`template_skill`: the tool calls in order, or the answer's form) or by the policy
  itself (``distill.skill_sd.skill_source = 'policy'``: one greedy generation per experience, counted in
  the rollout budget as ``budget/skill_generations``);
- per task one skill chosen by UCB1 (c = √2) among the skills of the task's retrieved experiences; an arm's
  reward is ``(1 + tanh Δ)/2`` where Δ is the outcome-signed privilege of the skill-conditioned teacher on
  that task's group (does the skill make the teacher favour the successful rollouts' tokens?);
- teacher = the live student under ``no_grad`` with the skill as text in the task's user message;
- loss per supervised token = PPO-clip (clip-higher 0.2 / 0.28) + λ·IS-weighted sampled-token reverse KL
  to the teacher (λ = 0.001, ratio clip ``is_clip``), global token mean. Groups without a skill keep the
  PPO term only.

What it is not: no skill retrieval by embedding beyond what the retriever returned for the task.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from lopd_core import losses
from lopd_core.algorithms.base import StepInputs, by_length, skipped_metrics, step_slices, usable_rollouts
from lopd_core.algorithms.batch import to_padded
from lopd_core.algorithms.context import truncate_tokens
from lopd_core.algorithms.grpo import group_advantages
from lopd_core.algorithms.logprobs import (
    gather_tokens,
    model_logprobs,
    paired_micro_batches,
)
from lopd_core.algorithms.optim import clip_and_step, make_adamw
from lopd_core.algorithms.prefix import StudentForwards
from lopd_core.config import DistillConfig
from lopd_core.metrics import Timer
from lopd_core.models.composer import experience_text
from lopd_core.models.latent import TeacherPrompt, text_context_prompt
from lopd_core.models.policy import STUDENT, PolicySet, hidden_states, logprobs_at
from lopd_core.records.chat import end_of_turn_ids, render_prompt_ids
from lopd_core.records.experience import Experience, own_turns
from lopd_core.rollout.engines.base import SamplingParams

SKILL_FRAMING_BEFORE = "A skill that worked on a similar, already solved task:\n"
SKILL_FRAMING_AFTER = "\n\nNow the task:\n"
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def _tool_names(text: str) -> list[str]:
    names = []
    for blob in _TOOL_CALL.findall(text or ""):
        try:
            name = json.loads(blob).get("name")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(name, str):
            names.append(name)
    return names


def template_skill(experience: Experience) -> str:
    """A deterministic one-paragraph skill from an experience: its tool-call sequence, or its answer's form."""
    turns = own_turns(experience.messages, instruction=experience.instruction)  # never the worked examples' calls
    assistant = [m.get("content") or "" for m in turns if m.get("role") == "assistant"]
    calls = [name for text in assistant for name in _tool_names(text)]
    if calls:
        steps = ", then ".join(f"call `{n}`" for n in calls)
        return (f"For a task like \"{experience.instruction[:160]}\": {steps}; read each tool response before the next "
                "call, then answer the user in plain text using the values the tools returned.")
    final = assistant[-1] if assistant else experience.text
    if "```" in final:
        return (f"For a task like \"{experience.instruction[:160]}\": reply with one complete fenced Python code block "
                "that defines the requested function, handles the edge cases in the statement, and nothing else.")
    return f"For a task like \"{experience.instruction[:160]}\": answer directly and concisely in one reply."


class SkillBank:
    """Skills by id (the source experience id) with UCB1 statistics shared across tasks."""

    def __init__(self) -> None:
        self.skills: dict[str, str] = {}
        self.pulls: dict[str, int] = {}
        self.value_sum: dict[str, float] = {}
        self.total_pulls = 0

    def add(self, skill_id: str, text: str) -> None:
        if skill_id not in self.skills:
            self.skills[skill_id] = text
            self.pulls[skill_id] = 0
            self.value_sum[skill_id] = 0.0

    def choose(self, candidates: list[str], *, c: float) -> str:
        """UCB1: an untried candidate first, else argmax mean + c·√(ln N / n)."""
        if not candidates:
            raise ValueError("UCB1 needs at least one candidate skill")
        for skill in candidates:
            if self.pulls[skill] == 0:
                return skill
        log_total = math.log(max(self.total_pulls, 1))
        return max(candidates, key=lambda s: self.value_sum[s] / self.pulls[s] + c * math.sqrt(log_total / self.pulls[s]))

    def update(self, skill_id: str, reward: float) -> None:
        self.pulls[skill_id] += 1
        self.value_sum[skill_id] += float(reward)
        self.total_pulls += 1

    def state_dict(self) -> dict[str, Any]:
        return {"skills": dict(self.skills), "pulls": dict(self.pulls), "value_sum": dict(self.value_sum),
                "total_pulls": self.total_pulls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skills, self.pulls = dict(state["skills"]), dict(state["pulls"])
        self.value_sum, self.total_pulls = dict(state["value_sum"]), int(state["total_pulls"])


class SkillSD:
    name = "skill_sd"

    def __init__(self, cfg: DistillConfig, policies: PolicySet, *, engine=None):
        self.cfg, self.policies, self.skill_cfg = cfg, policies, cfg.skill_sd
        self.episodes_per_task = cfg.group_size
        self.engine = engine
        if self.skill_cfg.skill_source == "policy" and engine is None:
            raise ValueError("distill.skill_sd.skill_source='policy' needs a rollout engine to write skills with")
        self.optimizer = make_adamw(policies.student_parameters(), lr=cfg.student_lr(), weight_decay=cfg.weight_decay)
        self.bank = SkillBank()

    def _policy_skills(self, experiences: list[Experience]) -> list[str]:
        tok = self.policies.tokenizer
        prompts = []
        for exp in experiences:
            solved = experience_text(tok, exp, max_tokens=self.cfg.lopd.experience_max_tokens)
            prompts.append(render_prompt_ids(tok, [
                {"role": "system", "content": "You turn solved tasks into short reusable skills."},
                {"role": "user", "content": f"A solved task:\n{solved}\n\nIn one or two sentences, state the general "
                                            "strategy that solved it, so it can be reused on similar tasks."}]))
        params = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=self.skill_cfg.max_skill_tokens,
                                stop_token_ids=end_of_turn_ids(tok))
        generations = self.engine.generate(prompts, params)
        return [tok.decode(g.token_ids, skip_special_tokens=True).strip() or template_skill(e)
                for g, e in zip(generations, experiences, strict=True)]

    def _add_skills(self, experiences: list[Experience]) -> int:
        new = list({e.experience_id: e for e in experiences if e.experience_id not in self.bank.skills}.values())
        if not new:
            return 0
        if self.skill_cfg.skill_source == "policy":
            texts = self._policy_skills(new)
        else:
            texts = [template_skill(e) for e in new]
        tok = self.policies.tokenizer
        for exp, text in zip(new, texts, strict=True):
            self.bank.add(exp.experience_id, truncate_tokens(tok, text, max_tokens=self.skill_cfg.max_skill_tokens))
        return len(new) if self.skill_cfg.skill_source == "policy" else 0

    def _teacher_logprobs(self, batch):
        if self.policies.student_kind == "lora":
            return model_logprobs(self.policies, STUDENT, batch)
        model = self.policies.full_student
        hidden = hidden_states(model, input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        return logprobs_at(model, hidden, batch.predict_index, batch.mask)

    def step(self, inputs: StepInputs) -> dict[str, Any]:
        tok, timer, g = self.policies.tokenizer, Timer(), inputs.group_size
        usable = usable_rollouts(inputs.trajectories)
        metrics = skipped_metrics("distill", total=len(inputs.trajectories), errored=len(inputs.trajectories) - len(usable))
        if not usable:
            return {**metrics, "distill/updated": 0.0}
        # --- skills: grow the bank, choose one per task by UCB1 ----------------------------------------
        generations = self._add_skills([e for exps in inputs.retrieved for e in exps])
        chosen_skill: dict[int, str] = {}
        for start in range(0, len(inputs.trajectories), g):
            candidates = list(dict.fromkeys(e.experience_id for e in inputs.retrieved[start]))
            if candidates:
                chosen_skill[start // g] = self.bank.choose(candidates, c=self.skill_cfg.ucb_c)
        usable = by_length(usable, inputs.trajectories, enabled=self.cfg.sort_by_length, by_prefix=self.cfg.share_prefix)
        rows = [inputs.trajectories[i] for i in usable]
        prompts = []
        for i, traj in zip(usable, rows, strict=True):
            skill = chosen_skill.get(i // g)
            initial = traj.messages[: traj.initial_messages]
            prompts.append(text_context_prompt(tok, initial, traj.tools, self.bank.skills[skill],
                                               framing_before=SKILL_FRAMING_BEFORE, framing_after=SKILL_FRAMING_AFTER)
                           if skill else None)
        has_skill = torch.tensor([p is not None for p in prompts], dtype=torch.float32, device=self.policies.device)
        device = self.policies.device
        teacher_prompts = [p if p is not None else _plain_prompt(t) for p, t in zip(prompts, rows, strict=True)]
        advantages = group_advantages(inputs, usable, device)
        parts = step_slices(rows, self.cfg.micro_batch, by_prefix=self.cfg.share_prefix)
        batches, n_tokens = paired_micro_batches(self.policies, rows, teacher_prompts, self.cfg.micro_batch,
                                                 by_prefix=self.cfg.share_prefix)
        forwards = StudentForwards(self.policies, [s for _, s in batches], share=self.cfg.share_prefix)
        loss_sum, ppo_sum, kl_sum = 0.0, 0.0, 0.0
        deltas, masks = [], []  # per rollout, for the bandit update
        for k, (part, (t_batch, s_batch)) in enumerate(zip(parts, batches, strict=True)):  # Σ (slice sum / all tokens)
            mask, targets = s_batch.mask, s_batch.target_ids[s_batch.mask.bool()]
            # --- teacher: the live student with the skill, no grad -------------------------------------
            with timer("teacher"), torch.no_grad():
                self.policies.train_mode(False)
                teacher_token = torch.zeros_like(mask)
                if bool(has_skill[part].any()):
                    teacher_token = to_padded(gather_tokens(self._teacher_logprobs(t_batch), targets), mask)
            # --- student: PPO-clip + λ·IS-weighted sampled-token reverse KL ------------------------------
            with timer("student"):
                self.policies.train_mode(True)
                s_lp = forwards.logprobs(k)
                token_lp = to_padded(gather_tokens(s_lp, targets), mask)
                del s_lp
                ppo = losses.ppo_clip_loss(token_lp, token_lp.detach(), advantages[part][:, None],
                                           clip_low=self.skill_cfg.clip_low, clip_high=self.skill_cfg.clip_high)
                kl = losses.sampled_token_reverse_kl(token_lp, teacher_token, s_batch.behaviour_logprobs,
                                                     is_clip=self.skill_cfg.is_clip) * has_skill[part][:, None]
                loss = ((ppo + self.skill_cfg.kl_weight * kl) * mask).sum() / max(n_tokens, 1)
                loss.backward()
                loss_sum += float(loss.detach())
                ppo_sum += float((ppo.detach() * mask).sum())
                kl_sum += float((kl.detach() * mask).sum())
            delta = losses.privilege_delta(teacher_token, token_lp.detach())
            deltas += list(delta)
            masks += list(mask)
            del token_lp, ppo, kl, loss, teacher_token, delta
        with timer("student"):  # one optimizer step for the whole batch
            forwards.finish()
            grad_norm = clip_and_step(self.policies.student_parameters(), self.optimizer, max_norm=self.cfg.grad_clip)
            self.policies.train_mode(False)
        # --- bandit update: outcome-signed privilege of the chosen skill on its group --------------------
        rewards = torch.tensor([t.reward for t in rows], dtype=torch.float32, device=device)
        group_of = [i // g for i in usable]
        arm_rewards = []
        for group, skill in chosen_skill.items():
            members = [n for n, grp in enumerate(group_of) if grp == group]
            if members:
                delta = pad_sequence([deltas[n] for n in members], batch_first=True)
                mask = pad_sequence([masks[n] for n in members], batch_first=True)
                value = float(losses.token_weighted_margin(delta, losses.outcome_advantage(rewards[members])[:, None], mask))
                arm_reward = 0.5 * (1.0 + math.tanh(value))
                self.bank.update(skill, arm_reward)
                arm_rewards.append(arm_reward)
        return {**metrics, "distill/updated": 1.0, "distill/loss": loss_sum,
                "skill_sd/ppo": ppo_sum / max(n_tokens, 1),
                "skill_sd/sampled_kl": kl_sum / max(n_tokens, 1),
                "skill_sd/groups_with_skill": float(len(chosen_skill)), "skill_sd/bank_size": float(len(self.bank.skills)),
                "skill_sd/arm_reward_mean": sum(arm_rewards) / len(arm_rewards) if arm_rewards else 0.0,
                "budget/skill_generations": float(generations),
                "distill/student_grad_norm": grad_norm, "distill/supervised_tokens": float(n_tokens),
                "distill/micro_batches": float(len(parts)),
                "distill/time_teacher_s": timer.seconds["teacher"], "distill/time_student_s": timer.seconds["student"],
                "distill/tokens_per_s": n_tokens / max(timer.total(), 1e-9)}

    def state_dict(self) -> dict[str, Any]:
        return {"student_optimizer": self.optimizer.state_dict(), "skill_bank": self.bank.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["student_optimizer"])
        self.bank.load_state_dict(state["skill_bank"])


def _plain_prompt(trajectory) -> TeacherPrompt:
    return TeacherPrompt(ids=list(trajectory.token_ids[: trajectory.prompt_len]))
