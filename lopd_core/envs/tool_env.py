"""The multi-turn tool-use environment and its checklist verifier, shared by toolworld and plug-in suites.

An episode: the system prompt (role and rules; the tool schemas are rendered by the chat template or
:func:`lopd_core.records.chat.tools_system_prompt`), optional worked examples as real chat turns
(``prefix_messages``: small models imitate turns far better than instructions), the user's request; every
assistant turn that contains tool calls gets one ``tool`` message with a ``<tool_response>`` per call
(errors explained, never raised); the first turn without any call is the final answer and ends the episode.

The verifier is an EnvScaler-style checklist (:class:`Checklist`): required **calls** (name + arguments),
required **state** changes (the expected final state, usually computed by replaying the oracle's calls on
a copy of the initial state) and **answer** items (text or numbers the final answer must mention). Reward
= fraction of items satisfied; an unintended state change (a record that should not have changed) is an
item of its own when the task changes state, and halves the reward of read-only tasks. Feedback lists the
unmet items (SDPO's environment feedback).

This module knows nothing about any particular domain.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lopd_core.envs.base import EpisodeResult, StepResult, Task
from lopd_core.envs.tools import (
    Toolbox,
    ToolCall,
    error_observation,
    format_tool_call,
    format_tool_response,
    parse_tool_calls,
)

SUCCESS_THRESHOLD = 0.8
"""Reward at or above which a tool-use episode counts as a success (the curation threshold for tool use)."""

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


# --------------------------------------------------------------------------------------------------
def normalize(value: Any) -> Any:
    """Canonical form for comparing arguments and state: case/space-insensitive strings, rounded numbers."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float):
        return round(float(value), 2)
    if isinstance(value, str):
        return " ".join(value.strip().lower().split())
    if isinstance(value, list | tuple):
        return [normalize(v) for v in value]
    if isinstance(value, dict):
        return {str(k): normalize(v) for k, v in value.items()}
    return value


def arguments_match(expected: dict[str, Any], actual: dict[str, Any]) -> bool:
    """Every expected argument is present with an equal (normalised) value; extra arguments are allowed."""
    return all(k in actual and normalize(actual[k]) == normalize(v) for k, v in expected.items())


def numbers_in(text: str) -> list[float]:
    found = []
    for raw in _NUMBER_RE.findall(text):
        try:
            found.append(float(raw.replace(",", "")))
        except ValueError:
            continue
    return found


@dataclass
class AnswerItem:
    """Something the final answer must mention: a text (case-insensitive substring) or a number."""

    text: str | None = None
    number: float | None = None
    tolerance: float = 0.01
    """Absolute tolerance for numbers."""
    label: str = ""

    def satisfied_by(self, answer: str) -> bool:
        if self.number is not None:
            return any(math.isclose(n, self.number, abs_tol=self.tolerance) for n in numbers_in(answer))
        return bool(self.text) and normalize(self.text) in normalize(answer)

    def describe(self) -> str:
        if self.label:
            return self.label
        return f"the answer mentions {self.number:g}" if self.number is not None else f"the answer mentions {self.text!r}"

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "number": self.number, "tolerance": self.tolerance, "label": self.label}


@dataclass
class Checklist:
    calls: list[ToolCall] = field(default_factory=list)
    """Calls that must appear among the agent's valid calls (argument subset match, any order)."""
    answer: list[AnswerItem] = field(default_factory=list)
    initial_state: dict[str, Any] | None = None
    expected_state: dict[str, Any] | None = None
    """Final state the task requires; None = no state check."""


def _state_records(state: dict[str, Any]) -> dict[str, Any]:
    """Flatten a state into comparable records: 'collection/key' for dicts of records, else 'key'."""
    records = {}
    for key, value in state.items():
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            for sub, rec in value.items():
                records[f"{key}/{sub}"] = rec
        else:
            records[key] = value
    return records


def score_checklist(checklist: Checklist, *, calls: list[ToolCall], final_answer: str | None,
                    final_state: dict[str, Any] | None) -> EpisodeResult:
    """Reward = fraction of checklist items satisfied; feedback names every unmet item."""
    items: list[dict[str, Any]] = []
    for want in checklist.calls:
        ok = any(c.name == want.name and arguments_match(want.arguments, c.arguments) for c in calls)
        items.append({"kind": "call", "item": format_tool_call(want.name, want.arguments), "ok": ok})
    penalty = 1.0
    changed_wrongly: list[str] = []
    if checklist.expected_state is not None and final_state is not None:
        before = _state_records(checklist.initial_state or {})
        want = _state_records(checklist.expected_state)
        got = _state_records(final_state)
        must_change = [k for k in sorted(set(want) | set(before)) if normalize(want.get(k)) != normalize(before.get(k))]
        achieved = 0
        for key in must_change:
            ok = normalize(got.get(key)) == normalize(want.get(key))
            achieved += ok
            items.append({"kind": "state", "item": f"{key} = {json.dumps(want.get(key), default=str)}", "ok": ok})
        changed_wrongly = [k for k in sorted(set(got) | set(before))
                           if k not in must_change and normalize(got.get(k)) != normalize(before.get(k))]
        if must_change:
            # Only earned together with at least one required change: doing nothing must not score.
            items.append({"kind": "state", "item": "no other record changed", "ok": not changed_wrongly and achieved > 0})
        elif changed_wrongly:
            penalty = 0.5
    answer = final_answer or ""
    for item in checklist.answer:
        items.append({"kind": "answer", "item": item.describe(),
                      "ok": final_answer is not None and item.satisfied_by(answer)})
    n_ok = sum(i["ok"] for i in items)
    reward = penalty * (n_ok / len(items) if items else 1.0)
    unmet = [i for i in items if not i["ok"]]
    feedback_lines = []
    if final_answer is None:
        feedback_lines.append("no final answer: the episode ended while still calling tools")
    feedback_lines += [f"unmet {i['kind']}: {i['item']}" for i in unmet]
    if changed_wrongly:
        feedback_lines.append("unintended changes: " + ", ".join(changed_wrongly[:5]))
    return EpisodeResult(
        reward=round(reward, 6), success=reward >= SUCCESS_THRESHOLD - 1e-9,
        feedback="; ".join(feedback_lines) if feedback_lines else "all checklist items satisfied",
        checklist={"items": items, "satisfied": n_ok, "total": len(items), "unintended_changes": changed_wrongly},
    )


# --------------------------------------------------------------------------------------------------
class ToolUseEnvironment:
    """One episode of tool use against a :class:`Toolbox` whose functions act on a mutable state."""

    def __init__(self, task: Task, toolbox_factory: Callable[[dict[str, Any]], tuple[Toolbox, Callable[[], dict]]],
                 scorer: Callable[[list[ToolCall], str | None, dict[str, Any] | None], EpisodeResult], *,
                 system_prompt: str, prefix_messages: list[dict[str, Any]] | None = None,
                 max_calls_per_turn: int = 8) -> None:
        self.task = task
        self.prefix_messages = list(prefix_messages or [])
        self._factory = toolbox_factory
        self._scorer = scorer
        self.system_prompt = system_prompt
        self.max_calls_per_turn = max_calls_per_turn
        self.reset(task)

    def reset(self, task: Task) -> list[dict[str, Any]]:
        self.task = task
        self.toolbox, self._state_of = self._factory(copy.deepcopy(task.payload.get("initial_state", {})))
        self.calls: list[ToolCall] = []
        self.final_answer: str | None = None
        self.turns = 0
        return [{"role": "system", "content": self.system_prompt}, *copy.deepcopy(self.prefix_messages),
                {"role": "user", "content": task.instruction}]

    def step(self, assistant_text: str) -> StepResult:
        self.turns += 1
        turn = parse_tool_calls(assistant_text)
        if not turn.attempted:
            self.final_answer = turn.content
            return StepResult(observation=None, done=True)
        pieces, invalid = [], len(turn.errors)
        for error in turn.errors:
            pieces.append(error_observation(error))
        for i, call in enumerate(turn.calls):
            if i >= self.max_calls_per_turn:
                pieces.append(format_tool_response(f"error: at most {self.max_calls_per_turn} calls per turn; "
                                                   f"{call.name} was not run"))
                invalid += 1
                continue
            ok, result = self.toolbox.execute(call)
            if ok:
                self.calls.append(call)
            else:
                invalid += 1
            pieces.append(format_tool_response(result))
        return StepResult(observation="\n".join(pieces), done=False, role="tool",
                          tool_calls=len(turn.calls), invalid_tool_calls=invalid)

    def result(self) -> EpisodeResult:
        outcome = self._scorer(self.calls, self.final_answer, self._state_of())
        outcome.checklist.update(turns=self.turns, valid_calls=len(self.calls))
        return outcome


def oracle_transcript(toolbox: Toolbox, calls: list[ToolCall], final_answer: str) -> str:
    """A correct solution as assistant text: each call with the response it gets, then the final answer."""
    lines = []
    for call in calls:
        _, result = toolbox.execute(call)
        lines += [format_tool_call(call.name, call.arguments), format_tool_response(result)]
    lines.append(final_answer)
    return "\n".join(lines)
