"""The multi-turn tool-use environment and its checklist verifier, shared by toolworld and plug-in suites.

An episode: the system prompt (role and rules; the tool schemas are rendered by the chat template or
:func:`lopd_core.records.chat.tools_system_prompt`), optional worked examples as real chat turns
(``prefix_messages``: small models imitate turns far better than instructions), the user's request; every
assistant turn that contains tool calls gets one ``tool`` message with a ``<tool_response>`` per call
(errors explained, never raised); the first turn without any call is the final answer and ends the episode,
unless the task has follow-up user messages (:class:`FollowUp`): then that answer closes one exchange and
the next message (which may make more tools callable) is the observation. The tools are opened per episode
(:class:`EpisodeTools`: the suite builds the state and the instance at ``reset`` and closes them at the end),
so episodes played together never share state. Every attempted call is kept in the trace
(:class:`lopd_core.envs.tools.CallRecord`) the scorer reads (:class:`EpisodeLog`).

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
    CallRecord,
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


_NOT_A_QUANTITY_RE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2}:\d{1,2}\b|\b[A-Za-z]+-?\d[\w-]*")


_NUMBER_WORDS = {w: float(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve".split())} | {"none": 0.0}
_NUMBER_WORD_RE = re.compile(r"\b(" + "|".join(_NUMBER_WORDS) + r")\b", re.IGNORECASE)


def stated_quantities(text: str) -> list[float]:
    """The numbers ``text`` states as quantities: every number, in digits or as a word up to twelve ("one",
    "none"), except those inside a date (2026-06-03), a time or a ratio-like title (08:30, 1:1) or an
    identifier that starts with letters (B7777, ORD-12)."""
    text = _NOT_A_QUANTITY_RE.sub(" ", text)
    return numbers_in(text) + [_NUMBER_WORDS[w.lower()] for w in _NUMBER_WORD_RE.findall(text)]


_TEMPERATURE_RE = re.compile(r"(-?\d+(?:\.\d+)?)\s*(°\s*[CF]?|degrees?(?:\s+(?:Celsius|Fahrenheit|C|F))?|Celsius|Fahrenheit|[CF])"
                             r"(?![A-Za-z])", re.IGNORECASE)


def stated_temperatures(text: str) -> list[tuple[float, str]]:
    """The temperatures ``text`` states, each with its unit: ``"C"``, ``"F"`` or ``""`` (a bare ° or
    "degrees"). A number counts as a temperature only with one of these marks after it ("12 °C", "53.6 F",
    "20 degrees Celsius"); "45% humidity" or "at 09:30" are not temperatures."""
    found = []
    for value, mark in _TEMPERATURE_RE.findall(_NOT_A_QUANTITY_RE.sub(" ", text)):
        mark = mark.lower()
        unit = "C" if ("c" in mark.replace("degree", "")) else "F" if "f" in mark else ""
        found.append((float(value), unit))
    return found


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
    only: bool = False
    """For a count: the answer states the number and no other whole number, in digits or words (:func:`stated_quantities`;
    dates, times, identifiers and amounts with decimals aside), so that a hedge ("1, 2, 3 or 4 meetings") or
    a contradiction ("23 meetings (2 events in total)") is not credited for containing the right one."""
    unit: str = ""
    """For one temperature reading: ``"C"`` or ``"F"``, the unit ``number`` is in. The answer must then state no
    temperature that contradicts it (:func:`stated_temperatures`): one marked in ``unit`` is ``number``, one
    marked in the other unit is ``other``, an unmarked one is either. "48.2 °C is 159.78 °F" for 9 °C, or
    "44.6 °F is 44.6 °C", contain the right number and are not credited."""
    other: float | None = None
    """With ``unit``: the same reading in the other unit (the request's °C value of a conversion to °F)."""

    def __post_init__(self) -> None:
        if self.unit and (self.unit not in ("C", "F") or self.number is None or self.other is None):
            raise ValueError(f"a temperature answer item needs unit 'C' or 'F', a number and the other unit's "
                             f"reading as other (got unit={self.unit!r}, number={self.number}, other={self.other})")

    def satisfied_by(self, answer: str) -> bool:
        if self.number is not None and self.only:
            counts = [n for n in stated_quantities(answer) if n == int(n)]
            return bool(counts) and all(math.isclose(n, self.number, abs_tol=self.tolerance) for n in counts)
        if self.number is not None and self.unit:
            return self._mentions_number(answer) and all(self._consistent(value, unit)
                                                         for value, unit in stated_temperatures(answer))
        if self.number is not None:
            return self._mentions_number(answer)
        return bool(self.text) and normalize(self.text) in normalize(answer)

    def _mentions_number(self, answer: str) -> bool:
        return any(math.isclose(n, self.number, abs_tol=self.tolerance) for n in numbers_in(answer))

    def _consistent(self, value: float, unit: str) -> bool:
        """Whether a stated temperature in ``unit`` ("" = unmarked) is this reading in that unit."""
        wants = (self.number,) if unit == self.unit else (self.number, self.other) if not unit else (self.other,)
        return any(math.isclose(value, want, abs_tol=self.tolerance) for want in wants)

    def describe(self) -> str:
        if self.label:
            return self.label
        if self.number is not None and self.only:
            return f"the answer states {self.number:g} and no other count"
        if self.number is not None and self.unit:
            return f"the answer states {self.number:g} °{self.unit} and no temperature that contradicts it"
        return f"the answer mentions {self.number:g}" if self.number is not None else f"the answer mentions {self.text!r}"

    def to_dict(self) -> dict[str, Any]:
        item = {"text": self.text, "number": self.number, "tolerance": self.tolerance, "label": self.label}
        if self.only:  # written only when set: other tasks keep their content fingerprint
            item["only"] = True
        if self.unit:
            item.update(unit=self.unit, other=self.other)
        return item


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
@dataclass
class FollowUp:
    """A later user message of a multi-message task, sent once the agent has answered the previous one."""

    content: str
    add_tools: list[str] = field(default_factory=list)
    """Tools that become callable from this message on (their docs are the suite's to put in ``content``)."""


@dataclass
class EpisodeTools:
    """What one episode acts on, opened by the suite at ``reset`` and closed when the episode ends."""

    toolbox: Toolbox
    final_state: Callable[[], Any] = dict
    """Reads the state the checker compares, when the episode is scored (not when the tools are opened)."""
    close: Callable[[], None] = lambda: None
    """Releases what the episode held (a suite's teardown hook)."""


@dataclass
class EpisodeLog:
    """What a scorer reads when the episode ends."""

    trace: list[CallRecord]
    """Every attempted call in order (ran, failed, rejected, unreadable), with the user message and step it belongs to."""
    answers: list[str | None]
    """The final answer to each user message reached (None where the episode stopped while still calling tools)."""
    final_state: Any

    @property
    def calls(self) -> list[ToolCall]:
        """The valid calls (those that ran and returned), in order."""
        return [ToolCall(r.name, r.arguments) for r in self.trace if r.status == "ok"]

    @property
    def final_answer(self) -> str | None:
        """The answer to the last user message reached."""
        return self.answers[-1] if self.answers else None


class ToolUseEnvironment:
    """One episode of tool use: the tools opened for it by ``open_tools(task)`` at reset, scored by
    ``scorer(log)``, closed by :meth:`close` (the agent loop calls it when the record is written).

    ``follow_ups`` are the later user messages of the task: an assistant turn without a call answers the
    current message, and the next one (if any) is the observation (role ``user``) instead of the end.
    """

    def __init__(self, task: Task, open_tools: Callable[[Task], EpisodeTools],
                 scorer: Callable[[EpisodeLog], EpisodeResult], *, system_prompt: str,
                 prefix_messages: list[dict[str, Any]] | None = None, follow_ups: list[FollowUp] | None = None,
                 max_calls_per_turn: int = 8) -> None:
        self.task = task
        self.prefix_messages = list(prefix_messages or [])
        self.follow_ups = list(follow_ups or [])
        self._open = open_tools
        self._scorer = scorer
        self.system_prompt = system_prompt
        self.max_calls_per_turn = max_calls_per_turn
        self.tools: EpisodeTools | None = None
        self.trace: list[CallRecord] = []
        self.answers: list[str | None] = []
        self.turns = 0

    def reset(self, task: Task) -> list[dict[str, Any]]:
        self.close()
        self.task = task
        self.tools = self._open(task)
        self.trace, self.answers = [], [None]
        self.turns, self._step = 0, 0
        return [{"role": "system", "content": self.system_prompt}, *copy.deepcopy(self.prefix_messages),
                {"role": "user", "content": task.instruction}]

    @property
    def calls(self) -> list[ToolCall]:
        return EpisodeLog(self.trace, self.answers, None).calls

    @property
    def final_answer(self) -> str | None:
        return self.answers[-1] if self.answers else None

    def step(self, assistant_text: str) -> StepResult:
        if self.tools is None:
            raise RuntimeError(f"episode of {self.task.task_id}: call reset(task) before step()")
        self.turns += 1
        step, user_turn = self._step, len(self.answers) - 1
        self._step += 1
        turn = parse_tool_calls(assistant_text)
        if not turn.attempted:
            self.answers[-1] = turn.content
            if user_turn < len(self.follow_ups):
                follow_up = self.follow_ups[user_turn]
                self.tools.toolbox.enable(follow_up.add_tools)
                self.answers.append(None)
                self._step = 0
                return StepResult(observation=follow_up.content, done=False, role="user")
            return StepResult(observation=None, done=True)
        records = [CallRecord("", {}, "unparsed", error=e.message) for e in turn.errors]
        pieces = [error_observation(e) for e in turn.errors]
        for i, call in enumerate(turn.calls):
            if i >= self.max_calls_per_turn:
                record = CallRecord(call.name, call.arguments, "rejected",
                                    error=f"at most {self.max_calls_per_turn} calls per turn; {call.name} was not run")
            else:
                record = self.tools.toolbox.run(call)
            records.append(record)
            pieces.append(record.observation)
        for record in records:
            record.turn, record.step = user_turn, step
        self.trace += records
        return StepResult(observation="\n".join(pieces), done=False, role="tool", tool_calls=len(turn.calls),
                          invalid_tool_calls=sum(r.status != "ok" for r in records))

    def result(self) -> EpisodeResult:
        if self.tools is None:
            raise RuntimeError(f"episode of {self.task.task_id}: call reset(task) before result()")
        log = EpisodeLog(trace=list(self.trace), answers=list(self.answers), final_state=self.tools.final_state())
        outcome = self._scorer(log)
        outcome.checklist.update(turns=self.turns, valid_calls=len(log.calls))
        crashed = [f"{r.name}({json.dumps(r.arguments, default=str)[:200]}): {r.error}" for r in log.trace if r.exception]
        if crashed:  # a tool raised something other than ToolError: reported, not just a lower reward
            outcome.checklist["tool_exceptions"] = crashed
        if self.follow_ups:
            outcome.checklist.update(user_messages=len(self.answers), user_messages_total=1 + len(self.follow_ups))
        return outcome

    def close(self) -> None:
        """End the episode's hold on its tools (the suite's teardown); safe to call twice."""
        tools, self.tools = self.tools, None
        if tools is not None:
            tools.close()


def oracle_transcript(toolbox: Toolbox, calls: list[ToolCall], final_answer: str) -> str:
    """A correct solution as assistant text: each call with the response it gets, then the final answer."""
    lines = []
    for call in calls:
        _, result = toolbox.execute(call)
        lines += [format_tool_call(call.name, call.arguments), format_tool_response(result)]
    lines.append(final_answer)
    return "\n".join(lines)
