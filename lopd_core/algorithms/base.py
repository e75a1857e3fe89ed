"""The one small interface every training method implements: its inputs, its protocol, which rollouts count.

An :class:`Algorithm` is handed one step's rollouts (with their tasks and retrieved experiences) and does
"build teacher context → loss terms → update", returning metrics with stable names. The training driver
(:mod:`lopd_core.training`) owns rollouts, retrieval, budget accounting, logging and checkpoints, and treats
every method the same way:

- ``episodes_per_task``: 1 for LOPD, OPSD and 'none'; G for GRPO, SDPO and Skill-SD (a per-step budget of
  B episodes is B tasks × 1 or B/G tasks × G, see docs/method.md, "Rollout budget accounting");
- ``step(inputs) -> metrics``;
- ``state_dict()`` / ``load_state_dict()``: optimizer states, β, EMA weights, bandit statistics — whatever
  exact resumption needs beyond the student and composer weights.

Rollouts with status 'error' never get a loss (they stay in the trajectories table with their status);
every method reports how many it skipped and why.

What it is not: no rollouts, no retrieval policy, no file I/O, no tensors (the log-prob helpers are in
:mod:`.logprobs`, the optimizer step in :mod:`.optim`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from lopd_core.algorithms.grouping import grouped_slices, prefix_groups, prefix_order
from lopd_core.envs.base import Task
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
    bank_successes: list[Trajectory] = field(default_factory=list)
    """The bank's successful episodes (LOPD re-scores some when a step has no success of its own)."""
    play_more: Callable[[int], tuple[list[Task], list[Trajectory]]] | None = None
    """Play ``n`` more groups (the next tasks of the run's order, G episodes each) with the current student;
    the training loop counts them in the budget (GRPO's top-up of groups without signal)."""


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


def by_length(indices: Iterable[int], trajectories: Sequence[Trajectory], *, enabled: bool = True,
              by_prefix: bool = False) -> list[int]:
    """``indices`` (into ``trajectories``) shortest trajectory first, stable (``distill.sort_by_length``).

    Consecutive micro-batches then hold rollouts of similar length, so padding each to its longest costs
    little. With ``by_prefix`` (``distill.share_prefix``) rollouts whose prompts share a long prefix (a
    domain's system message and worked examples) come together first, shortest first inside each group
    (:func:`lopd_core.algorithms.grouping.prefix_order`). Every update divides each micro-batch's loss sum by the
    step's token total, so the order changes the step only by the order of float sums."""
    indices = list(indices)
    if by_prefix:
        return [indices[k] for k in prefix_order([trajectories[i].token_ids for i in indices], by_length=enabled)]
    return sorted(indices, key=lambda i: len(trajectories[i].token_ids)) if enabled else indices


def step_slices(rows: Sequence[Trajectory], size: int, *, by_prefix: bool = False) -> list[slice]:
    """Micro-batches of at most ``size`` rollouts (``distill.micro_batch``; 0 = one of all) in the given order;
    with ``by_prefix`` they never mix rollouts of different prefix groups, so each micro-batch can take its
    group's shared prefix.

    Every method's student update runs one forward/backward per slice and divides each slice's loss sum by
    the step's total token count, so the accumulated gradient is the whole batch's (less activation memory)."""
    groups = prefix_groups([r.token_ids for r in rows]) if by_prefix else [0] * len(rows)
    return grouped_slices(groups, size)


def skipped_metrics(prefix: str, *, total: int, errored: int, without_context: int = 0) -> dict[str, float]:
    return {f"{prefix}/rollouts": float(total), f"{prefix}/rollouts_errored": float(errored),
            f"{prefix}/rollouts_without_context": float(without_context)}
