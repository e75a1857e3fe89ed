"""RFT, the positive control: best-of-G sampling, and fine-tuning on every success so far.

What it is (rejection-sampling fine-tuning): each step plays B/G tasks × G samples (every sample counts in
the budget, like GRPO's); the successes (reward ≥ ``distill.lopd.success_reward``) join a replay buffer of
all successes so far (started with the experience bank's, ``distill.rft.seed_from_bank``), and the student takes ``distill.rft.epochs`` steps of next-token NLL on the buffer
(the newest first, at most ``max_examples_per_step`` per pass). A method known to learn from the agent's own
successes: if it does not move the score, the setup is wrong before any method is judged.

``distill.rft.hint`` makes it **hinted RFT**: tasks are played with a worked example of their own family's
tool as earlier chat turns (a sibling training task's oracle, :mod:`lopd_core.rollout.context`), and each
success is re-targeted to the plain prompt before it enters the buffer — the hard-label twin of a
privileged teacher (the student learns what the hinted agent did, from the prompt it will see).

What it is not: no teacher, no KL, no advantage weighting (failures are simply not trained on).
"""

from __future__ import annotations

from typing import Any

from lopd_core.algorithms.base import StepInputs, skipped_metrics, usable_rollouts
from lopd_core.algorithms.optim import make_adamw
from lopd_core.algorithms.sft import supervised_update
from lopd_core.config import DistillConfig
from lopd_core.envs.base import Suite, Task
from lopd_core.models.policy import PolicySet
from lopd_core.records.trajectory import Trajectory
from lopd_core.rollout.context import ContextSuite, sibling_oracle_hint
from lopd_core.rollout.oracle import oracle_episode, scripted_trajectory


def plain_prompt_twin(tokenizer, suite: Suite, task: Task, hinted: Trajectory) -> Trajectory:
    """A hinted episode re-rendered behind the task's plain prompt: the same replies and observations."""
    initial = suite.make_env(task).reset(task)
    after = hinted.messages[hinted.initial_messages:]
    replies, observations = [], []
    for i, message in enumerate(after):
        if message.get("role") == "assistant":
            replies.append(message.get("content") or "")
            following = after[i + 1] if i + 1 < len(after) else None
            if following is not None and following.get("role") != "assistant":
                observations.append(following)
    return scripted_trajectory(tokenizer, initial=initial, replies=replies, observations=observations, task=task,
                               reward=hinted.reward, success=hinted.success, feedback=hinted.feedback,
                               episode_id=hinted.episode_id, trajectory_id=hinted.trajectory_id,
                               policy_version=hinted.policy_version, step=hinted.step, cycle_id=hinted.cycle_id)


class RFT:
    name = "rft"

    def __init__(self, cfg: DistillConfig, policies: PolicySet, *, level: int = 1, seed: int = 0):
        self.cfg, self.rft, self.policies = cfg, cfg.rft, policies
        self.episodes_per_task = cfg.group_size
        self.optimizer = make_adamw(policies.student_parameters(), lr=cfg.student_lr(), weight_decay=cfg.weight_decay)
        self.buffer: list[Trajectory] = []
        self.seeded = False
        self.level, self.seed = level, seed
        self.suite: Suite | None = None

    def rollout_suite(self, suite: Suite) -> Suite:
        """The suite the training loop plays: hinted (sibling oracle as chat turns) with ``rft.hint``."""
        self.suite = suite
        if not self.rft.hint:
            return suite
        hint = sibling_oracle_hint(suite, self.policies.tokenizer, level=self.level, seed=self.seed + 31337)
        return ContextSuite(suite, hint, placement="chat_turn", allowance_tokens=self.rft.hint_max_tokens)

    def step(self, inputs: StepInputs) -> dict[str, Any]:
        usable = usable_rollouts(inputs.trajectories)
        metrics = skipped_metrics("distill", total=len(inputs.trajectories),
                                  errored=len(inputs.trajectories) - len(usable))
        threshold = self.cfg.lopd.success_reward
        fresh = [(inputs.trajectories[i], inputs.tasks[i]) for i in usable if inputs.trajectories[i].reward >= threshold]
        if self.rft.hint:
            fresh_rows = [plain_prompt_twin(self.policies.tokenizer, self.suite, task, t) for t, task in fresh]
        else:
            fresh_rows = [t for t, _ in fresh]
        if self.rft.seed_from_bank and not self.seeded:
            self.buffer = [t for t in inputs.bank_successes if t.reward >= threshold] + self.buffer
            self.seeded = True
        self.buffer = (self.buffer + fresh_rows)[-self.rft.max_buffer:]
        out = {**metrics, "rft/new_successes": float(len(fresh_rows)), "rft/buffer": float(len(self.buffer))}
        if not self.buffer:
            return {**out, "distill/updated": 0.0}
        rows = list(reversed(self.buffer))[: self.rft.max_examples_per_step]
        last: dict[str, float] = {}
        for _ in range(self.rft.epochs):
            last = supervised_update(self.policies, self.optimizer, rows, micro_batch=self.cfg.micro_batch,
                                     grad_clip=self.cfg.grad_clip, sort_by_length=self.cfg.sort_by_length,
                                     share_prefix=self.cfg.share_prefix)
        return {**out, "distill/updated": 1.0, "distill/loss": last["loss"], "distill/student_grad_norm": last["grad_norm"],
                "distill/supervised_tokens": last["tokens"], "distill/micro_batches": last["micro_batches"]}

    def state_dict(self) -> dict[str, Any]:
        return {"student_optimizer": self.optimizer.state_dict(), "buffer": [t.to_dict() for t in self.buffer],
                "seeded": self.seeded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["student_optimizer"])
        self.buffer = [Trajectory(**row) for row in state.get("buffer", [])]
        self.seeded = bool(state.get("seeded", False))


class OracleSFT:
    """The capacity control: fine-tuning on the oracle transcripts of the step's training tasks.

    It shows how far the student can move in the same steps when every example is correct. No rollouts:
    the step's B tasks are played by their scripted oracle through the real environment (counted as the
    step's B episodes, so curves share the x axis)."""

    name = "sft_oracle"
    episodes_per_task = 1
    plays_rollouts = False

    def __init__(self, cfg: DistillConfig, policies: PolicySet):
        self.cfg, self.policies = cfg, policies
        self.optimizer = make_adamw(policies.student_parameters(), lr=cfg.student_lr(), weight_decay=cfg.weight_decay)
        self.suite: Suite | None = None

    def rollout_suite(self, suite: Suite) -> Suite:
        self.suite = suite
        return suite

    def step(self, inputs: StepInputs) -> dict[str, Any]:
        rows = [oracle_episode(self.policies.tokenizer, self.suite, task) for task in inputs.tasks if task.oracle]
        if not rows:
            return {"distill/updated": 0.0, "distill/rollouts": 0.0}
        update = supervised_update(self.policies, self.optimizer, rows, micro_batch=self.cfg.micro_batch,
                                   grad_clip=self.cfg.grad_clip, sort_by_length=self.cfg.sort_by_length,
                                   share_prefix=self.cfg.share_prefix)
        return {"distill/updated": 1.0, "distill/rollouts": float(len(rows)), "distill/loss": update["loss"],
                "distill/student_grad_norm": update["grad_norm"], "distill/supervised_tokens": update["tokens"],
                "sft_oracle/mean_reward": sum(r.reward for r in rows) / len(rows)}

    def state_dict(self) -> dict[str, Any]:
        return {"student_optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["student_optimizer"])
