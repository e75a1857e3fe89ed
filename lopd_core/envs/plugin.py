"""Plug-in tool-use suites: a YAML file naming a Python module of tools, a JSONL file of tasks and a checker.

A user adds an environment without touching the library and selects it with ``--suite path/to/suite.yaml``
(``get_suite`` treats any ``.yaml`` path as a plug-in). The format is documented in
``docs/plugin-suites.md``; the example in ``lopd_core/envs/suites/example/`` is a small library-loans domain.

The module's tools are typed, documented functions (schemas from ``get_json_schema``), either plain
functions (stateless) or the methods of a class instantiated with each task's ``initial_state`` (its
``state`` attribute is the final state the checker compares). The default checker is the toolworld
checklist (:mod:`lopd_core.envs.tool_env`): ``expected_calls``, ``expected_state`` (the records that
must change, as they must end up; ``null`` deletes) and ``expected_answer``; a custom checker function can
replace it. Every problem in the files is reported with the file, the line or field, and the fix.

The plug-in's module is imported into this process: it is trusted code, like any Python you install.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import inspect
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from lopd_core.envs.base import EpisodeResult, Split, Task
from lopd_core.envs.tool_env import AnswerItem, Checklist, ToolUseEnvironment, score_checklist
from lopd_core.envs.tools import Toolbox, ToolCall, format_tool_call, format_tool_response, schema_of

EXAMPLE_SUITE = Path(__file__).parent / "suites" / "example" / "suite.yaml"
_YAML_KEYS = {"name", "kind", "description", "tools", "tasks", "system_prompt", "example_call", "examples", "checker"}
_TOOLS_KEYS = {"module", "class", "functions"}
_TASK_KEYS = {"id", "split", "level", "instruction", "initial_state", "expected_state", "expected_calls",
              "expected_answer", "oracle", "family"}


class PluginError(ValueError):
    """A problem in a plug-in suite's files; the message names the file, the field or line, and the fix."""


@dataclass
class PluginSpec:
    name: str
    path: Path
    module: Any
    tools_class: type | None
    tool_names: list[str]
    schemas: list[dict[str, Any]]
    system_prompt: str
    tasks: list[dict[str, Any]]
    checker: Callable[..., Any] | None
    examples: list[dict[str, Any]]
    """Worked examples as chat messages, played before every task's request."""


def _import_module(ref: str, base: Path, where: str):
    candidate = (base / ref) if not Path(ref).is_absolute() else Path(ref)
    if ref.endswith(".py") or candidate.exists():
        if not candidate.is_file():
            raise PluginError(f"{where}: module file {candidate} not found; give a path relative to the YAML file")
        digest = hashlib.sha1(str(candidate.resolve()).encode()).hexdigest()[:10]
        spec = importlib.util.spec_from_file_location(f"lopd_plugin_{candidate.stem}_{digest}", candidate)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise PluginError(f"{where}: importing {candidate} failed: {type(exc).__name__}: {exc}") from exc
        return module
    try:
        return importlib.import_module(ref)
    except ImportError as exc:
        raise PluginError(f"{where}: cannot import module {ref!r} ({exc}); give a .py path relative to the YAML "
                          "or an importable module name") from exc


def _tools(section: Any, base: Path, yaml_path: Path) -> tuple[Any, type | None, list[str], list[dict[str, Any]]]:
    where = f"{yaml_path}: tools"
    if isinstance(section, str):
        section = {"module": section}
    if not isinstance(section, dict) or "module" not in section:
        raise PluginError(f"{where} must be a mapping with at least 'module' (a .py file next to the YAML)")
    unknown = set(section) - _TOOLS_KEYS
    if unknown:
        raise PluginError(f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(_TOOLS_KEYS)})")
    module = _import_module(str(section["module"]), base, where + ".module")
    cls = None
    if section.get("class"):
        cls = getattr(module, section["class"], None)
        if not inspect.isclass(cls):
            raise PluginError(f"{where}.class: {section['class']!r} is not a class in {section['module']}")
        owner = cls
    else:
        owner = module
    names = section.get("functions")
    if names is None:
        names = [n for n, f in inspect.getmembers(owner, inspect.isfunction)
                 if not n.startswith("_") and f.__doc__ and (cls is not None or f.__module__ == module.__name__)]
    if not names:
        raise PluginError(f"{where}: no tool functions found; list them under tools.functions or give public, "
                          "documented functions")
    probe = cls.__new__(cls) if cls is not None else None
    schemas = []
    for name in names:
        fn = getattr(probe if probe is not None else module, name, None)
        if not callable(fn):
            raise PluginError(f"{where}.functions: {name!r} is not a function of {section.get('class') or section['module']}")
        try:
            schemas.append(schema_of(fn))
        except ValueError as exc:
            raise PluginError(f"{where}.functions: {exc}") from None
    return module, cls, list(names), schemas


def _read_tasks(path: Path, yaml_path: Path, has_state: bool) -> list[dict[str, Any]]:
    if not path.is_file():
        raise PluginError(f"{yaml_path}: tasks file {path} not found; give a JSONL path relative to the YAML file")
    tasks, seen = [], set()
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PluginError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise PluginError(f"{where}: each line must be a JSON object")
        unknown = set(row) - _TASK_KEYS
        if unknown:
            raise PluginError(f"{where}: unknown fields {sorted(unknown)} (allowed: {sorted(_TASK_KEYS)})")
        for key in ("id", "instruction"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise PluginError(f"{where}: field '{key}' is required and must be a non-empty string")
        if row["id"] in seen:
            raise PluginError(f"{where}: duplicate task id {row['id']!r}")
        seen.add(row["id"])
        row.setdefault("split", "train")
        row.setdefault("level", 1)
        if row["split"] not in ("train", "test"):
            raise PluginError(f"{where}: split must be 'train' or 'test' (got {row['split']!r})")
        if not isinstance(row["level"], int) or row["level"] < 1:
            raise PluginError(f"{where}: level must be a positive integer (got {row['level']!r})")
        if ("initial_state" in row or "expected_state" in row) and not has_state:
            raise PluginError(f"{where}: initial_state/expected_state need a tools.class whose instances hold the state")
        if not any(k in row for k in ("expected_state", "expected_calls", "expected_answer")):
            raise PluginError(f"{where}: give at least one of expected_state, expected_calls, expected_answer")
        for i, call in enumerate(row.get("expected_calls", [])):
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise PluginError(f"{where}: expected_calls[{i}] must be {{\"name\": ..., \"arguments\": {{...}}}}")
        row["answer_items"] = [_answer_item(a, f"{where}: expected_answer") for a in row.get("expected_answer", [])]
        tasks.append(row)
    if not tasks:
        raise PluginError(f"{path}: no tasks (one JSON object per line)")
    return tasks


def _answer_item(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, bool):
        raise PluginError(f"{where}: {value!r} is not a text or number")
    if isinstance(value, int | float):
        return AnswerItem(number=float(value)).to_dict()
    if isinstance(value, str):
        return AnswerItem(text=value).to_dict()
    if isinstance(value, dict) and ("text" in value or "number" in value):
        try:
            return AnswerItem(**value).to_dict()
        except TypeError as exc:
            raise PluginError(f"{where}: {exc}") from None
    raise PluginError(f"{where}: items are strings, numbers or {{\"number\": x, \"tolerance\": t}}")


def _examples(raw: Any, names: list[str], path: Path) -> list[dict[str, Any]]:
    """``examples: [{request, call: {name, arguments}, response, answer}]`` as user/assistant/tool turns."""
    if not isinstance(raw, list):
        raise PluginError(f"{path}: examples must be a list of {{request, call, response, answer}}")
    messages = []
    for i, ex in enumerate(raw):
        where = f"{path}: examples[{i}]"
        if not isinstance(ex, dict) or set(ex) - {"request", "call", "response", "answer"} or not {"request", "call", "answer"} <= set(ex):
            raise PluginError(f"{where} needs request, call ({{name, arguments}}), answer and optionally response")
        call = ex["call"]
        if not isinstance(call, dict) or call.get("name") not in names:
            raise PluginError(f"{where}.call must be {{name: <one of {names}>, arguments: {{...}}}}")
        messages += [{"role": "user", "content": str(ex["request"])},
                     {"role": "assistant", "content": format_tool_call(call["name"], call.get("arguments", {}))},
                     {"role": "tool", "content": format_tool_response(ex.get("response", ""))},
                     {"role": "assistant", "content": str(ex["answer"])}]
    return messages


def apply_patch(initial: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """The expected final state: ``initial`` with the patched records replaced (``None`` deletes)."""
    state = copy.deepcopy(initial)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(state.get(key), dict) and all(
                isinstance(v, dict) for v in state[key].values()):
            for sub, record in value.items():
                if record is None:
                    state[key].pop(sub, None)
                else:
                    state[key][sub] = record
        elif value is None:
            state.pop(key, None)
        else:
            state[key] = value
    return state


def load_plugin_spec(path: Path) -> PluginSpec:
    path = Path(path)
    if not path.is_file():
        raise PluginError(f"plug-in suite {path} not found; pass the path of a suite YAML (see docs/plugin-suites.md)")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise PluginError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise PluginError(f"{path}: the suite file must be a mapping with name, tools and tasks")
    unknown = set(raw) - _YAML_KEYS
    if unknown:
        raise PluginError(f"{path}: unknown keys {sorted(unknown)} (allowed: {sorted(_YAML_KEYS)})")
    for key in ("name", "tools", "tasks"):
        if key not in raw:
            raise PluginError(f"{path}: '{key}' is required")
    if raw.get("kind", "tool") != "tool":
        raise PluginError(f"{path}: kind must be 'tool' (plug-in code suites are not supported yet)")
    base = path.parent
    module, cls, names, schemas = _tools(raw["tools"], base, path)
    tasks = _read_tasks(base / str(raw["tasks"]), path, has_state=cls is not None)
    prompt = str(raw.get("system_prompt") or "You are a helpful assistant. Use the tools; never invent data.").strip()
    example = raw.get("example_call")
    if example is not None:
        if not isinstance(example, dict) or example.get("name") not in names:
            raise PluginError(f"{path}: example_call must be {{name: <one of {names}>, arguments: {{...}}}}")
        prompt += f"\nExample: {format_tool_call(example['name'], example.get('arguments', {}))}"
    examples = _examples(raw.get("examples") or [], names, path)
    checker = None
    if raw.get("checker"):
        ref = str(raw["checker"])
        mod_ref, _, fn_name = ref.rpartition(":")
        if not fn_name or not mod_ref:
            raise PluginError(f"{path}: checker must be 'module.py:function' (got {ref!r})")
        checker = getattr(_import_module(mod_ref, base, f"{path}: checker"), fn_name, None)
        if not callable(checker):
            raise PluginError(f"{path}: checker function {fn_name!r} not found in {mod_ref}")
    return PluginSpec(name=str(raw["name"]), path=path, module=module, tools_class=cls, tool_names=names,
                      schemas=schemas, system_prompt=prompt, tasks=tasks, checker=checker, examples=examples)


class PluginSuite:
    kind: Literal["tool", "code"] = "tool"

    def __init__(self, spec: PluginSpec) -> None:
        self.spec = spec
        self.name = spec.name

    def tasks(self, split: Split, n: int, *, level: int = 1, seed: int = 0) -> list[Task]:
        """The suite's tasks of this split and level (at most ``n``; a fixed dataset never repeats a task)."""
        pool = [t for t in self.spec.tasks if t["split"] == split and t["level"] == level]
        if not pool:
            have = sorted({(t["split"], t["level"]) for t in self.spec.tasks})
            raise ValueError(f"plug-in suite {self.name}: no tasks with split={split!r} and level={level} "
                             f"(the tasks file has {have})")
        chosen = pool if seed == 0 else random.Random(f"{self.name}/{seed}").sample(pool, len(pool))
        return [self._task(row) for row in chosen[:n]]

    def _task(self, row: dict[str, Any]) -> Task:
        payload = {k: row[k] for k in ("id", "initial_state", "expected_state", "expected_calls", "answer_items") if k in row}
        return Task(task_id=f"{self.name}/{row['id']}", suite=self.name, family=row.get("family", self.name),
                    split=row["split"], level=row["level"], instruction=row["instruction"], tools=self.spec.schemas,
                    payload=payload, oracle=row.get("oracle", ""))

    def _toolbox(self, state: dict[str, Any]):
        if self.spec.tools_class is None:
            functions = {n: getattr(self.spec.module, n) for n in self.spec.tool_names}
            return Toolbox(functions, self.spec.schemas), lambda: {}
        instance = self.spec.tools_class(state)
        if not hasattr(instance, "state"):
            instance.state = state
        return Toolbox({n: getattr(instance, n) for n in self.spec.tool_names}, self.spec.schemas), lambda: instance.state

    def make_env(self, task: Task) -> ToolUseEnvironment:
        payload = task.payload
        if task.suite != self.name:
            raise ValueError(f"task {task.task_id} belongs to suite {task.suite!r}, not {self.name!r}")
        initial = payload.get("initial_state", {})
        checklist = Checklist(
            calls=[ToolCall(c["name"], c.get("arguments", {})) for c in payload.get("expected_calls", [])],
            answer=[AnswerItem(**a) for a in payload.get("answer_items", [])],
            initial_state=initial,
            expected_state=apply_patch(initial, payload["expected_state"]) if "expected_state" in payload else None,
        )
        custom = self.spec.checker

        def scorer(calls, final_answer, final_state):
            if custom is None:
                return score_checklist(checklist, calls=calls, final_answer=final_answer, final_state=final_state)
            out = custom(task=payload, calls=[c.to_dict() for c in calls], final_answer=final_answer,
                         final_state=final_state)
            reward = float(out["reward"])
            if not 0.0 <= reward <= 1.0:
                raise ValueError(f"plug-in checker of {self.name} returned reward {reward} outside [0, 1]")
            return EpisodeResult(reward=reward, success=bool(out.get("success", reward >= 0.8)),
                                 feedback=str(out.get("feedback", "")), checklist=dict(out.get("checklist", {})))

        return ToolUseEnvironment(task, self._toolbox, scorer, system_prompt=self.spec.system_prompt,
                                  prefix_messages=self.spec.examples)


def load_plugin_suite(path: Path) -> PluginSuite:
    return PluginSuite(load_plugin_spec(Path(path)))
