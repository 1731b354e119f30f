"""Action formats: ReAct and Hermes-style JSON tool calls parse, render and round-trip; malformed turns say why."""

import pytest

from tether.rollout.actions import Action, ToolCall, get_action_format

TOOLS = ["calculator", "python"]


def test_react_parses_tool_calls_final_answers_and_thoughts():
    react = get_action_format("react")
    action = react.parse("Thought: multiply.\nAction: calculator[417*823]", TOOLS)
    assert action.kind == "tool" and action.calls == [ToolCall("calculator", "417*823")]
    code = react.parse("Action: python[xs = [1, 2]\nprint(xs[0])]", TOOLS)  # brackets inside the input
    assert code.calls[0].arguments == "xs = [1, 2]\nprint(xs[0])"
    assert react.parse("Action: finish[343191]", TOOLS) == Action("final", answer="343191")
    assert react.parse('Action: calculator[{"expression": "2+2"}]', TOOLS).calls[0].arguments == {"expression": "2+2"}


@pytest.mark.parametrize(("text", "reason"), [
    ("343191", "no action"), ("Action: calculator(2+2)", "cannot read"), ("Action: abacus[2+2]", "unknown tool")])
def test_react_malformed(text, reason):
    action = get_action_format("react").parse(text, TOOLS)
    assert action.kind == "malformed" and reason in action.error


def test_hermes_parses_json_calls_and_final_answers():
    hermes = get_action_format("hermes")
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
            '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>')
    action = hermes.parse(text, TOOLS)
    assert action.kind == "tool" and [c.name for c in action.calls] == ["calculator", "python"]
    assert hermes.parse("<think>easy</think> 4", TOOLS) == Action("final", answer="4")


@pytest.mark.parametrize(("text", "reason"), [
    ('<tool_call>{"name": "calculator"', "unterminated"),
    ("<tool_call>{name: calculator}</tool_call>", "not valid JSON"),
    ('<tool_call>["calculator"]</tool_call>', '"name"'),
    ('<tool_call>{"name": "abacus", "arguments": {}}</tool_call>', "unknown tool")])
def test_hermes_malformed(text, reason):
    action = get_action_format("hermes").parse(text, TOOLS)
    assert action.kind == "malformed" and reason in action.error


@pytest.mark.parametrize("name", ["react", "hermes"])
def test_render_round_trips(name):
    fmt = get_action_format(name)
    call = Action("tool", calls=[ToolCall("calculator", {"expression": "12*34"})])
    parsed = fmt.parse(fmt.render(call), TOOLS)
    assert parsed.kind == "tool" and parsed.calls[0].name == "calculator"
    assert parsed.calls[0].arguments in ("12*34", {"expression": "12*34"})
    assert fmt.parse(fmt.render(Action("final", answer="408")), TOOLS) == Action("final", answer="408")


def test_descriptions_name_the_tools():
    from tether.rollout.tools import build_tools

    schemas = [t.schema for t in build_tools(["calculator", "python"]).values()]
    assert "calculator[expression]" in get_action_format("react").describe(schemas)
    assert '"name": "python"' in get_action_format("hermes").describe(schemas)
