"""Action formats: how a policy's turn of text names a tool call or a final answer, and back.

Two formats, one interface (``parse`` a turn, ``render`` an action, ``describe`` the tools):

* ``react`` (Yao et al. 2023, "ReAct: Synergizing Reasoning and Acting in Language Models"): a turn
  is optional free text (a ``Thought: ...``) then ``Action: tool[input]``; ``Action: finish[answer]``
  ends the episode. The observation comes back as the next (tool) message. Departure from the
  paper by default: the turn ends at the model's end-of-turn token and the observation is a
  chat-template tool message; ``environment.rendering: text`` gives the paper's layout instead, one
  text whose turns stop on the ``Observation:`` string (:class:`tether.rollout.agent.TextRenderer`).
* ``hermes`` (the NousResearch Hermes / Qwen function-calling convention): tool calls are JSON
  objects ``{"name": ..., "arguments": {...}}`` inside ``<tool_call>...</tool_call>`` tags; a turn
  with no tool call is the final answer. Several calls in one turn are all executed.

A turn that is neither a well-formed call of a known tool nor a final answer parses to a
``malformed`` action; the environment turns it into an error observation the policy sees.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from tether.core.registry import Registry
from tether.tasks.base import THINK_CLOSE


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] | str


@dataclass
class Action:
    """A parsed turn: ``tool`` calls, a ``final`` answer, or ``malformed`` (``error`` says why)."""

    kind: Literal["tool", "final", "malformed"]
    calls: list[ToolCall] = field(default_factory=list)
    answer: str | None = None
    error: str | None = None


class ActionFormat:
    """Base: ``parse(text, tool_names)``, ``render(action)`` and ``describe(schemas)``."""

    name = ""

    def parse(self, text: str, tool_names: list[str]) -> Action:
        raise NotImplementedError

    def render(self, action: Action) -> str:
        raise NotImplementedError

    def describe(self, schemas: list[dict]) -> str:
        raise NotImplementedError


ACTION_FORMATS: Registry[type[ActionFormat]] = Registry("action format")

_REACT_ACTION = re.compile(r"(?P<name>[A-Za-z_]\w*)\s*\[(?P<input>.*)\]", re.DOTALL)


@ACTION_FORMATS.register("react")
class ReAct(ActionFormat):
    """``Action: tool[input]`` / ``Action: finish[answer]``; see the module docstring."""

    name = "react"
    finish = "finish"

    def parse(self, text: str, tool_names: list[str]) -> Action:
        if "Action:" not in text:
            return Action("malformed", error="no action: write 'Action: tool[input]' or 'Action: finish[answer]'")
        body = text.rsplit("Action:", 1)[1].strip()
        match = _REACT_ACTION.fullmatch(body)
        if match is None:
            return Action("malformed", error=f"cannot read the action {body[:80]!r}: expected tool[input]")
        name, argument = match["name"], match["input"].strip()
        if name == self.finish:
            return Action("final", answer=argument)
        if name not in tool_names:
            return Action("malformed", error=f"unknown tool {name!r}; tools: {', '.join(tool_names)}, finish")
        if argument.startswith("{"):  # a tool with several parameters takes a JSON object
            try:
                return Action("tool", calls=[ToolCall(name, json.loads(argument))])
            except json.JSONDecodeError:
                pass
        return Action("tool", calls=[ToolCall(name, argument)])

    def render(self, action: Action) -> str:
        if action.kind == "final":
            return f"Action: {self.finish}[{action.answer}]"
        call = action.calls[0]
        argument = call.arguments
        if isinstance(argument, dict):  # one parameter: its bare value, as in tool[input]
            argument = next(iter(argument.values())) if len(argument) == 1 else json.dumps(argument)
        return f"Action: {call.name}[{argument}]"

    def describe(self, schemas: list[dict]) -> str:
        lines = [f"{s['function']['name']}[{', '.join(s['function']['parameters']['properties'])}]: "
                 f"{s['function']['description']}" for s in schemas]
        return ("Solve the task with tools. Each turn write 'Action: tool[input]' and read the result, "
                "or 'Action: finish[answer]'. Tools:\n" + "\n".join(lines))


_TOOL_CALL = re.compile(r"<tool_call>\s*(?P<body>.*?)\s*</tool_call>", re.DOTALL)


@ACTION_FORMATS.register("hermes")
class Hermes(ActionFormat):
    """JSON tool calls in ``<tool_call>`` tags; a turn without one is the final answer."""

    name = "hermes"
    max_calls = 4

    def parse(self, text: str, tool_names: list[str]) -> Action:
        if "<tool_call>" not in text:
            answer = text.rsplit(THINK_CLOSE, 1)[-1].strip()
            return Action("final", answer=answer)
        bodies = _TOOL_CALL.findall(text)
        if not bodies or text.count("<tool_call>") != len(bodies):
            return Action("malformed", error="unterminated <tool_call>: close it with </tool_call>")
        calls = []
        for body in bodies[: self.max_calls]:
            try:
                call = json.loads(body)
            except json.JSONDecodeError as err:
                return Action("malformed", error=f"tool call is not valid JSON ({err.msg} at {err.pos})")
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return Action("malformed", error='a tool call needs {"name": ..., "arguments": {...}}')
            if call["name"] not in tool_names:
                return Action("malformed", error=f"unknown tool {call['name']!r}; tools: {', '.join(tool_names)}")
            calls.append(ToolCall(call["name"], call.get("arguments", {})))
        return Action("tool", calls=calls)

    def render(self, action: Action) -> str:
        if action.kind == "final":
            return action.answer or ""
        return "".join(f"<tool_call>{json.dumps({'name': c.name, 'arguments': c.arguments})}</tool_call>"
                       for c in action.calls)

    def describe(self, schemas: list[dict]) -> str:
        return ("You are a function calling AI model. You are provided with function signatures within "
                "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
                f"<tools>{json.dumps(schemas)}</tools> For each function call return a json object with "
                "function name and arguments within <tool_call></tool_call> XML tags: "
                '<tool_call>{"name": <function-name>, "arguments": <args-dict>}</tool_call>. '
                "Answer without a tool call when you are done.")


def get_action_format(name: str) -> ActionFormat:
    return ACTION_FORMATS.get(name)()
