"""Tool calls: parsing the agent's text, validating arguments against JSON schemas, running tools.

The call format (Hermes/Qwen style, the one :func:`lopd_core.records.chat.tools_system_prompt` teaches)::

    <tool_call>{"name": "get_order", "arguments": {"order_id": "A100"}}</tool_call>

Parsing is tolerant of what small models actually write: whitespace and code fences inside or around the
tags, a JSON list of calls inside one tag, several tags in one turn, a missing closing tag at the end of
the turn, ``"arguments"`` given as a JSON string or named ``"parameters"``, single-quoted Python literals.
Without any tag, a message that is nothing but a call object (optionally fenced) is accepted too.
Anything that looks like a call but cannot be understood becomes a :class:`ToolCallError` whose text is
the observation the agent sees — parsing never raises.

Schemas come from typed, documented Python functions through ``transformers``' ``get_json_schema``
(:func:`schema_of`, defaults included) or are given as JSON. Arguments are validated by the ``jsonschema``
library (:func:`validate_arguments`) against the shown schema read as :func:`validation_schema` says
(``nullable`` honoured, unknown top-level arguments rejected); before that, :func:`prepare_arguments` drops an
explicit ``null`` for an optional parameter that does not take null. :class:`Toolbox` ties it together: each
call becomes a :class:`CallRecord` (ran, failed, rejected) whose observation is a
``<tool_response>…</tool_response>``; a tool reports a domain error by raising :class:`ToolError`.

This module does not decide when an episode ends or how it is scored (that is the suites' job).
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
"""How a tool's reply opens when the chat template wraps it: an agent that writes it has invented the reply."""
_TAG_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|(?=<tool_call>)|\Z)", re.DOTALL)
_FENCE_RE = re.compile(r"^\s*```[a-zA-Z0-9_-]*\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)
_BARE_FENCE_RE = re.compile(r"```(?:json|tool_call)?\s*\n?(.*?)```", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


@dataclass
class ToolCallError:
    message: str
    """What was wrong, phrased for the agent (it becomes the observation)."""
    raw: str = ""


@dataclass
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)
    content: str = ""
    """The text outside the tool-call tags (the final answer when there is no call)."""

    @property
    def attempted(self) -> bool:
        return bool(self.calls or self.errors)


# --------------------------------------------------------------------------------------------------
def _strip_fences(text: str) -> str:
    text = text.strip()
    match = _FENCE_RE.match(text)
    return match.group(1).strip() if match else text


def _loads_lenient(text: str) -> Any:
    """JSON, else a Python literal (single quotes, True/False/None), else raise ValueError."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as json_error:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            pass
        # A trailing garbage after one complete object (e.g. "{...}} ." or "{...}\nDone").
        try:
            obj, _ = json.JSONDecoder().raw_decode(text)
            return obj
        except json.JSONDecodeError:
            pass
        # Cut off before the closing braces (the turn hit its token limit or the model stopped early).
        for suffix in ("}", "}}", '"}}', "}}}"):
            try:
                return json.loads(text + suffix)
            except json.JSONDecodeError:
                continue
        raise ValueError(f"{json_error.msg} at position {json_error.pos}") from None


def _to_call(obj: Any) -> ToolCall | ToolCallError:
    if not isinstance(obj, dict):
        return ToolCallError(f"a tool call must be a JSON object with \"name\" and \"arguments\", got {type(obj).__name__}")
    if "function" in obj and isinstance(obj["function"], dict) and "name" not in obj:
        obj = obj["function"]  # OpenAI-style {"type": "function", "function": {...}}
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCallError('the tool call has no "name" (a string naming one of the available functions)')
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = _loads_lenient(arguments) if arguments.strip() else {}
        except ValueError as exc:
            return ToolCallError(f'the "arguments" of {name} are a string that is not valid JSON ({exc})')
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCallError(f'the "arguments" of {name} must be a JSON object mapping parameter names to values')
    return ToolCall(name=name.strip(), arguments=arguments)


def _parse_payload(payload: str) -> list[ToolCall | ToolCallError]:
    payload = _strip_fences(payload)
    if not payload:
        return [ToolCallError("the <tool_call> tag is empty; put one JSON object inside it")]
    try:
        obj = _loads_lenient(payload)
    except ValueError as exc:
        return [ToolCallError(f"the tool call is not valid JSON ({exc}); write "
                              '{"name": "function_name", "arguments": {...}}', raw=payload[:200])]
    items = obj if isinstance(obj, list) else [obj]
    if not items:
        return [ToolCallError("the tool call list is empty")]
    return [_to_call(item) for item in items]


def parse_tool_calls(text: str) -> ParsedTurn:
    """Every tool call in one assistant turn, the errors for the unparseable ones, and the remaining text."""
    turn = ParsedTurn()
    if TOOL_CALL_OPEN in text:
        for match in _TAG_RE.finditer(text):
            for item in _parse_payload(match.group(1)):
                (turn.calls if isinstance(item, ToolCall) else turn.errors).append(item)
        turn.content = _TAG_RE.sub("", text).replace(TOOL_CALL_CLOSE, "").strip()
        return turn
    # No tag: accept a message that is only a call object (or a fenced one); leave prose alone.
    candidate = text.strip()
    fenced = _BARE_FENCE_RE.search(candidate)
    for body in ([fenced.group(1)] if fenced else []) + [candidate]:
        body = body.strip()
        if not body.startswith(("{", "[")):
            continue
        try:
            obj = _loads_lenient(body)
        except ValueError:
            continue
        items = obj if isinstance(obj, list) else [obj]
        if items and all(isinstance(i, dict) and "name" in i and ("arguments" in i or "parameters" in i) for i in items):
            for item in items:
                parsed = _to_call(item)
                (turn.calls if isinstance(parsed, ToolCall) else turn.errors).append(parsed)
            turn.content = candidate.replace(fenced.group(0), "").strip() if fenced and body == fenced.group(1).strip() else ""
            return turn
    turn.content = text.strip()
    return turn


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The canonical text of one call (used by oracles and in-context examples)."""
    return f"{TOOL_CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{TOOL_CALL_CLOSE}"


def format_tool_response(result: Any) -> str:
    body = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
    return f"<tool_response>\n{body}\n</tool_response>"


# --------------------------------------------------------------------------------------------------
def validation_schema(parameters: dict[str, Any], *, check_types: bool = True) -> dict[str, Any]:
    """The JSON schema a call's arguments are validated with, from the ``parameters`` the agent is shown.

    Three readings of the shown schema: OpenAPI's ``nullable: true`` (what ``get_json_schema`` writes for
    ``x: T | None``) allows ``null`` (in ``type`` and in ``enum``); ``type: "any"`` allows anything; and a
    top-level ``parameters`` object with ``properties`` but no ``additionalProperties`` rejects unknown
    arguments (a typo must not pass silently; nested objects follow their own schema). With
    ``check_types=False`` only the names are checked (required present, none unknown: what a Python call
    itself enforces), for benchmarks whose reference solutions pass values of other types than documented.
    """
    if not check_types:
        names = (parameters or {}).get("properties") or {}
        return {"type": "object", "properties": {n: {} for n in names},
                "required": list((parameters or {}).get("required") or []), "additionalProperties": not names}

    def convert(node: Any) -> Any:
        if isinstance(node, list):
            return [convert(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: convert(v) for k, v in node.items() if k != "nullable"}
        if out.get("type") == "any" or out.get("type") == ["any"]:
            out.pop("type")
        if node.get("nullable") is True:
            if "type" in out:
                types = out["type"] if isinstance(out["type"], list) else [out["type"]]
                out["type"] = [*types, "null"] if "null" not in types else types
            if isinstance(out.get("enum"), list) and None not in out["enum"]:
                out["enum"] = [*out["enum"], None]
        return out

    schema = convert(parameters or {}) or {"type": "object"}
    if schema.get("properties") and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def _allows_null(schema: dict[str, Any]) -> bool:
    types = schema.get("type")
    return schema.get("nullable") is True or types == "null" or (isinstance(types, list) and "null" in types) \
        or ("type" not in schema and "enum" not in schema)


def _as_number(text: str, json_type: str) -> int | float | None:
    try:
        value = float(text.strip())
    except ValueError:
        return None
    if json_type == "integer":
        return int(value) if value.is_integer() else None
    return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value


def prepare_arguments(parameters: dict[str, Any], arguments: dict[str, Any], *,
                      coerce_numbers: bool = False) -> dict[str, Any]:
    """The arguments a tool receives, before validation: an explicit ``null`` for an optional parameter that
    does not allow null is dropped (the function's default applies: small and large models alike write
    ``"x": null`` for "not given"); with ``coerce_numbers``, a numeric string for an ``integer``/``number``
    parameter that does not allow strings becomes that number (what a benchmark built on pydantic accepts)."""
    properties = (parameters or {}).get("properties") or {}
    required = set((parameters or {}).get("required") or [])
    prepared = {}
    for name, value in arguments.items():
        spec = properties.get(name)
        if value is None and spec is not None and name not in required and not _allows_null(spec):
            continue
        if coerce_numbers and isinstance(value, str) and isinstance(spec, dict):
            types = spec.get("type") if isinstance(spec.get("type"), list) else [spec.get("type")]
            wanted = next((t for t in ("integer", "number") if t in types), None)
            if wanted and "string" not in types and (number := _as_number(value, wanted)) is not None:
                value = number
        prepared[name] = value
    return prepared


@functools.lru_cache(maxsize=1)
def _validator_class():
    import jsonschema

    # Arguments parsed from Python literals may hold tuples where JSON has arrays.
    checker = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "array", lambda _checker, value: isinstance(value, list | tuple))
    return jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=checker)


def _validator(parameters: dict[str, Any], *, check_types: bool = True):
    return _validator_class()(validation_schema(parameters, check_types=check_types))


def check_parameters_schema(parameters: dict[str, Any]) -> list[str]:
    """Problems that make a tool's ``parameters`` an invalid JSON schema (empty when it is valid)."""
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(validation_schema(parameters))
    except jsonschema.SchemaError as exc:
        return [f"{'/'.join(str(p) for p in exc.path) or 'parameters'}: {exc.message}"]
    return []


def _label(path) -> str:
    label = ""
    for part in path:
        label += f"[{part}]" if isinstance(part, int) else (f".{part}" if label else str(part))
    return label


def _describe(error) -> list[str]:
    """One validation error of the ``jsonschema`` library, phrased for the agent."""
    where = _label(error.absolute_path)
    prefix = f"{where}." if where else ""
    value = error.instance
    if error.validator == "required":
        missing = [n for n in error.validator_value if isinstance(value, dict) and n not in value]
        return [f"missing required argument {prefix}{n}" for n in missing] or [error.message]
    if error.validator == "additionalProperties" and isinstance(value, dict):
        allowed = list(error.schema.get("properties", {}))
        extra = [k for k in value if k not in allowed]
        return [f"unknown argument {prefix}{k} (allowed: {', '.join(allowed) or 'none'})" for k in extra]
    label = where or "the arguments"
    if error.validator == "type":
        types = error.validator_value if isinstance(error.validator_value, list) else [error.validator_value]
        return [f"{label} must be of type {' or '.join(types)}, got {type(value).__name__} {value!r}"]
    if error.validator == "enum":
        return [f"{label} must be one of {error.validator_value}, got {value!r}"]
    return [f"{label}: {error.message}"]


def validate_arguments(function_schema: dict[str, Any], arguments: dict[str, Any], *, validator=None) -> list[str]:
    """Problems with ``arguments`` for a function schema (``{"name", "parameters"}`` or the tool wrapper),
    found by the ``jsonschema`` library on :func:`validation_schema` (empty when the call is valid).
    ``validator``: the schema's compiled validator when the caller keeps one (:class:`Toolbox` does)."""
    if validator is None:
        fn = function_schema.get("function", function_schema)
        validator = _validator(fn.get("parameters", {}) or {})
    errors = sorted(validator.iter_errors(arguments), key=lambda e: [str(p) for p in e.absolute_path])
    return [text for e in errors for text in _describe(e)]


def schema_of(fn: Callable[..., Any]) -> dict[str, Any]:
    """The tool schema of a typed, documented function (Google-style ``Args:`` docstring).

    ``transformers.utils.get_json_schema`` does the work; the ``return`` entry is dropped (the agent only
    needs the parameters, and every token of the system prompt counts on a small model) and every parameter
    with a JSON-serialisable default gets it as ``default`` (the agent sees what leaving it out means).
    """
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # transformers raises its own DocstringParsingException / TypeHintParsingException
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: cannot build a JSON schema ({exc}); give every "
                         "parameter a type hint and document it under 'Args:' in the docstring") from exc
    schema["function"].pop("return", None)
    properties = schema["function"].get("parameters", {}).get("properties", {})
    for name, param in inspect.signature(fn).parameters.items():
        if name in properties and param.default is not inspect.Parameter.empty:
            try:
                json.dumps(param.default)
            except (TypeError, ValueError):
                continue
            properties[name].setdefault("default", param.default)
    return schema


def tool(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a function or method as a tool: when a plug-in suite's module or class marks any, only the marked
    ones are tools (helpers stay helpers without a list in ``suite.yaml``)."""
    fn.__lopd_tool__ = True
    return fn


class ToolError(Exception):
    """Raised by a tool for a domain error (unknown id, not allowed, wrong state): the agent sees
    ``error: <message>``, the call's trace record says ``error`` and it is not among the valid calls."""


class ToolFailure(Exception):
    """Raised by a tool for a domain failure that still counts as a valid call: the agent sees
    ``{"error": <message>}`` as the call's result (the older convention; prefer :class:`ToolError`)."""


CallStatus = Literal["ok", "rejected", "error", "unparsed"]


@dataclass
class CallRecord:
    """One attempted call of an episode, as the trace a checker reads: ``ok`` (it ran and returned
    ``result``), ``error`` (it ran and failed: :class:`ToolError` or an exception), ``rejected`` (unknown
    function, invalid arguments or over the per-turn limit: it never ran), ``unparsed`` (not a readable call)."""

    name: str
    arguments: dict[str, Any]
    """The arguments the tool received (after :func:`prepare_arguments`), or as written when it never ran."""
    status: CallStatus
    result: Any = None
    error: str = ""
    turn: int = 0
    """Index of the user message the call answers (0 = the task's request, 1 = the first follow-up …)."""
    step: int = 0
    """Index of the assistant turn within that user message's exchange (0 = the first reply to it)."""
    exception: str = ""
    """The exception's type when the tool raised something other than :class:`ToolError` (a bug in the tool,
    or a value it does not handle): the agent sees it as an error, and the episode reports it
    (``checklist["tool_exceptions"]``) so that a broken tool is not a silent low reward."""

    @property
    def observation(self) -> str:
        """The ``<tool_response>`` the agent sees for this call."""
        return format_tool_response(self.result if self.status == "ok" else f"error: {self.error}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments, "status": self.status, "result": self.result,
                "error": self.error, "turn": self.turn, "step": self.step, "exception": self.exception}


class Toolbox:
    r"""A set of callable tools with their schemas; turns parsed calls into :class:`CallRecord`\ s.

    ``available`` (default: every tool) is the subset the agent may call now; a call to any other name is
    rejected as an unknown function. ``coerce_numbers``: see :func:`prepare_arguments`; ``check_types``: see
    :func:`validation_schema`.
    """

    def __init__(self, functions: dict[str, Callable[..., Any]], schemas: list[dict[str, Any]], *,
                 available: list[str] | None = None, coerce_numbers: bool = False, check_types: bool = True) -> None:
        self.functions = functions
        self.schemas = schemas
        self.coerce_numbers = coerce_numbers
        self.check_types = check_types
        self._by_name = {s.get("function", s)["name"]: s for s in schemas}
        missing = sorted(set(self._by_name) - set(functions))
        if missing:
            raise ValueError(f"Toolbox: schemas without a function: {missing}")
        self.available = list(self._by_name) if available is None else list(available)
        unknown = sorted(set(self.available) - set(self._by_name))
        if unknown:
            raise ValueError(f"Toolbox: available tools without a schema: {unknown}")
        self._validators: dict[str, Any] = {}

    @classmethod
    def from_functions(cls, functions: list[Callable[..., Any]]) -> Toolbox:
        schemas = [schema_of(f) for f in functions]
        return cls({s["function"]["name"]: f for s, f in zip(schemas, functions, strict=True)}, schemas)

    @property
    def names(self) -> list[str]:
        return list(self.available)

    def enable(self, names: list[str]) -> None:
        """Make more of the toolbox's tools callable (e.g. functions a follow-up message adds)."""
        unknown = sorted(set(names) - set(self._by_name))
        if unknown:
            raise ValueError(f"Toolbox: cannot enable tools without a schema: {unknown}")
        self.available += [n for n in names if n not in self.available]

    def _parameters(self, name: str) -> dict[str, Any]:
        return self._by_name[name].get("function", self._by_name[name]).get("parameters", {}) or {}

    def check(self, call: ToolCall) -> list[str]:
        if call.name not in self.available:
            return [f"unknown function {call.name!r}; the available functions are: {', '.join(self.names)}"]
        if call.name not in self._validators:
            self._validators[call.name] = _validator(self._parameters(call.name), check_types=self.check_types)
        return validate_arguments(self._by_name[call.name], call.arguments, validator=self._validators[call.name])

    def run(self, call: ToolCall) -> CallRecord:
        """Validate and run one call. Tool exceptions become an ``error`` record, never propagate."""
        arguments = call.arguments
        if call.name in self.available:
            arguments = prepare_arguments(self._parameters(call.name), call.arguments, coerce_numbers=self.coerce_numbers)
        problems = self.check(ToolCall(call.name, arguments))
        if problems:
            return CallRecord(call.name, call.arguments, "rejected",
                              error=f"invalid call to {call.name}: " + "; ".join(problems))
        # The record keeps the arguments as they were passed: a tool may keep (and later change) the objects.
        passed = copy.deepcopy(arguments)
        try:
            return CallRecord(call.name, passed, "ok", result=self.functions[call.name](**arguments))
        except ToolFailure as exc:
            return CallRecord(call.name, passed, "ok", result={"error": str(exc)})
        except ToolError as exc:
            return CallRecord(call.name, passed, "error", error=str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug or bad value inside a tool is the agent's observation
            return CallRecord(call.name, passed, "error", error=f"{call.name} failed: {type(exc).__name__}: {exc}",
                              exception=type(exc).__name__)

    def execute(self, call: ToolCall) -> tuple[bool, Any]:
        """(ok, result-or-error-text) of :meth:`run`: ``ok`` only for a call that ran and returned."""
        record = self.run(call)
        return (True, record.result) if record.status == "ok" else (False, f"error: {record.error}")


def error_observation(error: ToolCallError) -> str:
    hint = ' Use the format <tool_call>{"name": "...", "arguments": {...}}</tool_call>.'
    return format_tool_response(f"error: {error.message}.{hint}")
