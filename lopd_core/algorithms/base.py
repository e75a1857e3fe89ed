"""The one small interface every training method implements, and the pieces they share.

An :class:`Algorithm` is handed one step's rollouts (with their tasks and retrieved experiences) and does
"build teacher context → loss terms → update", returning metrics with stable names. The training driver
(:mod:`lopd_core.training`) owns rollouts, retrieval, budget accounting, logging and checkpoints, and treats
every method the same way:

- ``episodes_per_task``: 1 for LOPD, OPSD and 'none'; G for GRPO, SDPO and Skill-SD (a per-step budget of
  B episodes is B tasks × 1 or B/G tasks × G, see lopd-method.md "Rollout budget accounting");
- ``step(inputs) -> metrics``;
- ``state_dict()`` / ``load_state_dict()``: optimizer states, β, EMA weights, bandit statistics — whatever
  exact resumption needs beyond the student and composer weights.

Rollouts with status 'error' never get a loss (they stay in the trajectories table with their status);
every method reports how many it skipped and why.

What it is not: no rollouts, no retrieval policy, no file I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from lopd_core.algorithms.batch import SequenceBatch, student_batch, teacher_batch
from lopd_core.envs.base import Task
from lopd_core.models.policy import PolicySet, hidden_states, logprobs_at
from lopd_core.records.experience import Experience, Retriever
from lopd_core.records.trajectory import Trajectory


@dataclass
class StepInputs:
    step: int
    """0-based training step."""
    trajectories: list[Trajectory]
    """All rollouts of the step, errored ones included; groups are contiguous (G consecutive rollouts)."""
    tasks: list[Task]
    """The task of each rollout (same order)."""
    retrieved: list[list[Experience]]
    """The J experiences retrieved for each rollout (possibly fewer, possibly none)."""
    retriever: Retriever | None = None
    """For methods that look up more (OPSD's same-task reference)."""
    group_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Algorithm(Protocol):
    name: str
    episodes_per_task: int

    def step(self, inputs: StepInputs) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# --------------------------------------------------------------------------------------------------
# Shared pieces
def usable_rollouts(trajectories: list[Trajectory]) -> list[int]:
    """Indices of rollouts that may get a loss: not errored and with at least one generated token."""
    return [i for i, t in enumerate(trajectories) if t.status != "error" and t.n_generated > 0]


def micro_batches(n: int, size: int) -> list[slice]:
    """``n`` rollouts as consecutive slices of ``size`` (``distill.micro_batch``; 0 = one slice).

    Every method's student update runs one forward/backward per slice and divides each slice's loss sum by
    the step's total token count, so the accumulated gradient is the whole batch's (less activation memory).
    """
    step = size if size > 0 else max(n, 1)
    return [slice(start, start + step) for start in range(0, n, step)]


def paired_micro_batches(policies: PolicySet, rows: list[Trajectory], prompts: list, size: int
                         ) -> tuple[list[tuple[SequenceBatch, SequenceBatch]], int]:
    """(teacher, student) batches per micro-batch of ``rows`` (teacher ``prompts[i]`` for ``rows[i]``), and the
    step's total supervised token count that every slice's loss sum is divided by."""
    pad, device = policies.tokenizer.pad_token_id, policies.device
    batches = [(teacher_batch(rows[part], prompts[part], pad_id=pad, device=device),
                student_batch(rows[part], pad_id=pad, device=device)) for part in micro_batches(len(rows), size)]
    return batches, sum(s_batch.n_tokens for _, s_batch in batches)


def rewards_tensor(trajectories: list[Trajectory], device) -> Tensor:
    return torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float32, device=device)


def make_adamw(params: list[torch.nn.Parameter], *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    if not params:
        raise ValueError("no trainable parameters for the optimizer (is the model frozen?)")
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def clip_and_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, *, max_norm: float) -> float:
    """Clip the gradient norm, step, zero the gradients; returns the pre-clip norm."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def student_logprobs(policies: PolicySet, batch: SequenceBatch) -> Tensor:
    """The student's temperature-1 log-probs ``[N, V]`` at the supervised positions (grad as the mode allows)."""
    with policies.student() as model:
        hidden = hidden_states(model, input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        return logprobs_at(model, hidden, batch.predict_index, batch.mask)


def model_logprobs(policies: PolicySet, adapter: str | None, batch: SequenceBatch, *, inputs_embeds: Tensor | None = None) -> Tensor:
    """Log-probs ``[N, V]`` of the shared base with ``adapter`` live (None = the frozen teacher)."""
    with policies.adapter(adapter) as model:
        if inputs_embeds is None:
            hidden = hidden_states(model, input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        else:
            hidden = hidden_states(model, inputs_embeds=inputs_embeds, attention_mask=batch.attention_mask)
        return logprobs_at(model, hidden, batch.predict_index, batch.mask)


def gather_tokens(logprobs: Tensor, ids: Tensor) -> Tensor:
    """``logprobs`` ``[N, V]`` at ``ids`` ``[N]`` → ``[N]``, or at ``ids`` ``[N, M]`` → ``[N, M]``."""
    if ids.dim() == 1:
        return logprobs.gather(-1, ids[:, None])[:, 0]
    return logprobs.gather(-1, ids)


def plain_student_batch(policies: PolicySet, trajectories: list[Trajectory]) -> SequenceBatch:
    return student_batch(trajectories, pad_id=policies.tokenizer.pad_token_id, device=policies.device)


class Timer:
    """Wall-clock seconds per named phase (``with timer('teacher'): …``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class _Phase:
            def __enter__(self):
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[name] = timer.seconds.get(name, 0.0) + time.perf_counter() - self.start

        return _Phase()

    def total(self) -> float:
        return sum(self.seconds.values())


def skipped_metrics(prefix: str, *, total: int, errored: int, without_context: int = 0) -> dict[str, float]:
    return {f"{prefix}/rollouts": float(total), f"{prefix}/rollouts_errored": float(errored),
            f"{prefix}/rollouts_without_context": float(without_context)}
