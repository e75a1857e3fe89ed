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
(:func:`schema_of`); :func:`validate_arguments` checks required fields, unknown fields, JSON types
(recursively for arrays and objects) and enums. :class:`Toolbox` ties both together: it executes valid
calls and renders each result as a ``<tool_response>…</tool_response>`` observation.

This module does not decide when an episode ends or how it is scored (that is the suites' job).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
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
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list, tuple), "object": (dict,), "null": (type(None),),
}


def _type_ok(value: Any, json_type: str) -> bool:
    if json_type == "any":
        return True
    if json_type in ("integer", "number") and isinstance(value, bool):
        return False
    if json_type == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES.get(json_type, (object,)))


def _check_value(value: Any, schema: dict[str, Any], where: str, errors: list[str]) -> None:
    types = schema.get("type")
    if types is not None:
        options = types if isinstance(types, list) else [types]
        if not any(_type_ok(value, t) for t in options):
            errors.append(f"{where} must be of type {' or '.join(options)}, got {type(value).__name__} {value!r}")
            return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where} must be one of {schema['enum']}, got {value!r}")
    if isinstance(value, list | tuple) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            _check_value(item, schema["items"], f"{where}[{i}]", errors)
    if isinstance(value, dict) and "properties" in schema:
        _check_object(value, schema, where, errors)


def _check_object(arguments: dict[str, Any], schema: dict[str, Any], where: str, errors: list[str]) -> None:
    properties = schema.get("properties", {}) or {}
    for name in schema.get("required", []) or []:
        if name not in arguments:
            errors.append(f"missing required argument {where + '.' if where else ''}{name}")
    for name, value in arguments.items():
        label = f"{where}.{name}" if where else name
        if name not in properties:
            if schema.get("additionalProperties", False) is False and properties:
                errors.append(f"unknown argument {label} (allowed: {', '.join(properties) or 'none'})")
            continue
        _check_value(value, properties[name], label, errors)


def validate_arguments(function_schema: dict[str, Any], arguments: dict[str, Any]) -> list[str]:
    """Problems with ``arguments`` for a function schema (``{"name", "parameters"}`` or the tool wrapper)."""
    fn = function_schema.get("function", function_schema)
    errors: list[str] = []
    _check_object(arguments, fn.get("parameters", {}) or {}, "", errors)
    return errors


def schema_of(fn: Callable[..., Any]) -> dict[str, Any]:
    """The tool schema of a typed, documented function (Google-style ``Args:`` docstring).

    ``transformers.utils.get_json_schema`` does the work; the ``return`` entry is dropped (the agent only
    needs the parameters, and every token of the system prompt counts on a small model).
    """
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # transformers raises its own DocstringParsingException / TypeHintParsingException
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: cannot build a JSON schema ({exc}); give every "
                         "parameter a type hint and document it under 'Args:' in the docstring") from exc
    schema["function"].pop("return", None)
    return schema


class Toolbox:
    """A set of callable tools with their schemas; turns parsed calls into observations."""

    def __init__(self, functions: dict[str, Callable[..., Any]], schemas: list[dict[str, Any]]) -> None:
        self.functions = functions
        self.schemas = schemas
        self._by_name = {s.get("function", s)["name"]: s for s in schemas}
        missing = sorted(set(self._by_name) - set(functions))
        if missing:
            raise ValueError(f"Toolbox: schemas without a function: {missing}")

    @classmethod
    def from_functions(cls, functions: list[Callable[..., Any]]) -> Toolbox:
        schemas = [schema_of(f) for f in functions]
        return cls({s["function"]["name"]: f for s, f in zip(schemas, functions, strict=True)}, schemas)

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def check(self, call: ToolCall) -> list[str]:
        if call.name not in self._by_name:
            return [f"unknown function {call.name!r}; the available functions are: {', '.join(self.names)}"]
        return validate_arguments(self._by_name[call.name], call.arguments)

    def execute(self, call: ToolCall) -> tuple[bool, Any]:
        """(ok, result-or-error-text). Tool exceptions become error text, never propagate."""
        problems = self.check(call)
        if problems:
            return False, f"error: invalid call to {call.name}: " + "; ".join(problems)
        try:
            return True, self.functions[call.name](**call.arguments)
        except ToolFailure as exc:
            return True, {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a bug or bad value inside a tool is the agent's observation
            return False, f"error: {call.name} failed: {type(exc).__name__}: {exc}"


class ToolFailure(Exception):
    """Raised by a tool for a domain-level failure (e.g. 'order not found'): a valid call with an error result."""


def error_observation(error: ToolCallError) -> str:
    hint = ' Use the format <tool_call>{"name": "...", "arguments": {...}}</tool_call>.'
    return format_tool_response(f"error: {error.message}.{hint}")
