"""Tools: JSON schemas from type hints and docstrings, argument checks, the calculator and python tools."""

from typing import Literal

import pytest

from tether.rollout.tools import (
    TOOLS,
    Tool,
    ToolArgumentError,
    ToolExecutionError,
    build_tools,
    calculate,
    tool_schema,
)


def lookup(city: str, days: int = 1, units: Literal["c", "f"] = "c", tags: list[str] | None = None) -> str:
    """Look up the weather forecast.

    Longer text that is not part of the description.

    Args:
        city: the city name,
            spelled out.
        days: how many days ahead.
    """
    return f"{city}:{days}:{units}:{tags}"


def test_schema_from_hints_and_docstring():
    assert tool_schema(lookup) == {"type": "function", "function": {
        "name": "lookup", "description": "Look up the weather forecast.",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "the city name, spelled out."},
            "days": {"type": "integer", "description": "how many days ahead."},
            "units": {"type": "string", "enum": ["c", "f"]},
            "tags": {"type": "array", "items": {"type": "string"}}}}}}


def test_schema_errors():
    def undocumented(x: int) -> int:
        return x

    def untyped(x) -> int:
        """Doc."""
        return x

    with pytest.raises(ValueError, match="docstring"):
        tool_schema(undocumented)
    with pytest.raises(TypeError, match="type hint"):
        tool_schema(untyped)


def test_tool_call_checks_arguments():
    tool = Tool(lookup)
    assert tool({"city": "Oslo", "days": 2}) == "Oslo:2:c:None"
    assert tool("Oslo") == "Oslo:1:c:None"  # a bare ReAct input fills the one required parameter
    with pytest.raises(ToolArgumentError, match="missing"):
        tool({"days": 2})
    with pytest.raises(ToolArgumentError, match="unknown"):
        tool({"city": "Oslo", "colour": "red"})
    with pytest.raises(ToolArgumentError, match="must be a string"):
        tool({"city": 3})


def test_calculator_is_exact_and_refuses_code():
    assert calculate("417*823") == "343191"
    assert calculate("(2+3)**3 - 7 // 2") == "122"
    assert calculate("1/4") == "0.25"
    assert calculate("123456789*987654321") == str(123456789 * 987654321)
    for bad in ("__import__('os')", "2**10**10", "1/0", "x+1"):
        with pytest.raises((ValueError, ZeroDivisionError)):
            calculate(bad)


def test_python_tool_runs_in_the_sandbox():
    tool = TOOLS.get("python")(limits={"wall_s": 1})
    assert tool({"code": "print(417*823)"}) == "343191"
    assert tool("x = 1") == "(no output)"
    with pytest.raises(ToolExecutionError) as err:
        tool("import time\ntime.sleep(30)")
    assert err.value.limit == "wall"
    with pytest.raises(ToolExecutionError, match="ZeroDivisionError"):
        tool("print('partial'); 1/0")


def test_build_tools_from_config_entries():
    tools = build_tools(["calculator", {"name": "python", "kwargs": {"max_chars": 10}}, lookup,
                         "tether.rollout.tools:calculate"])
    assert list(tools) == ["calculator", "python", "lookup", "calculate"]
    with pytest.raises(ValueError, match="two tools"):
        build_tools(["calculator", "calculator"])
    with pytest.raises(KeyError, match="valid names"):
        build_tools(["abacus"])
