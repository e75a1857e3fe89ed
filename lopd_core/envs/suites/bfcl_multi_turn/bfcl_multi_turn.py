"""BFCL v4 multi-turn as a plug-in suite: BFCL's executable backends are the tools, its checker scores.

The hooks ``suite.yaml`` names, each as a user porting a stateful benchmark would write it:

- ``load_docs`` (``shared``): the function docs of the eight backend classes, loaded once;
- ``tool_schemas`` (``tools.schemas``): those docs as JSON tool schemas (BFCL types mapped to JSON Schema,
  defaults kept, the ``response`` part dropped: the agent does not need it);
- ``load_tasks`` (``tasks``): the four categories' entries (levels 1-4 = base, miss_func, miss_param,
  long_context; 200 each, ``split: test``) as task rows: the first user message as ``instruction``, the later
  ones as ``follow_ups`` (a miss_func turn adds its held-out functions, their docs in the message as BFCL's
  prompting handlers write it), the entry's classes' functions as the task's ``tools``, the entry, its
  category and ground truth under ``data``, and the ground truth as ``oracle_turns`` (each turn's calls in
  steps of at most 8, then a short answer);
- ``make_state``: the entry's backend instances, built and loaded with the entry's ``initial_config`` as BFCL's
  ``execute_multi_turn_func_call`` does (``long_context`` for that category), fresh for every episode;
- ``BFCLBackends`` (``tools.class``): routes each tool name to the method of the instance that has it and
  formats results as BFCL does (strings as they are, dicts as JSON, anything else ``str``); an exception or
  an ``{"error": ...}`` result is a :class:`~lopd_core.envs.tools.ToolError` (the agent sees ``error: …``);
  ``release`` (``tools.teardown``) drops the instances when the episode ends;
- ``check`` (``checker``): BFCL's own ``multi_turn_checker`` on the episode's calls, grouped by user message
  and assistant step as BFCL's runner groups them; a model result with fewer user turns than the ground truth
  fails as BFCL's "force-terminated" check does.

Deviations from BFCL's own runner, all on the side of the environment and none in the scoring: calls are
``<tool_call>`` JSON, not Python source; calls whose arguments do not validate against the schema (or that
name a function not offered yet) are rejected before they run, so the checker never replays them (BFCL
would run them and record the exception); a step ends the user's turn when it has no call (BFCL's "empty
response"), and the agent loop's ``rollout.max_turns`` bounds the whole episode (BFCL: 20 steps per turn).
The checker replays every call that ran (``ok`` or ``error`` in the trace), under a name unique to the
episode, and removes its instances afterwards, so episodes never see one another's backends.
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
import uuid
from pathlib import Path
from typing import Any

from lopd_core.envs.bfcl import to_json_schema
from lopd_core.envs.tools import ToolError, format_tool_call

CATEGORIES = {1: "base", 2: "miss_func", 3: "miss_param", 4: "long_context"}
MAX_CALLS_PER_STEP = 8
"""The environment runs at most 8 calls per assistant turn; longer ground-truth turns are split into steps."""
ANSWER = "Done."
"""The oracle's reply that closes a user turn (BFCL scores calls, not text)."""


def _bfcl_dir() -> Path:
    import bfcl_eval

    return Path(bfcl_eval.__file__).parent


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------------------------------
def load_docs() -> dict[str, Any]:
    """``{"docs": {class: [function doc]}, "owner": {function: class}, "classes": {class: module}}``."""
    from bfcl_eval.constants.executable_backend_config import (
        CLASS_FILE_PATH_MAPPING,
        MULTI_TURN_FUNC_DOC_FILE_MAPPING,
    )

    classes = ("GorillaFileSystem", "MathAPI", "MessageAPI", "TwitterAPI", "TicketAPI", "TradingBot", "TravelAPI",
               "VehicleControlAPI")
    folder = _bfcl_dir() / "data" / "multi_turn_func_doc"
    docs = {c: _read_jsonl(folder / MULTI_TURN_FUNC_DOC_FILE_MAPPING[c]) for c in classes}
    return {"docs": docs, "owner": {d["name"]: c for c in classes for d in docs[c]},
            "classes": {c: CLASS_FILE_PATH_MAPPING[c] for c in classes}}


def _schema(doc: dict[str, Any]) -> dict[str, Any]:
    return to_json_schema({k: v for k, v in doc.items() if k != "response"})


def tool_schemas(shared: dict[str, Any]) -> list[dict[str, Any]]:
    return [_schema(doc) for docs in shared["docs"].values() for doc in docs]


def _backend_class(shared: dict[str, Any], name: str) -> type:
    return getattr(importlib.import_module(shared["classes"][name]), name)


# --------------------------------------------------------------------------------------------------
def _keyword_call(call: str, shared: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A ground-truth call (Python source, positional arguments allowed) as (name, keyword arguments)."""
    node = ast.parse(call, mode="eval").body
    name = node.func.id
    args = [ast.literal_eval(a) for a in node.args]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    method = getattr(_backend_class(shared, shared["owner"][name]), name)
    bound = inspect.signature(method).bind(None, *args, **kwargs)  # None stands for self
    return name, {k: v for k, v in bound.arguments.items() if k != "self"}


def _oracle_turns(ground_truth: list[list[str]], shared: dict[str, Any]) -> list[str]:
    turns = []
    for calls in ground_truth:
        keyword_calls = [_keyword_call(c, shared) for c in calls]
        for start in range(0, len(keyword_calls), MAX_CALLS_PER_STEP):
            turns.append("\n".join(format_tool_call(n, a) for n, a in keyword_calls[start:start + MAX_CALLS_PER_STEP]))
        turns.append(ANSWER)
    return turns


def _added_functions_message(docs: list[dict[str, Any]]) -> str:
    from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING

    listed = "\n".join(json.dumps(_schema(d)["function"]) for d in docs)
    return DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(functions=listed)


def load_tasks(shared: dict[str, Any]) -> list[dict[str, Any]]:
    data = _bfcl_dir() / "data"
    rows = []
    for level, category in CATEGORIES.items():
        name = f"BFCL_v4_multi_turn_{category}.json"
        answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(data / "possible_answer" / name)}
        for entry in _read_jsonl(data / name):
            held_out = {int(turn): names for turn, names in entry.get("missed_function", {}).items()}
            tools = [d["name"] for c in entry["involved_classes"] for d in shared["docs"][c]
                     if not any(d["name"] in names for names in held_out.values())]
            follow_ups = []
            for turn, messages in enumerate(entry["question"][1:], 1):
                if turn in held_out:
                    docs = [d for c in entry["involved_classes"] for d in shared["docs"][c] if d["name"] in held_out[turn]]
                    follow_ups.append({"content": _added_functions_message(docs), "add_tools": held_out[turn]})
                else:
                    follow_ups.append({"content": "\n".join(m["content"] for m in messages if m["role"] == "user")})
            first = entry["question"][0]
            rows.append({
                "id": entry["id"], "split": "test", "level": level, "family": f"bfcl_multi_turn/{category}",
                "instruction": "\n".join(m["content"] for m in first if m["role"] == "user"),
                "tools": tools, "follow_ups": follow_ups,
                "oracle_turns": _oracle_turns(answers[entry["id"]], shared),
                "data": {"category": category, "entry": entry, "ground_truth": answers[entry["id"]]},
            })
    return rows


# --------------------------------------------------------------------------------------------------
def make_state(task: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    """The entry's backend instances, loaded as ``bfcl_eval``'s ``execute_multi_turn_func_call`` loads them."""
    from bfcl_eval.constants.executable_backend_config import STATELESS_CLASSES

    entry = task["data"]["entry"]
    instances = {}
    for name in entry["involved_classes"]:
        instance = _backend_class(shared, name)()
        if name not in STATELESS_CLASSES:
            instance._load_scenario(copy.deepcopy(entry["initial_config"].get(name, {})),
                                    long_context=task["data"]["category"] == "long_context")
        instances[name] = instance
    return instances


def _bfcl_result(value: Any) -> str:
    """A call's result as BFCL's executor shows it."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


class BFCLBackends:
    """One episode's backends; every tool name is the public method of the instance that defines it."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.instances = state
        self._owner = {name: instance for instance in state.values()
                       for name, _ in inspect.getmembers(instance, inspect.ismethod) if not name.startswith("_")}

    def __getattr__(self, name: str):
        owner = self.__dict__.get("_owner", {}).get(name)
        if owner is None:
            raise AttributeError(name)
        method = getattr(owner, name)

        def run(**arguments: Any) -> str:
            try:
                result = method(**arguments)
            except Exception as exc:  # noqa: BLE001 - BFCL shows every exception to the model
                raise ToolError(f"Error during execution: {exc}") from exc
            if isinstance(result, dict) and set(result) == {"error"}:
                raise ToolError(str(result["error"]))
            return _bfcl_result(result)

        return run

    def release(self) -> None:
        self.instances.clear()
        self._owner.clear()


# --------------------------------------------------------------------------------------------------
def _source(name: str, arguments: dict[str, Any]) -> str:
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"


def model_result(trace: list[dict[str, Any]], n_turns: int) -> list[list[list[str]]]:
    """The calls that ran, as BFCL's decoded model result: per user turn, per assistant step, call sources."""
    turns: list[dict[int, list[str]]] = [{} for _ in range(n_turns)]
    for record in trace:
        if record["status"] in ("ok", "error") and record["turn"] < n_turns:
            turns[record["turn"]].setdefault(record["step"], []).append(_source(record["name"], record["arguments"]))
    return [[steps[s] for s in sorted(steps)] for steps in turns]


def check(task: dict[str, Any], trace: list[dict[str, Any]], answers: list[str | None]) -> dict[str, Any]:
    """BFCL's verdict: 1.0 when ``multi_turn_checker`` finds every turn's state and results, else 0.0."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    entry, ground_truth = task["data"]["entry"], task["data"]["ground_truth"]
    reached = len(answers) if answers and answers[-1] is not None else len(answers) - 1
    details = {"category": task["data"]["category"], "user_turns": len(ground_truth), "answered_turns": max(reached, 0)}
    if reached < len(ground_truth):
        return {"reward": 0.0, "success": False, "checklist": {**details, "valid": False,
                                                               "error_type": "multi_turn:force_terminated"},
                "feedback": f"the episode ended after answering {max(reached, 0)} of {len(ground_truth)} user turns"}
    name = f"lopd_{uuid.uuid4().hex}"
    try:
        verdict = multi_turn_checker(model_result(trace, len(ground_truth)), ground_truth, entry,
                                     f"multi_turn_{task['data']['category']}", name)
    except Exception as exc:  # noqa: BLE001 - a replay that crashes is a failed entry, as in BFCL's runner
        verdict = {"valid": False, "error_message": f"checker error: {type(exc).__name__}: {exc}", "error_type": "checker"}
    finally:
        for key in [k for k in vars(multi_turn_utils) if k.startswith(name)]:
            delattr(multi_turn_utils, key)
    valid = bool(verdict.get("valid"))
    return {"reward": float(valid), "success": valid,
            "feedback": "every turn's state and results match" if valid else str(verdict.get("error_message", ""))[:500],
            "checklist": {**details, "valid": valid, "error_type": verdict.get("error_type", "")}}
