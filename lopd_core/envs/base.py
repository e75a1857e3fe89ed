"""The environment interface every task suite implements.

An episode: ``messages = env.reset(task)`` gives the initial chat (system + first user message, the
tool schemas are in ``task.tools``); then, for each assistant turn, ``env.step(text)`` returns the
observation to append (a ``tool`` message) or ``done``; finally ``env.result()`` scores the episode with a
reward in [0, 1], a textual feedback string (SDPO uses it) and the checklist details.

A :class:`Suite` makes deterministic tasks by (split, level, seed) and one environment per task. Train and
test tasks come from disjoint templates/entities, so evaluation tasks never appear in training; a suite may
also hold ``validation`` tasks (plug-in suites do when their tasks file says so). An environment may define
``close()``: the agent loop calls it once the episode is scored (a suite's teardown).

A suite may declare what its episodes need (:class:`SuiteNeeds`: context, turns, tokens per turn,
observation size, Python packages) as a ``needs`` attribute; :func:`lopd_core.rollout.agent.play` checks it
against the rollout settings before any episode runs.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Split = Literal["train", "validation", "test"]
SPLITS: tuple[str, ...] = ("train", "validation", "test")


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
    oracle_turns: list[str] = field(default_factory=list)
    """The same solution as the assistant turns to play, in order (a turn without a call answers the current user
    message); empty = ``oracle`` split at its tool responses (:func:`lopd_core.rollout.oracle.oracle_episode`)."""


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
    a suite with a ``task_by_id`` method, a plug-in suite's fixed dataset, looks other ids up itself; any other
    id is left out). Each (split, level, seed) is generated once, up to its largest index."""
    wanted: dict[tuple[str, int, int], dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    out = {}
    lookup = getattr(suite, "task_by_id", None)
    for task_id in set(task_ids):
        if callable(lookup) and (task := lookup(task_id)) is not None:
            out[task_id] = task
        elif m := _TASK_ID.search(task_id):  # ids of other suites can share (split, level, seed, index)
            wanted[(m["split"], int(m["level"]), int(m["seed"]))][int(m["index"])].add(task_id)
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


# --------------------------------------------------------------------------------------------------
class SuiteNeedsError(ValueError):
    """The rollout settings (or the installed packages) cannot host the suite's episodes; ``problems`` lists
    every shortfall with the setting that fixes it."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


_NEEDS_SETTINGS = {
    "context_tokens": ("max_trajectory_tokens", "tokens an episode needs: prompt, turns and observations"),
    "turns": ("max_turns", "assistant turns an episode needs"),
    "new_tokens": ("max_new_tokens", "tokens one assistant turn needs"),
    "observation_chars": ("observation_max_chars", "characters of a tool response the stored experiences must keep"),
}
NEEDS_FIELDS = tuple(_NEEDS_SETTINGS)


@dataclass
class SuiteNeeds:
    """What a suite's episodes need to be playable at all; 0 / empty = no requirement."""

    context_tokens: int = 0
    """``rollout.max_trajectory_tokens`` at least this (the longest correct episode, prompt included)."""
    turns: int = 0
    """``rollout.max_turns`` at least this (assistant turns of the longest correct episode)."""
    new_tokens: int = 0
    """``rollout.max_new_tokens`` at least this (the longest assistant turn of a correct episode)."""
    observation_chars: int = 0
    """``rollout.observation_max_chars`` at least this: the stored experiences (the teachers' context) keep tool
    responses up to that size, and this suite's answers are in responses this long."""
    packages: tuple[str, ...] = ()
    """Python distributions the suite imports (e.g. ``bfcl-eval``), checked with :meth:`missing_packages`."""
    levels: dict[int, dict[str, int]] = field(default_factory=dict)
    """Larger needs of some levels (e.g. a long-context category): level → {field: value}."""

    def for_level(self, level: int | None) -> SuiteNeeds:
        """The needs of one level: each field the larger of the suite's and the level's own."""
        extra = self.levels.get(level, {}) if level is not None else {}
        return SuiteNeeds(**{k: max(getattr(self, k), extra.get(k, 0)) for k in NEEDS_FIELDS}, packages=self.packages)

    def problems(self, suite: str, rollout: Any, *, level: int | None = None) -> list[str]:
        """Each rollout setting (``rollout``: anything with the ``RolloutConfig`` attributes) below the need
        of ``level`` (None: the suite-wide needs)."""
        needs, found = self.for_level(level), []
        where = f"suite {suite}" + (f" (level {level})" if level in self.levels else "")
        for need, (setting, what) in _NEEDS_SETTINGS.items():
            want, have = getattr(needs, need), getattr(rollout, setting)
            if want and have < want:
                found.append(f"{where} needs rollout.{setting} >= {want} ({what}); the settings have {have}: "
                             f"--set rollout.{setting}={want}")
        return found

    def missing_packages(self) -> list[str]:
        """The declared packages that are not installed."""
        missing = []
        for name in self.packages:
            try:
                importlib.metadata.distribution(name)
            except importlib.metadata.PackageNotFoundError:
                missing.append(name)
        return missing


def check_needs(suite: Any, rollout: Any, levels: Any = None) -> None:
    """Raise :class:`SuiteNeedsError` listing every way ``rollout`` (or the environment) falls short of
    ``suite.needs`` at the given levels (None: the suite-wide needs); a suite without ``needs`` passes."""
    needs: SuiteNeeds | None = getattr(suite, "needs", None)
    if needs is None:
        return
    problems = []
    for level in sorted(set(levels)) if levels is not None else [None]:
        problems += [p for p in needs.problems(suite.name, rollout, level=level) if p not in problems]
    missing = needs.missing_packages()
    if missing:
        problems.append(f"suite {suite.name} needs the Python packages {missing}, not installed here: "
                        f"pip install {' '.join(missing)}")
    if problems:
        raise SuiteNeedsError(problems)
