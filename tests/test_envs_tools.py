"""Tool-call parsing, schema validation and the Toolbox (no model needed)."""

from __future__ import annotations

from typing import Literal

import pytest

from lopd_core.envs.tools import (
    Toolbox,
    ToolCall,
    ToolFailure,
    format_tool_call,
    parse_tool_calls,
    schema_of,
    validate_arguments,
)


def get_order(order_id: str, verbose: bool = False) -> dict:
    """Look up an order.

    Args:
        order_id: The order id.
        verbose: Include the items.
    """
    if order_id == "missing":
        raise ToolFailure("order missing not found")
    return {"order_id": order_id, "verbose": verbose}


def convert(value: float, unit: Literal["C", "F"], tags: list[str] | None = None) -> float:
    """Convert a temperature.

    Args:
        value: The temperature.
        unit: Target unit.
        tags: Optional labels.
    """
    return value * 9 / 5 + 32 if unit == "F" else value


@pytest.mark.parametrize("text, names", [
    ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>', ["a"]),
    ('<tool_call>\n```json\n{"name": "a", "arguments": {"x": 1}}\n```\n</tool_call>', ["a"]),
    ('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]</tool_call>', ["a", "b"]),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call> and <tool_call>{"name": "b", "arguments": {}}</tool_call>',
     ["a", "b"]),
    ('Let me check. <tool_call>{"name": "a", "arguments": {"x": 1}}', ["a"]),  # closing tag cut off
    ('<tool_call>{"name": "a", "arguments": {"x": 1}', ["a"]),  # closing braces cut off
    ("<tool_call>{'name': 'a', 'arguments': {'flag': True}}</tool_call>", ["a"]),  # Python literal
    ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>', ["a"]),  # arguments as a JSON string
    ('<tool_call>{"name": "a", "parameters": {"x": 2}}</tool_call>', ["a"]),
    ('```json\n{"name": "a", "arguments": {"x": 1}}\n```', ["a"]),  # untagged, fenced
    ('{"name": "a", "arguments": {"x": 1}}', ["a"]),  # untagged, bare
])
def test_parse_accepts_the_forms_small_models_write(text, names):
    turn = parse_tool_calls(text)
    assert [c.name for c in turn.calls] == names
    assert turn.errors == []


def test_parse_reports_errors_instead_of_raising():
    turn = parse_tool_calls('<tool_call>{"name": "a", "arguments": [1, 2]}</tool_call>')
    assert not turn.calls and "JSON object" in turn.errors[0].message
    turn = parse_tool_calls("<tool_call>not json at all</tool_call>")
    assert not turn.calls and "not valid JSON" in turn.errors[0].message
    turn = parse_tool_calls("<tool_call></tool_call>")
    assert "empty" in turn.errors[0].message
    turn = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')
    assert 'no "name"' in turn.errors[0].message


def test_plain_answer_is_not_a_call():
    turn = parse_tool_calls("The order {A1} has shipped.")
    assert not turn.attempted and turn.content == "The order {A1} has shipped."
    turn = parse_tool_calls('Done. <tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert turn.content == "Done."


def test_schema_from_typed_documented_function():
    schema = schema_of(convert)["function"]
    assert schema["name"] == "convert" and "return" not in schema
    props = schema["parameters"]["properties"]
    assert props["value"]["type"] == "number" and props["unit"]["enum"] == ["C", "F"]
    assert schema["parameters"]["required"] == ["value", "unit"]

    def undocumented(x):
        return x

    with pytest.raises(ValueError, match="type hint"):
        schema_of(undocumented)


def test_validation_checks_required_types_enums_and_unknown_fields():
    schema = schema_of(convert)
    assert validate_arguments(schema, {"value": 3, "unit": "F"}) == []
    assert validate_arguments(schema, {"value": 3.5, "unit": "C", "tags": ["a"]}) == []
    assert any("missing required argument unit" in e for e in validate_arguments(schema, {"value": 1}))
    assert any("must be of type number" in e for e in validate_arguments(schema, {"value": "hot", "unit": "F"}))
    assert any("must be one of ['C', 'F']" in e for e in validate_arguments(schema, {"value": 1, "unit": "K"}))
    assert any("unknown argument colour" in e for e in validate_arguments(schema, {"value": 1, "unit": "F", "colour": 1}))
    assert any("tags[1]" in e for e in validate_arguments(schema, {"value": 1, "unit": "F", "tags": ["a", 2]}))
    assert any("boolean" not in e and "number" in e for e in validate_arguments(schema, {"value": True, "unit": "F"}))


def test_toolbox_executes_and_explains_failures():
    box = Toolbox.from_functions([get_order, convert])
    assert box.execute(ToolCall("get_order", {"order_id": "A1"})) == (True, {"order_id": "A1", "verbose": False})
    ok, result = box.execute(ToolCall("get_order", {"order_id": "missing"}))
    assert ok and result == {"error": "order missing not found"}  # a domain failure is a valid call
    ok, result = box.execute(ToolCall("refund", {}))
    assert not ok and "unknown function 'refund'" in result and "get_order" in result
    ok, result = box.execute(ToolCall("convert", {"value": "x", "unit": "F"}))
    assert not ok and "invalid call to convert" in result
    assert format_tool_call("a", {"x": 1}) == '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
