"""bfcl: the Berkeley Function Calling Leaderboard v4, single-turn categories, scored by BFCL's own AST checker.

Data: the JSON-lines files shipped inside the installed ``bfcl-eval`` package (``bfcl_eval/data/`` and
``data/possible_answer/``); nothing is downloaded. Levels select the category:

=====  ====================  =======================================================
level  category              what the agent must do
=====  ====================  =======================================================
1      ``simple_python``     call the one given function with the right arguments
2      ``multiple``          pick the right function among several, then call it
3      ``parallel``          call the one function several times in one turn
4      ``parallel_multiple`` several calls of several functions in one turn
=====  ====================  =======================================================

An evaluation benchmark only (``split='test'``). The episode is one assistant turn; its tool calls
(our ``<tool_call>`` format, see :mod:`lopd_core.envs.tools`) become BFCL's model output
``[{name: {arg: value}}]`` and ``bfcl_eval``'s ``ast_checker`` decides (types incl. int→float promotion,
allowed values per parameter, optional parameters marked by ``""``, order-free matching for parallel
calls, string normalisation). Reward 1 when valid, else 0 with the checker's error as feedback.

Reusing BFCL's checker offline: ``bfcl_eval.eval_checker.ast_eval.ast_checker`` imports
``bfcl_eval.constants.model_config`` only for one lookup (does this *API model* replace dots in function
names?), and that module imports every vendor SDK. :func:`bfcl_ast_checker` loads the checker with a
stand-in for that one module (answering "no": we show the model the original dotted names), present only
while the checker is imported. The multi-turn categories (executable backends) are not implemented.
"""

from __future__ import annotations

import copy
import json
import random
import sys
import types
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from lopd_core.envs.base import EpisodeResult, Split, StepResult, Task
from lopd_core.envs.tools import parse_tool_calls

CATEGORIES = {1: "simple_python", 2: "multiple", 3: "parallel", 4: "parallel_multiple"}
CHECKER_MODEL_NAME = "lopd-agent"

SYSTEM_PROMPT = (
    "You are an expert in composing function calls. Answer the user's request by calling the given functions: "
    "write each call as <tool_call>{\"name\": \"function_name\", \"arguments\": {...}}</tool_call>, several calls "
    "one after another when the request needs them. Use only the functions and parameters listed.\n"
    'Example: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
)


def _data_dir() -> Path:
    try:
        import bfcl_eval
    except ImportError as exc:
        raise ImportError("the bfcl suite needs the `bfcl-eval` package installed without its dependencies "
                          "(pip install --no-deps bfcl-eval==2026.3.23); only its data files and checker are used") from exc
    return Path(bfcl_eval.__file__).parent / "data"


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@lru_cache(maxsize=8)
def load_category(category: str) -> list[dict[str, Any]]:
    """Entries of one category with their ``ground_truth`` attached, in file order."""
    data = _data_dir()
    entries = _read_jsonl(data / f"BFCL_v4_{category}.json")
    answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(data / "possible_answer" / f"BFCL_v4_{category}.json")}
    for entry in entries:
        entry["ground_truth"] = answers[entry["id"]]
    return entries


@lru_cache(maxsize=1)
def bfcl_ast_checker():
    """``(ast_checker, Language)`` from bfcl_eval, imported with a stand-in for its SDK-heavy model config."""
    name = "bfcl_eval.constants.model_config"

    class _NoDotRewrite:
        underscore_to_dot = False

    class _AnyModel(dict):
        def __getitem__(self, key):
            return _NoDotRewrite()

    stand_in = types.ModuleType(name)
    stand_in.MODEL_CONFIG_MAPPING = _AnyModel()
    previous = sys.modules.get(name)
    sys.modules[name] = stand_in
    try:
        from bfcl_eval.constants.enums import Language
        from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    finally:
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
    return ast_checker, Language


def to_json_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A BFCL function doc (types 'dict', 'float', 'tuple', 'any' …) as an OpenAI-style tool schema."""
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI

    def convert(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: convert(v) for k, v in node.items()}
            if isinstance(node.get("type"), str):
                out["type"] = GORILLA_TO_OPENAPI.get(node["type"], node["type"])
            return out
        if isinstance(node, list):
            return [convert(v) for v in node]
        return node

    return {"type": "function", "function": convert(copy.deepcopy(function))}


_OMIT = object()


def _first_allowed(allowed: Any, *, required: bool = False) -> Any:
    """The value to write for one parameter: omitted when "" (= optional) is allowed and the schema does not
    require it, else the first non-empty allowed value."""
    if not isinstance(allowed, list):
        return allowed
    values = [v for v in allowed if v != ""]
    if not values or ("" in allowed and not required):
        return _OMIT
    return _realize(values[0])


def _realize(candidate: Any, required: frozenset[str] = frozenset()) -> Any:
    # Nested dicts in possible answers map each key to a list of allowed values again.
    if isinstance(candidate, dict):
        out = {}
        for key, allowed in candidate.items():
            value = _first_allowed(allowed, required=key in required)
            if value is not _OMIT:
                out[key] = value
        return out
    if isinstance(candidate, list):
        return [_realize(c) for c in candidate]
    return candidate


def ground_truth_output(ground_truth: list[dict[str, dict[str, list[Any]]]],
                        functions: list[dict[str, Any]] | None = None) -> list[dict[str, dict[str, Any]]]:
    """A model output that follows the possible answers: optional parameters (those that allow "") are
    omitted unless the function doc requires them, every other parameter gets its first allowed value
    (recursively inside nested dicts)."""
    required = {f["name"]: frozenset(f.get("parameters", {}).get("required", [])) for f in functions or []}
    return [{name: _realize(params, required.get(name, frozenset()))} for call in ground_truth
            for name, params in call.items()]


def check(entry: dict[str, Any], category: str, model_output: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """BFCL's AST verdict ``{"valid": bool, "error": [...], "error_type": str}`` for one model output."""
    ast_checker, language = bfcl_ast_checker()
    try:
        return ast_checker(entry["function"], model_output, entry["ground_truth"], language.PYTHON, category,
                           CHECKER_MODEL_NAME)
    except Exception as exc:  # noqa: BLE001 - a malformed output must be a failed check, not a crash
        return {"valid": False, "error": [f"checker error: {type(exc).__name__}: {exc}"], "error_type": "checker"}


class BFCLEnvironment:
    def __init__(self, task: Task, entry: dict[str, Any], category: str) -> None:
        self.entry, self.category = entry, category
        self.reset(task)

    def reset(self, task: Task) -> list[dict[str, Any]]:
        self.task = task
        self._result: EpisodeResult | None = None
        return [{"role": "system", "content": SYSTEM_PROMPT}, *copy.deepcopy(self.entry["question"][0])]

    def step(self, assistant_text: str) -> StepResult:
        turn = parse_tool_calls(assistant_text)
        output = [{c.name: c.arguments} for c in turn.calls]
        if not output:
            why = turn.errors[0].message if turn.errors else "the answer contains no function call"
            verdict = {"valid": False, "error": [why], "error_type": "no_call"}
        else:
            verdict = check(self.entry, self.category, output)
        ok = bool(verdict.get("valid"))
        errors = verdict.get("error") or []
        self._result = EpisodeResult(
            reward=1.0 if ok else 0.0, success=ok,
            feedback="all calls match" if ok else "; ".join(str(e) for e in errors)[:500] or verdict.get("error_type", ""),
            checklist={"category": self.category, "valid": ok, "error_type": verdict.get("error_type", ""),
                       "n_calls": len(output), "n_expected": len(self.entry["ground_truth"])},
        )
        return StepResult(observation=None, done=True, tool_calls=len(turn.calls), invalid_tool_calls=len(turn.errors))

    def result(self) -> EpisodeResult:
        return self._result or EpisodeResult(reward=0.0, success=False, feedback="no answer was given",
                                             checklist={"category": self.category, "valid": False})


class BFCLSuite:
    name = "bfcl"
    kind: Literal["tool", "code"] = "tool"

    def tasks(self, split: Split, n: int, *, level: int = 1, seed: int = 0) -> list[Task]:
        if split != "test":
            raise ValueError("bfcl is an evaluation benchmark: only split='test' exists (train on toolworld)")
        if level not in CATEGORIES:
            raise ValueError(f"bfcl: level must be one of {sorted(CATEGORIES)} ({CATEGORIES}); got {level}")
        category = CATEGORIES[level]
        entries = load_category(category)
        chosen = entries if n >= len(entries) else random.Random(f"bfcl/{category}/{seed}").sample(entries, n)
        return [self._task(e, category, level) for e in chosen]

    def _task(self, entry: dict[str, Any], category: str, level: int) -> Task:
        calls = ground_truth_output(entry["ground_truth"], entry["function"])
        oracle = "".join('<tool_call>' + json.dumps({"name": name, "arguments": args}) + "</tool_call>"
                         for call in calls for name, args in call.items())
        return Task(
            task_id=f"bfcl/{entry['id']}", suite=self.name, family=f"bfcl/{category}", split="test", level=level,
            instruction=entry["question"][0][-1]["content"], tools=[to_json_schema(f) for f in entry["function"]],
            payload={"id": entry["id"], "category": category}, oracle=oracle,
        )

    def make_env(self, task: Task) -> BFCLEnvironment:
        category = task.payload.get("category")
        by_id = {e["id"]: e for e in load_category(category)} if category in CATEGORIES.values() else {}
        if task.payload.get("id") not in by_id:
            raise ValueError(f"task {task.task_id} is not a BFCL task of a supported category ({sorted(CATEGORIES.values())})")
        return BFCLEnvironment(task, by_id[task.payload["id"]], category)
