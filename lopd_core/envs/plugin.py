"""Plug-in tool-use suites: a YAML file naming a Python module of tools, the tasks, and optionally the hooks
that build each episode's state and score it.

A user adds an environment without touching the library and selects it with ``--suite path/to/suite.yaml``
(``get_suite`` treats any ``.yaml`` path as a plug-in). The format is documented in
``docs/plugin-suites.md``; ``lopd_core/envs/suites/example/`` is a small library-loans domain and
``lopd_core/envs/suites/bfcl_multi_turn/`` ports BFCL v4 multi-turn (executable backends, its own checker)
in this format. ``lopd suite check PATH`` validates a suite and replays its oracle solutions.

What the format holds:

- **tools**: typed, documented functions (schemas from ``get_json_schema``, defaults included) or tools given
  as JSON schemas; plain functions (stateless) or the methods of a class instantiated once per episode with
  the episode's state. Tools are listed explicitly (``functions``, ``schemas``), marked with
  :func:`lopd_core.envs.tools.tool`, or discovered (public documented functions, helpers such as ``reset`` or
  ``get_state`` left out).
- **state**: the task's JSON ``initial_state``, or any Python object built by a ``make_state`` hook from the
  task (with read-only ``shared`` data loaded once per process). Each episode gets its own state and
  instance, and the class's ``teardown`` method (when named) runs when the episode ends, so episodes played
  together in one batch never share anything the suite does not share on purpose.
- **tasks**: a JSONL file or a function returning the rows; each row may carry free ``data`` (handed to the
  checker), a per-task ``system_prompt``, a subset of the ``tools``, ``follow_ups`` (later user messages,
  each able to make more tools callable) and an oracle solution (``oracle`` or ``oracle_turns``).
- **checker**: the toolworld checklist (:mod:`lopd_core.envs.tool_env`) by default (``expected_calls``,
  ``expected_state``, ``expected_answer``), or a function that receives, by keyword, whichever of the full
  task row, the valid calls, the full trace (rejected and failed calls with their errors), the answers and
  the final state it names.
- **needs**: context, turns, tokens per turn, observation size and Python packages the episodes need
  (:class:`lopd_core.envs.base.SuiteNeeds`), checked before any episode runs.

Every problem in the files is reported with the file, the line or field, and the fix. The plug-in's module is
imported into this process: it is trusted code, like any Python you install.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from lopd_core.envs.base import NEEDS_FIELDS, SPLITS, EpisodeResult, Split, SuiteNeeds, Task
from lopd_core.envs.tool_env import (
    SUCCESS_THRESHOLD,
    AnswerItem,
    Checklist,
    EpisodeLog,
    EpisodeTools,
    FollowUp,
    ToolUseEnvironment,
    score_checklist,
)
from lopd_core.envs.tools import (
    Toolbox,
    ToolCall,
    check_parameters_schema,
    format_tool_call,
    format_tool_response,
    schema_of,
)

EXAMPLE_SUITE = Path(__file__).parent / "suites" / "example" / "suite.yaml"
BUILTIN_PLUGIN_SUITES = {"bfcl_multi_turn": Path(__file__).parent / "suites" / "bfcl_multi_turn" / "suite.yaml"}
"""Built-in suites written in the plug-in format, by name."""
_YAML_KEYS = {"name", "kind", "description", "tools", "tasks", "system_prompt", "example_call", "examples", "checker",
              "make_state", "shared", "needs"}
_TOOLS_KEYS = {"module", "class", "functions", "schemas", "teardown", "coerce_numbers", "check_types",
               "callable_before_added"}
_TASK_KEYS = {"id", "split", "level", "instruction", "initial_state", "expected_state", "expected_calls",
              "expected_answer", "oracle", "oracle_turns", "family", "data", "system_prompt", "tools", "follow_ups"}
_NEEDS_KEYS = {*NEEDS_FIELDS, "packages", "levels"}
HELPER_NAMES = frozenset({"reset", "close", "teardown", "get_state", "set_state", "load_state", "save_state"})
"""Method names default discovery never takes for tools (lifecycle and state helpers)."""
CHECKER_ARGUMENTS = ("task", "calls", "trace", "final_answer", "answers", "final_state", "shared")
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Use the tools; never invent data."


class PluginError(ValueError):
    """A problem in a plug-in suite's files; the message names the file, the field or line, and the fix."""


# --------------------------------------------------------------------------------------------------
@dataclass
class Hook:
    """A function of the plug-in called with the keyword arguments it names among those offered."""

    fn: Callable[..., Any]
    ref: str
    accepts: tuple[str, ...] | None
    """The parameter names it takes (None: it takes ``**kwargs``, so everything offered)."""

    def __call__(self, **offered: Any) -> Any:
        return self.fn(**(offered if self.accepts is None else {k: v for k, v in offered.items() if k in self.accepts}))

    def load(self, where: str, **offered: Any) -> Any:
        """Call a hook that runs while the suite loads: whatever it raises becomes a :class:`PluginError`
        naming the file, the field and the hook."""
        try:
            return self(**offered)
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(f"{where}: {self.ref} raised {type(exc).__name__}: {exc}") from exc


def _import_module(ref: str, base: Path, where: str):
    candidate = (base / ref) if not Path(ref).is_absolute() else Path(ref)
    if ref.endswith(".py") or candidate.exists():
        if not candidate.is_file():
            raise PluginError(f"{where}: module file {candidate} not found; give a path relative to the YAML file")
        digest = hashlib.sha1(str(candidate.resolve()).encode()).hexdigest()[:10]
        name = f"lopd_plugin_{candidate.stem}_{digest}"
        spec = importlib.util.spec_from_file_location(name, candidate)
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


def _hook(ref: Any, base: Path, where: str, offered: tuple[str, ...], modules: dict[str, Any]) -> Hook:
    """``module.py:function`` as a :class:`Hook` whose parameters are all among ``offered``."""
    ref = str(ref)
    mod_ref, _, fn_name = ref.rpartition(":")
    if not fn_name or not mod_ref:
        raise PluginError(f"{where} must be 'module.py:function' (got {ref!r})")
    if mod_ref not in modules:
        modules[mod_ref] = _import_module(mod_ref, base, where)
    fn = getattr(modules[mod_ref], fn_name, None)
    if not callable(fn):
        raise PluginError(f"{where}: function {fn_name!r} not found in {mod_ref}")
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return Hook(fn, ref, None)
    unknown = [p.name for p in params if p.name not in offered and p.default is p.empty]
    if unknown or any(p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL) for p in params):
        raise PluginError(f"{where}: {ref} takes {[p.name for p in params]}; it is called with keyword arguments, "
                          f"any of {list(offered)} (unknown: {unknown})")
    return Hook(fn, ref, tuple(p.name for p in params if p.name in offered))


# --------------------------------------------------------------------------------------------------
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
    checker: Hook | None
    examples: list[dict[str, Any]]
    """Worked examples as chat messages, played before every task's request."""
    make_state: Hook | None = None
    shared: Any = None
    """What the ``shared`` hook returned (loaded once, when the suite loads); read-only by convention."""
    teardown: str | None = None
    coerce_numbers: bool = False
    """Numeric strings for number parameters become numbers (:func:`lopd_core.envs.tools.prepare_arguments`)."""
    check_types: bool = True
    """False: only argument names are validated (:func:`lopd_core.envs.tools.validation_schema`)."""
    callable_before_added: bool = False
    """True: the tools a follow-up adds can be called (unshown) before it, as a benchmark's executor may allow."""
    needs: SuiteNeeds = field(default_factory=SuiteNeeds)
    description: str = ""


def _normalise_schema(schema: Any, where: str) -> dict[str, Any]:
    if not isinstance(schema, dict):
        raise PluginError(f"{where}: each tool schema must be a mapping with name, description and parameters")
    fn = schema.get("function", schema)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise PluginError(f"{where}: a tool schema needs a 'name' (got keys {sorted(fn) if isinstance(fn, dict) else fn})")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    problems = check_parameters_schema(params)
    if problems:
        raise PluginError(f"{where}: tool {fn['name']!r}: parameters are not a valid JSON schema: {problems[0]}")
    return {"type": "function", "function": {**fn, "parameters": params}}


def _tools(section: Any, base: Path, yaml_path: Path, modules: dict[str, Any], shared: Any):
    where = f"{yaml_path}: tools"
    if isinstance(section, str):
        section = {"module": section}
    if not isinstance(section, dict) or "module" not in section:
        raise PluginError(f"{where} must be a mapping with at least 'module' (a .py file next to the YAML)")
    unknown = set(section) - _TOOLS_KEYS
    if unknown:
        raise PluginError(f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(_TOOLS_KEYS)})")
    module = _import_module(str(section["module"]), base, where + ".module")
    modules[str(section["module"])] = module
    cls = None
    if section.get("class"):
        cls = getattr(module, section["class"], None)
        if not inspect.isclass(cls):
            raise PluginError(f"{where}.class: {section['class']!r} is not a class in {section['module']}")
    owner = cls if cls is not None else module
    teardown = section.get("teardown")
    if teardown is not None and (cls is None or not callable(getattr(cls, str(teardown), None))):
        raise PluginError(f"{where}.teardown: {teardown!r} must name a method of tools.class")
    options = {key: section.get(key, default) for key, default in
               (("coerce_numbers", False), ("check_types", True), ("callable_before_added", False))}
    for key, value in options.items():
        if not isinstance(value, bool):
            raise PluginError(f"{where}.{key} must be true or false (got {value!r})")

    schemas: list[dict[str, Any]] | None = None
    if section.get("schemas") is not None:
        ref = str(section["schemas"])
        if ref.endswith(".json"):
            path = base / ref
            if not path.is_file():
                raise PluginError(f"{where}.schemas: {path} not found; give a JSON file relative to the YAML")
            try:
                raw = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise PluginError(f"{where}.schemas: {path} is not valid JSON ({exc.msg})") from None
        else:
            raw = _hook(ref, base, where + ".schemas", ("shared",), modules).load(where + ".schemas", shared=shared)
        if not isinstance(raw, list) or not raw:
            raise PluginError(f"{where}.schemas must give a non-empty list of tool schemas")
        schemas = [_normalise_schema(s, f"{where}.schemas[{i}]") for i, s in enumerate(raw)]

    names = section.get("functions")
    if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
        raise PluginError(f"{where}.functions must be a list of function names")
    if names is None and schemas is not None:
        names = [s["function"]["name"] for s in schemas]
    if names is None:
        names = _discover(owner, module, cls is not None, {str(teardown)} if teardown else set())
    if not names:
        raise PluginError(f"{where}: no tool functions found; list them under tools.functions, mark them with "
                          "@lopd_core.envs.tools.tool, or give public, documented functions")
    if len(set(names)) != len(names):
        raise PluginError(f"{where}: tool names must be unique (got {names})")

    if schemas is not None:
        by_name = {s["function"]["name"]: s for s in schemas}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise PluginError(f"{where}.functions: {missing} have no schema in tools.schemas")
        dynamic = cls is not None and hasattr(cls, "__getattr__")
        absent = [n for n in names if not dynamic and not callable(getattr(owner, n, None))]
        if absent:
            raise PluginError(f"{where}.schemas: {absent} are not functions of {section.get('class') or section['module']}")
        return module, cls, list(names), [by_name[n] for n in names], teardown, options

    probe = cls.__new__(cls) if cls is not None else None  # bound methods, without running __init__
    schemas = []
    for name in names:
        fn = getattr(probe if probe is not None else module, name, None)
        if not callable(fn):
            raise PluginError(f"{where}.functions: {name!r} is not a function of {section.get('class') or section['module']}")
        try:
            schemas.append(schema_of(fn))
        except ValueError as exc:
            raise PluginError(f"{where}.functions: {exc}") from None
    return module, cls, list(names), schemas, teardown, options


def _discover(owner: Any, module: Any, is_class: bool, lifecycle: set[str]) -> list[str]:
    """Tools found without a list: those marked with ``@tool`` if any are, else every public documented
    function (of the module, or method of the class) that is not a lifecycle or state helper."""
    found = [(n, f) for n, f in inspect.getmembers(owner, inspect.isfunction)
             if is_class or f.__module__ == module.__name__]
    marked = [n for n, f in found if getattr(f, "__lopd_tool__", False)]
    if marked:
        return marked
    return [n for n, f in found if not n.startswith("_") and f.__doc__ and n not in HELPER_NAMES | lifecycle]


# --------------------------------------------------------------------------------------------------
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
        except (TypeError, ValueError) as exc:
            raise PluginError(f"{where}: {exc}") from None
    raise PluginError(f"{where}: items are strings, numbers or {{\"number\": x}} with optional \"tolerance\": t, "
                      f"\"only\": true (a count) or \"unit\": \"C\"|\"F\" and \"other\": y (a temperature), got {value!r}")


def _names_field(value: Any, tool_names: list[str], where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise PluginError(f"{where} must be a list of tool names")
    unknown = [n for n in value if n not in tool_names]
    if unknown:
        raise PluginError(f"{where}: {unknown} are not tools of the suite (its tools: {tool_names})")
    return list(value)


def _task_row(row: Any, where: str, *, has_state: bool, has_checker: bool, tool_names: list[str]) -> dict[str, Any]:
    """One task row checked and completed (defaults, answer items); every problem names the field."""
    if not isinstance(row, dict):
        raise PluginError(f"{where}: each task must be a JSON object")
    unknown = set(row) - _TASK_KEYS
    if unknown:
        raise PluginError(f"{where}: unknown fields {sorted(unknown)} (allowed: {sorted(_TASK_KEYS)}; put free "
                          "per-task data under 'data')")
    for key in ("id", "instruction"):
        if not isinstance(row.get(key), str) or not row[key].strip():
            raise PluginError(f"{where}: field '{key}' is required and must be a non-empty string")
    row = dict(row)
    row.setdefault("split", "train")
    row.setdefault("level", 1)
    if row["split"] not in SPLITS:
        raise PluginError(f"{where}: split must be one of {list(SPLITS)} (got {row['split']!r})")
    if not isinstance(row["level"], int) or isinstance(row["level"], bool) or row["level"] < 1:
        raise PluginError(f"{where}: level must be a positive integer (got {row['level']!r})")
    if ("initial_state" in row or "expected_state" in row) and not has_state:
        raise PluginError(f"{where}: initial_state/expected_state need a tools.class whose instances hold the state")
    if not has_checker and not any(k in row for k in ("expected_state", "expected_calls", "expected_answer")):
        raise PluginError(f"{where}: give at least one of expected_state, expected_calls, expected_answer "
                          "(or a custom checker in suite.yaml)")
    for i, call in enumerate(row.get("expected_calls", [])):
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise PluginError(f"{where}: expected_calls[{i}] must be {{\"name\": ..., \"arguments\": {{...}}}}")
    row["answer_items"] = [_answer_item(a, f"{where}: expected_answer") for a in row.get("expected_answer", [])]
    for key in ("system_prompt", "oracle"):
        if key in row and not isinstance(row[key], str):
            raise PluginError(f"{where}: {key} must be a string")
    if "oracle_turns" in row and (not isinstance(row["oracle_turns"], list)
                                  or not all(isinstance(t, str) for t in row["oracle_turns"])):
        raise PluginError(f"{where}: oracle_turns must be a list of assistant messages (strings)")
    if "tools" in row:
        row["tools"] = _names_field(row["tools"], tool_names, f"{where}: tools")
    follow_ups = []
    for i, item in enumerate(row.get("follow_ups", [])):
        label = f"{where}: follow_ups[{i}]"
        if isinstance(item, str):
            item = {"content": item}
        if not isinstance(item, dict) or set(item) - {"content", "add_tools"} or not isinstance(item.get("content"), str) \
                or not item["content"].strip():
            raise PluginError(f"{label} must be a user message (a string) or {{content, add_tools}}")
        follow_ups.append({"content": item["content"],
                           "add_tools": _names_field(item.get("add_tools", []), tool_names, f"{label}.add_tools")})
    if "follow_ups" in row:
        row["follow_ups"] = follow_ups
    return row


def _read_jsonl(path: Path, yaml_path: Path) -> list[tuple[str, Any]]:
    if not path.is_file():
        raise PluginError(f"{yaml_path}: tasks file {path} not found; give a JSONL path relative to the YAML file")
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            rows.append((f"{path}:{lineno}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise PluginError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not rows:
        raise PluginError(f"{path}: no tasks (one JSON object per line)")
    return rows


def _read_tasks(ref: str, base: Path, yaml_path: Path, modules: dict[str, Any], shared: Any, **checks: Any):
    if ref.endswith((".jsonl", ".json")) or ":" not in ref:
        located = _read_jsonl(base / ref, yaml_path)
    else:
        made = _hook(ref, base, f"{yaml_path}: tasks", ("shared",), modules).load(f"{yaml_path}: tasks", shared=shared)
        located = [(f"{ref} task {i}", row) for i, row in enumerate(made or [])]
        if not located:
            raise PluginError(f"{yaml_path}: tasks: {ref} returned no tasks")
    tasks, seen = [], set()
    for where, row in located:
        row = _task_row(row, where, **checks)
        if row["id"] in seen:
            raise PluginError(f"{where}: duplicate task id {row['id']!r}")
        seen.add(row["id"])
        tasks.append(row)
    return tasks


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


def _sizes(raw: Any, where: str) -> dict[str, int]:
    if not isinstance(raw, dict) or set(raw) - set(NEEDS_FIELDS):
        extra = sorted(set(raw) - set(NEEDS_FIELDS)) if isinstance(raw, dict) else raw
        raise PluginError(f"{where} must be a mapping of {list(NEEDS_FIELDS)} (unknown: {extra})")
    for key, value in raw.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise PluginError(f"{where}.{key} must be a non-negative integer (got {value!r})")
    return dict(raw)


def _needs(raw: Any, path: Path) -> SuiteNeeds:
    if raw is None:
        return SuiteNeeds()
    if not isinstance(raw, dict):
        raise PluginError(f"{path}: needs must be a mapping of {sorted(_NEEDS_KEYS)}")
    packages = raw.get("packages", [])
    if not isinstance(packages, list) or not all(isinstance(p, str) and p.strip() for p in packages):
        raise PluginError(f"{path}: needs.packages must be a list of distribution names (as pip installs them)")
    levels = raw.get("levels", {})
    if not isinstance(levels, dict) or not all(isinstance(k, int) and k >= 1 for k in levels):
        raise PluginError(f"{path}: needs.levels must map levels (positive integers) to needs")
    sizes = _sizes({k: v for k, v in raw.items() if k not in ("packages", "levels")}, f"{path}: needs")
    return SuiteNeeds(**sizes, packages=tuple(packages),
                      levels={k: _sizes(v, f"{path}: needs.levels.{k}") for k, v in levels.items()})


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
    needs = _needs(raw.get("needs"), path)
    missing = needs.missing_packages()
    if missing:  # before importing the module, whose import would fail less clearly
        raise PluginError(f"{path}: the suite needs the Python packages {missing} (needs.packages), not installed "
                          f"here: pip install {' '.join(missing)}")
    base = path.parent
    modules: dict[str, Any] = {}
    shared = None
    if raw.get("shared"):
        shared = _hook(raw["shared"], base, f"{path}: shared", (), modules).load(f"{path}: shared")
    module, cls, names, schemas, teardown, options = _tools(raw["tools"], base, path, modules, shared)
    make_state = None
    if raw.get("make_state"):
        if cls is None:
            raise PluginError(f"{path}: make_state needs tools.class (the class instantiated with the state it makes)")
        make_state = _hook(raw["make_state"], base, f"{path}: make_state", ("task", "shared"), modules)
    checker = _hook(raw["checker"], base, f"{path}: checker", CHECKER_ARGUMENTS, modules) if raw.get("checker") else None
    tasks = _read_tasks(str(raw["tasks"]), base, path, modules, shared, has_state=cls is not None,
                        has_checker=checker is not None, tool_names=names)
    prompt = str(raw.get("system_prompt") or DEFAULT_SYSTEM_PROMPT).strip()
    example = raw.get("example_call")
    if example is not None:
        if not isinstance(example, dict) or example.get("name") not in names:
            raise PluginError(f"{path}: example_call must be {{name: <one of {names}>, arguments: {{...}}}}")
        prompt += f"\nExample: {format_tool_call(example['name'], example.get('arguments', {}))}"
    examples = _examples(raw.get("examples") or [], names, path)
    return PluginSpec(name=str(raw["name"]), path=path, module=module, tools_class=cls, tool_names=names,
                      schemas=schemas, system_prompt=prompt, tasks=tasks, checker=checker, examples=examples,
                      make_state=make_state, shared=shared, teardown=teardown, needs=needs, **options,
                      description=str(raw.get("description") or ""))


# --------------------------------------------------------------------------------------------------
class PluginSuite:
    kind: Literal["tool", "code"] = "tool"

    def __init__(self, spec: PluginSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.needs = spec.needs
        self.description = spec.description
        self._rows = {row["id"]: row for row in spec.tasks}
        self._schema = {s["function"]["name"]: s for s in spec.schemas}

    def tasks(self, split: Split, n: int, *, level: int = 1, seed: int = 0) -> list[Task]:
        """The suite's tasks of this split and level (at most ``n``; a fixed dataset never repeats a task)."""
        pool = [t for t in self.spec.tasks if t["split"] == split and t["level"] == level]
        if not pool:
            have = sorted({(t["split"], t["level"]) for t in self.spec.tasks})
            raise ValueError(f"plug-in suite {self.name}: no tasks with split={split!r} and level={level} "
                             f"(the tasks have (split, level) {have})")
        chosen = pool if seed == 0 else random.Random(f"{self.name}/{seed}").sample(pool, len(pool))
        return [self.task(row) for row in chosen[:n]]

    def initial_tools(self, row: dict[str, Any]) -> list[str]:
        """The tools callable from the start: the row's ``tools``, else all but those a follow-up adds."""
        if "tools" in row:
            return list(row["tools"])
        later = {n for f in row.get("follow_ups", []) for n in f["add_tools"]}
        return [n for n in self.spec.tool_names if n not in later]

    def task(self, row: dict[str, Any]) -> Task:
        """The :class:`Task` of one row (its payload is the row id: the environment looks the row up)."""
        turns = list(row.get("oracle_turns", []))
        return Task(task_id=f"{self.name}/{row['id']}", suite=self.name, family=row.get("family", self.name),
                    split=row["split"], level=row["level"], instruction=row["instruction"],
                    tools=[self._schema[n] for n in self.initial_tools(row)], payload={"id": row["id"]},
                    oracle=row.get("oracle") or "\n".join(turns), oracle_turns=turns)

    def task_by_id(self, task_id: str) -> Task | None:
        """The task with this id (``<suite name>/<row id>``), or None when the suite has no such row."""
        prefix = f"{self.name}/"
        row = self._rows.get(task_id[len(prefix):]) if task_id.startswith(prefix) else None
        return self.task(row) if row is not None else None

    def row(self, task: Task) -> dict[str, Any]:
        if task.suite != self.name:
            raise ValueError(f"task {task.task_id} belongs to suite {task.suite!r}, not {self.name!r}")
        try:
            return self._rows[task.payload["id"]]
        except KeyError:
            raise ValueError(f"task {task.task_id} is not a task of plug-in suite {self.name}") from None

    def open_tools(self, row: dict[str, Any], snapshot: dict[str, Any]) -> EpisodeTools:
        """One episode's tools: a fresh state (``make_state`` or a copy of ``initial_state``), a fresh instance
        of the tools class on it, and the class's teardown as the close. ``snapshot['initial']`` receives a copy
        of the state for the default checker when it compares states."""
        spec = self.spec
        if spec.make_state is not None:
            try:
                state = spec.make_state(task=row, shared=spec.shared)
            except Exception as exc:
                raise RuntimeError(f"plug-in suite {self.name}, task {row['id']}: make_state hook {spec.make_state.ref} "
                                   f"raised {type(exc).__name__}: {exc}") from exc
        else:
            state = copy.deepcopy(row.get("initial_state", {}))
        if "expected_state" in row and spec.checker is None:
            snapshot["initial"] = copy.deepcopy(row["initial_state"]) if "initial_state" in row else copy.deepcopy(state)
        initial = self.initial_tools(row)
        names = initial + [n for f in row.get("follow_ups", []) for n in f["add_tools"] if n not in initial]
        schemas = [self._schema[n] for n in names]
        options = {"available": names if spec.callable_before_added else initial,
                   "coerce_numbers": spec.coerce_numbers, "check_types": spec.check_types}
        if spec.tools_class is None:
            functions = {n: getattr(spec.module, n) for n in names}
            return EpisodeTools(Toolbox(functions, schemas, **options))
        try:
            instance = spec.tools_class(state)
        except Exception as exc:
            raise RuntimeError(f"plug-in suite {self.name}, task {row['id']}: {spec.tools_class.__name__}(state) "
                               f"raised {type(exc).__name__}: {exc}") from exc
        try:
            functions = {n: getattr(instance, n) for n in names}
        except AttributeError as exc:
            raise ValueError(f"plug-in suite {self.name}, task {row['id']}: the tool {exc} is not an attribute of "
                             f"its {spec.tools_class.__name__} instance") from None
        box = Toolbox(functions, schemas, **options)
        close = getattr(instance, spec.teardown) if spec.teardown else (lambda: None)
        return EpisodeTools(box, final_state=lambda: getattr(instance, "state", state), close=close)

    def make_env(self, task: Task) -> ToolUseEnvironment:
        row = self.row(task)
        spec, snapshot = self.spec, {}

        def scorer(log: EpisodeLog) -> EpisodeResult:
            if spec.checker is None:
                return score_checklist(_checklist(row, snapshot.get("initial")), calls=log.calls,
                                       final_answer=log.final_answer, final_state=log.final_state)
            try:
                out = spec.checker(task=row, calls=[c.to_dict() for c in log.calls],
                                   trace=[r.to_dict() for r in log.trace], final_answer=log.final_answer,
                                   answers=list(log.answers), final_state=log.final_state, shared=spec.shared)
            except Exception as exc:
                raise RuntimeError(f"plug-in suite {self.name}, task {row['id']}: checker {spec.checker.ref} raised "
                                   f"{type(exc).__name__}: {exc}") from exc
            if not isinstance(out, dict) or "reward" not in out:
                raise ValueError(f"plug-in checker {spec.checker.ref} of {self.name} must return a mapping with "
                                 f"'reward' (got {type(out).__name__})")
            reward = float(out["reward"])
            if not 0.0 <= reward <= 1.0:
                raise ValueError(f"plug-in checker {spec.checker.ref} of {self.name} returned reward {reward} outside [0, 1]")
            return EpisodeResult(reward=reward, success=bool(out.get("success", reward >= SUCCESS_THRESHOLD)),
                                 feedback=str(out.get("feedback", "")), checklist=dict(out.get("checklist", {})))

        follow_ups = [FollowUp(f["content"], list(f["add_tools"])) for f in row.get("follow_ups", [])]
        return ToolUseEnvironment(task, lambda _task: self.open_tools(row, snapshot), scorer,
                                  system_prompt=row.get("system_prompt") or spec.system_prompt,
                                  prefix_messages=spec.examples, follow_ups=follow_ups)


def _checklist(row: dict[str, Any], initial: dict[str, Any] | None) -> Checklist:
    """The default checker's items for one row (``initial``: the state the episode started from)."""
    initial = initial if initial is not None else row.get("initial_state", {})
    if "expected_state" in row and not isinstance(initial, dict):
        raise ValueError(f"task {row['id']}: expected_state needs a JSON state (a mapping); with a make_state hook "
                         "that builds objects, score with a custom checker")
    return Checklist(
        calls=[ToolCall(c["name"], c.get("arguments", {})) for c in row.get("expected_calls", [])],
        answer=[AnswerItem(**a) for a in row.get("answer_items", [])],
        initial_state=initial,
        expected_state=apply_patch(initial, row["expected_state"]) if "expected_state" in row else None,
    )


def load_plugin_suite(path: Path) -> PluginSuite:
    return PluginSuite(load_plugin_spec(Path(path)))
