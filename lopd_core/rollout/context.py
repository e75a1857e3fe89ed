"""Suites whose episodes open with extra context in the prompt: a teacher's, or a hint's.

:class:`ContextSuite` wraps a suite so that every environment's initial messages carry context placed as
:func:`lopd_core.models.latent.place_experiences` places a text teacher's (as earlier chat turns, in the
task's message, or in the system message). The agent loop then plays the episodes as usual, so the
rewards are the environment's. Used for the text teacher's own success as an agent (the probe) and for
hinted RFT, whose hint is a worked example of the task's own family: a sibling training task's oracle
solution (:func:`sibling_oracle_hint`).

What it is not: a teacher for distillation (those build token prompts, :mod:`lopd_core.models.latent`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lopd_core.envs.base import Suite, Task
from lopd_core.models.latent import Placement, place_experiences
from lopd_core.records.experience import own_turns
from lopd_core.rollout.oracle import oracle_episode

Contexts = Callable[[Task], list[list[dict[str, Any]]]]
"""A task → the own turns of the experiences to show (one list of messages per experience)."""


class ContextSuite:
    """``suite``, with every episode's initial messages carrying ``contexts(task)`` placed as ``placement``.

    ``allowance_tokens`` > 0 lets each episode run past ``rollout.max_trajectory_tokens`` by its context's
    own length (at most that many tokens; the agent loop measures it against the plain prompt): the context
    then takes none of the room the episode has without it. Hinted RFT sets it, so a worked example on top of
    a long domain prompt still leaves the episode its turns, and the episode behind the plain prompt fits the
    cap; the engine's context length must allow for it (:meth:`lopd_core.config.Config.context_allowance`)."""

    def __init__(self, suite: Suite, contexts: Contexts, *, placement: Placement, allowance_tokens: int = 0):
        self.suite, self.contexts, self.placement = suite, contexts, placement
        self.allowance_tokens = allowance_tokens
        self.name, self.kind, self.needs = suite.name, suite.kind, getattr(suite, "needs", None)

    def tasks(self, split, n, *, level=1, seed=0):
        return self.suite.tasks(split, n, level=level, seed=seed)

    def make_env(self, task: Task):
        return _ContextEnvironment(self.suite.make_env(task), self.contexts(task), self.placement,
                                   allowance_tokens=self.allowance_tokens)


class _ContextEnvironment:
    def __init__(self, env, experiences: list[list[dict[str, Any]]], placement: Placement, *,
                 allowance_tokens: int = 0):
        self.env, self.experiences, self.placement = env, experiences, placement
        self.allowance_tokens = allowance_tokens
        self.plain_messages: list[dict[str, Any]] | None = None
        """The task's initial messages without the context (set by :meth:`reset`; the agent loop measures the
        context's length against them)."""

    def reset(self, task: Task):
        self.plain_messages = list(self.env.reset(task))
        return place_experiences(self.plain_messages, self.experiences, placement=self.placement)

    def step(self, assistant_text: str):
        return self.env.step(assistant_text)

    def result(self):
        return self.env.result()

    def close(self):
        if callable(getattr(self.env, "close", None)):
            self.env.close()


def sibling_oracle_hint(suite: Suite, tokenizer, *, level: int, seed: int, draw: int = 256) -> Contexts:
    """A task → the oracle solution (own turns) of another training task of its family: a worked example of
    the tool the task needs, never of the task itself. Families without a sibling get no hint."""
    by_family: dict[str, list[Task]] = {}
    for task in suite.tasks("train", draw, level=level, seed=seed):
        by_family.setdefault(task.family, []).append(task)
    cache: dict[str, list[dict[str, Any]]] = {}

    def hint(task: Task) -> list[list[dict[str, Any]]]:
        sibling = next((t for t in by_family.get(task.family, []) if t.task_id != task.task_id and t.oracle), None)
        if sibling is None:
            return []
        if sibling.task_id not in cache:
            episode = oracle_episode(tokenizer, suite, sibling)
            cache[sibling.task_id] = own_turns(episode.messages, instruction=sibling.instruction,
                                               initial_messages=episode.initial_messages)
        return [cache[sibling.task_id]]

    return hint
