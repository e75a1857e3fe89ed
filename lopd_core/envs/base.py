"""The environment interface every task suite implements.

An episode: ``messages = env.reset(task)`` gives the initial chat (system + first user message, the
tool schemas are in ``task.tools``); then, for each assistant turn, ``env.step(text)`` returns the
observation to append (a ``tool`` message) or ``done``; finally ``env.result()`` scores the episode with a
reward in [0, 1], a textual feedback string (SDPO uses it) and the checklist details.

A :class:`Suite` makes deterministic tasks by (split, level, seed) and one environment per task. Train and
test tasks come from disjoint templates/entities, so evaluation tasks never appear in training.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
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


_TASK_ID = re.compile(r"/(?P<split>[^/]+)/L(?P<level>\d+)/s(?P<seed>-?\d+)/(?P<index>\d+)$")


def tasks_by_id(suite: Suite, task_ids) -> dict[str, Task]:
    """Recreate tasks from their ids (``<suite>/<split>/L<level>/s<seed>/<index>``, the built-in suites' form;
    other ids are left out). Each (split, level, seed) is generated once, up to its largest index."""
    wanted: dict[tuple[str, int, int], dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    for task_id in set(task_ids):
        m = _TASK_ID.search(task_id)
        if m:  # another suite's id can share (split, level, seed, index): keep every id, match by the whole id
            wanted[(m["split"], int(m["level"]), int(m["seed"]))][int(m["index"])].add(task_id)
    out = {}
    for (split, level, seed), by_index in wanted.items():
        try:
            tasks = suite.tasks(split, max(by_index) + 1, level=level, seed=seed)  # type: ignore[arg-type]
        except (ValueError, KeyError):
            continue
        for index, ids in by_index.items():
            if index < len(tasks) and tasks[index].task_id in ids:
                out[tasks[index].task_id] = tasks[index]
    return out


def task_fingerprint(task: Task) -> str:
    """What makes two tasks the same task: the request and the world it runs in (the payload). The same
    request in another world (other records, another answer) is another task."""
    content = json.dumps([task.instruction, task.payload], sort_keys=True, default=str)
    return hashlib.sha256(content.encode()).hexdigest()
