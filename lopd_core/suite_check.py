"""Checking a suite before running it: ``lopd suite check PATH`` (and the tests) call :func:`check_suite`.

What it does, in order: loads the suite (every format error is a :class:`~lopd_core.envs.plugin.PluginError`
naming the file and field); checks every tool schema with the ``jsonschema`` library and notes optional
parameters the agent is not told the default of; opens every task's episode (``make_state``, the tools
instance, ``teardown``), replays every oracle solution the tasks declare through the real environment and
its checker (a solution scoring below 1.0 is a problem, with the checker's feedback); measures, with the
profile's tokenizer when one is given, the longest initial prompt, oracle episode, assistant turn and tool
response; and compares those with the suite's declared ``needs`` and with the rollout settings of the
profile, so that "every episode errors at the first prompt" is found here, with the setting that fixes it.

What it does not do: sample from a model (``lopd rollout`` does), or judge whether tasks are well posed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lopd_core.envs.base import SuiteNeedsError, Task, check_needs
from lopd_core.envs.tools import check_parameters_schema
from lopd_core.rollout.oracle import oracle_replies, scripted_trajectory

CHECKS = {
    "load": "the suite file, its module, hooks and tasks load",
    "schemas": "every tool's parameters are a valid JSON schema",
    "tasks": "there are tasks",
    "episodes": "every task's episode runs without raising (make_state, the tools instance, checker, teardown)",
    "oracles": "every oracle solution scores 1 through the environment and checker, no tool crashing",
    "needs": "the declared needs cover what the oracle episodes take",
    "settings": "the profile's rollout settings meet the needs and fit the oracle episodes",
}
"""The checks of :func:`check_suite`, in order, with what each one means."""


@dataclass
class SuiteReport:
    suite: str
    tools: list[str] = field(default_factory=list)
    tasks: dict[str, int] = field(default_factory=dict)
    """Number of tasks per ``split/level``."""
    problems: list[str] = field(default_factory=list)
    """What makes the suite unusable as it is (or with these settings); each names the task, tool or setting."""
    notes: list[str] = field(default_factory=list)
    """What is worth knowing but works."""
    oracles: dict[str, int] = field(default_factory=lambda: {"replayed": 0, "passed": 0})
    measured: dict[str, Any] = field(default_factory=dict)
    """The longest ``prompt_tokens``, ``episode_tokens``, ``turn_tokens`` (with a tokenizer), ``turns`` and
    ``observation_chars`` of the oracle episodes, each as ``{"value": v, "task": id}``."""
    measured_by_level: dict[int, dict[str, Any]] = field(default_factory=dict)
    """The same, per level (needs may differ by level)."""

    checks: dict[str, list[str]] = field(default_factory=lambda: {name: [] for name in CHECKS})
    """The problems of each check (:data:`CHECKS`); a check passes when it has none."""
    skipped: list[str] = field(default_factory=list)
    """Checks that could not run (the suite did not load, or no task declares an oracle solution)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def problem(self, check: str, message: str) -> None:
        self.checks[check].append(message)
        self.problems.append(message)

    def to_dict(self) -> dict[str, Any]:
        return {"suite": self.suite, "ok": self.ok, "tools": self.tools, "tasks": self.tasks, "problems": self.problems,
                "checks": {k: {"ok": not v and k not in self.skipped, "skipped": k in self.skipped, "problems": v}
                           for k, v in self.checks.items()},
                "notes": self.notes, "oracles": self.oracles, "measured": self.measured,
                "measured_by_level": {str(k): v for k, v in sorted(self.measured_by_level.items())}}


def _record(report: SuiteReport, key: str, value: int, task: Task) -> None:
    for table in (report.measured, report.measured_by_level.setdefault(task.level, {})):
        if value > table.get(key, {}).get("value", -1):
            table[key] = {"value": value, "task": task.task_id}


def _schema_problems(report: SuiteReport, schemas: list[dict[str, Any]]) -> None:
    for schema in schemas:
        fn = schema.get("function", schema)
        params = fn.get("parameters", {}) or {}
        for problem in check_parameters_schema(params):
            report.problem("schemas", f"tool {fn['name']}: parameters are not a valid JSON schema: {problem}")
        required = set(params.get("required") or [])
        silent = [n for n, p in (params.get("properties") or {}).items()
                  if n not in required and isinstance(p, dict) and "default" not in p]
        if silent:
            report.notes.append(f"tool {fn['name']}: optional parameters without a default in the schema: {silent}")


PROCEDURAL_LIMIT = 20
"""Tasks per split and level checked in a suite that generates them (no fixed task list) when no limit is given."""


def _tasks(suite, splits: tuple[str, ...], levels: list[int], limit: int | None, report: SuiteReport) -> list[Task]:
    found = []
    for split in splits:
        for level in levels:
            try:
                tasks = suite.tasks(split, limit or 10**9, level=level)
            except (ValueError, KeyError):
                continue
            if tasks:
                report.tasks[f"{split}/{level}"] = len(tasks)
                found += tasks
    return found


def _replay(suite, task: Task, tokenizer, report: SuiteReport) -> None:
    """One task: open its episode (make_state, the tools instance, teardown), replay its oracle solution when
    it has one through the environment and checker, and measure the episode as it goes."""
    from lopd_core.records.chat import render_prompt_ids

    replies = oracle_replies(task)
    env = suite.make_env(task)
    observations: list[dict[str, Any]] = []
    outcome, ended_early = None, False
    try:
        initial = list(env.reset(task))
        for k, reply in enumerate(replies):
            step = env.step(reply)
            if step.done:
                if k < len(replies) - 1:
                    report.problem("oracles", f"task {task.task_id}: the episode ended at turn {k + 1} of its oracle "
                                           f"solution's {len(replies)} (a turn without a tool call is a final answer)")
                    replies, ended_early = replies[: k + 1], True
                break
            if step.observation is not None:
                observations.append({"role": step.role, "content": step.observation})
        if replies:
            outcome = env.result()
    finally:
        if callable(getattr(env, "close", None)):
            env.close()
    if tokenizer is not None:
        if replies:
            episode = scripted_trajectory(tokenizer, initial=initial, replies=replies,
                                          observations=observations[: len(replies)], task=task, reward=0.0,
                                          success=False)
            _record(report, "prompt_tokens", episode.prompt_len, task)
            _record(report, "episode_tokens", episode.n_tokens, task)
            run, longest = 0, 0
            for bit in episode.assistant_mask:
                run = run + 1 if bit else 0
                longest = max(longest, run)
            _record(report, "turn_tokens", longest, task)
        else:
            _record(report, "prompt_tokens", len(render_prompt_ids(tokenizer, initial, task.tools or None)), task)
    for m in observations:
        if m["role"] == "tool":
            _record(report, "observation_chars", len(m["content"]), task)
    if outcome is None:
        return
    _record(report, "turns", len(replies), task)
    report.oracles["replayed"] += 1
    crashes = outcome.checklist.get("tool_exceptions", [])
    for crash in crashes:
        report.problem("oracles", f"task {task.task_id}: a tool raised an unexpected exception in the oracle solution: "
                               f"{crash} (fix the tool, or raise lopd_core.envs.tools.ToolError for a domain error)")
    if outcome.reward >= 1.0 and not crashes and not ended_early:
        report.oracles["passed"] += 1
    elif outcome.reward < 1.0:
        report.problem("oracles", f"task {task.task_id}: its oracle solution scores {outcome.reward:g}, not 1: "
                               f"{outcome.feedback or '(the checker gave no feedback)'}")


_NEEDS = {"context_tokens": ("episode_tokens", "max_trajectory_tokens"), "turns": ("turns", "max_turns"),
          "new_tokens": ("turn_tokens", "max_new_tokens"), "observation_chars": ("observation_chars", None)}


def _compare(report: SuiteReport, needs, rollout) -> None:
    """The measured oracle episodes of each level against the level's declared needs and the rollout settings."""
    for level, measured in sorted(report.measured_by_level.items()):
        declared = needs.for_level(level) if needs is not None else None
        for need, (key, setting) in _NEEDS.items():
            seen, want = measured.get(key), getattr(declared, need, 0) if declared is not None else 0
            if seen is None:
                continue
            if want and seen["value"] > want:
                report.problem("needs", f"level {level}: needs.{need}={want} is below what the oracle solution of "
                                       f"{seen['task']} takes ({seen['value']}); declare at least that")
            elif not want and setting is not None:
                report.notes.append(f"level {level}: the oracle episodes take up to {seen['value']} "
                                    f"{key.replace('_', ' ')} ({seen['task']}); declare needs.{need} so that runs "
                                    "with less fail before they start")
            if rollout is not None and setting is not None and seen["value"] > getattr(rollout, setting):
                # Over the context cap no episode like the oracle's fits; more turns or longer turns than the
                # settings allow may still be solved another way (fewer calls per turn, calls batched in one turn).
                found = (lambda m: report.problem("settings", m)) if need == "context_tokens" else report.notes.append
                found(f"level {level}: the oracle solution of {seen['task']} takes {seen['value']} "
                             f"{key.replace('_', ' ')}, over rollout.{setting}={getattr(rollout, setting)}: episodes "
                             f"would be cut before one like it ends; --set rollout.{setting}={seen['value']}")
        prompt = measured.get("prompt_tokens")
        if rollout is not None and prompt and prompt["value"] >= rollout.max_trajectory_tokens:
            report.problem("settings", f"level {level}: the initial prompt of {prompt['task']} is {prompt['value']} tokens, "
                                   f"not under rollout.max_trajectory_tokens={rollout.max_trajectory_tokens}: its "
                                   "episodes would error at the first turn")


def check_suite(name_or_path: str, *, rollout=None, tokenizer=None, limit: int | None = None) -> SuiteReport:
    """Validate a suite (built-in name or plug-in YAML path) and replay its oracle solutions.

    ``rollout``: a ``RolloutConfig`` to check the suite against (its needs and the measured episodes);
    ``tokenizer``: measure in tokens (the chat template of the model that will play); ``limit``: at most this
    many tasks of each split and level (all by default).
    """
    from lopd_core.envs import get_suite
    from lopd_core.envs.base import SPLITS
    from lopd_core.envs.plugin import PluginError

    report = SuiteReport(suite=str(name_or_path))
    try:
        suite = get_suite(name_or_path)
    except (PluginError, ValueError) as exc:
        report.problem("load", f"the suite does not load: {exc}")
        report.skipped = [c for c in CHECKS if c != "load"]
        return report
    report.suite = suite.name
    spec = getattr(suite, "spec", None)
    if spec is not None:
        report.tools = list(spec.tool_names)
        _schema_problems(report, spec.schemas)
    needs = getattr(suite, "needs", None)
    if spec is not None:
        levels = sorted({row["level"] for row in spec.tasks})
    else:
        levels = list(range(1, 6))
        if limit is None:
            limit = PROCEDURAL_LIMIT
            report.notes.append(f"suite {suite.name} generates its tasks: {limit} per split and level checked "
                                "(--limit for more)")
    tasks = _tasks(suite, SPLITS, levels, limit, report)
    if rollout is not None:
        try:
            check_needs(suite, rollout, levels={t.level for t in tasks} or None)
        except SuiteNeedsError as exc:
            for problem in exc.problems:
                report.problem("settings", problem)
    if not tasks:
        report.problem("tasks", f"suite {suite.name} has no tasks in any split at levels {levels}")
    if spec is not None:
        for task in tasks:
            if task.tools == [] and spec.tool_names:
                report.notes.append(f"task {task.task_id} offers no tool at its first message")
    for task in tasks:
        try:
            _replay(suite, task, tokenizer, report)
        except Exception as exc:  # noqa: BLE001 - a broken hook is the finding, not a crash of the check
            named = str(exc).startswith("plug-in suite")  # the plug-in's own wrapper already names suite, task and hook
            report.problem("episodes", f"task {task.task_id}: " + (str(exc) if named else f"{type(exc).__name__}: {exc}"))
    if not report.oracles["replayed"]:
        report.skipped.append("oracles")
        report.notes.append("no task declares an oracle solution (oracle or oracle_turns): nothing was replayed")
    if rollout is None:
        report.skipped.append("settings")
    _compare(report, needs, rollout)
    return report
