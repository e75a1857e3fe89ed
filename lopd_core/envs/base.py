"""The environment interface every task suite implements.

An episode: ``messages = env.reset(task)`` gives the initial chat (system + first user message, the
tool schemas are in ``task.tools``); then, for each assistant turn, ``env.step(text)`` returns the
observation to append (a ``tool`` message) or ``done``; finally ``env.result()`` scores the episode with a
reward in [0, 1], a textual feedback string (SDPO uses it) and the checklist details.

A :class:`Suite` makes deterministic tasks by (split, level, seed) and one environment per task. Train and
test tasks come from disjoint templates/entities, so evaluation tasks never appear in training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Split = Literal["train", "test"]


@dataclass
class Task:
    task_id: str
    """Stable id: the same (suite, split, level, seed, index) always gives the same id and content."""
    suite: str
    family: str
    """Domain or template family (e.g. 'shop', 'calendar', 'codegen/strings')."""
    split: Split
    level: int
    instruction: str
    """The task as the user states it (the retrieval query)."""
    tools: list[dict[str, Any]] = field(default_factory=list)
    """JSON function schemas (``{"type": "function", "function": {...}}``) the agent may call."""
    payload: dict[str, Any] = field(default_factory=dict)
    """Suite-specific data (initial state, hidden tests, expected calls …); never shown to the agent."""
    oracle: str = ""
    """A scripted correct solution as assistant text (OPSD's fallback reference; never shown to the student)."""


@dataclass
class StepResult:
    observation: str | None
    """Text of the tool/user turn to append, or None when nothing is appended."""
    done: bool
    role: str = "tool"
    """Role of the observation message ('tool' for tool responses, 'user' for environment messages)."""
    tool_calls: int = 0
    """Tool calls parsed from this assistant turn."""
    invalid_tool_calls: int = 0
    """Calls that could not be parsed or were invalid (bad name/arguments); each produced an explanatory observation."""


@dataclass
class EpisodeResult:
    reward: float
    """In [0, 1]."""
    success: bool
    feedback: str = ""
    checklist: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    def reset(self, task: Task) -> list[dict[str, Any]]: ...

    def step(self, assistant_text: str) -> StepResult: ...

    def result(self) -> EpisodeResult: ...


@runtime_checkable
class Suite(Protocol):
    name: str
    kind: Literal["tool", "code"]
    """'tool' suites use the tool-use success threshold, 'code' suites the all-tests-pass one."""

    def tasks(self, split: Split, n: int, *, level: int = 1, seed: int = 0) -> list[Task]: ...

    def make_env(self, task: Task) -> Environment: ...
