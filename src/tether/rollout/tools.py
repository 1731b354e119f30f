"""Tools an agent can call: plain Python callables with type hints and a docstring, described by a JSON schema.

A tool is any function such as::

    def calculator(expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression with integers and + - * / // % ** and parentheses.

        Args:
            expression: the expression, e.g. "417*823".
        \"\"\"

:func:`tool_schema` turns it into the OpenAI / Hugging Face function schema (``{"type": "function",
"function": {"name", "description", "parameters"}}``) that chat templates render and Hermes-style
prompts list, as in Toolformer (Schick et al. 2023) and the function-calling APIs after it: the
first docstring paragraph is the description, ``Args:`` lines describe the parameters, and type
hints give their JSON types. A tool returns a string (anything else is ``str()``-ed); an exception
becomes an error observation the policy sees.

Built-in tools (``TOOLS``): ``calculator`` (exact integer / rational arithmetic, no ``eval``) and
``python`` (runs a program in :mod:`tether.runtime.sandbox` and returns its output).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import operator
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from tether.core.registry import Registry

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def _json_type(hint: Any) -> dict[str, Any]:
    """JSON schema of a type hint: str/int/float/bool, list[X], dict, Literal[...], X | None."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return {"type": _JSON_TYPES.get(type(args[0]), "string"), "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return _json_type(rest[0]) if len(rest) == 1 else {"anyOf": [_json_type(a) for a in rest]}
    if origin is list:
        return {"type": "array", **({"items": _json_type(args[0])} if args else {})}
    if origin is dict or hint is dict:
        return {"type": "object"}
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    raise TypeError(f"tool parameters need JSON-compatible type hints; got {hint!r}")


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(first paragraph, {parameter: description}) from a Google-style docstring."""
    doc = inspect.cleandoc(doc or "")
    summary = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    params: dict[str, str] = {}
    section = re.search(r"^(?:Args|Arguments|Parameters):\s*\n(?P<body>(?:[ \t]+.*\n?|\s*\n)+)", doc, re.M)
    if section:
        current = None
        for line in section["body"].splitlines():
            match = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line)
            if match:
                current = match[1]
                params[current] = match[2].strip()
            elif current and line.strip():
                params[current] += " " + line.strip()
    return summary, params


def tool_schema(fn: Callable, name: str | None = None) -> dict[str, Any]:
    """The JSON function schema of a typed, documented callable (see the module docstring)."""
    if not fn.__doc__:
        raise ValueError(f"tool {name or fn.__name__!r} needs a docstring: it is the description the model reads")
    summary, described = _docstring_parts(fn.__doc__)
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.name not in hints:
            raise TypeError(f"tool {name or fn.__name__!r}: parameter {param.name!r} has no type hint")
        properties[param.name] = _json_type(hints[param.name])
        if param.name in described:
            properties[param.name]["description"] = described[param.name]
        if param.default is param.empty:
            required.append(param.name)
    return {"type": "function", "function": {
        "name": name or fn.__name__, "description": summary,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


class ToolArgumentError(ValueError):
    """The arguments of a tool call do not fit the tool's schema."""


@dataclass
class Tool:
    """A callable with its schema. ``__call__(arguments)`` validates a dict of arguments and returns text."""

    fn: Callable[..., Any]
    name: str = ""

    def __post_init__(self) -> None:
        self.name = self.name or self.fn.__name__
        self.schema = tool_schema(self.fn, self.name)

    @property
    def parameters(self) -> dict[str, Any]:
        return self.schema["function"]["parameters"]

    def coerce(self, arguments: dict[str, Any] | str) -> dict[str, Any]:
        """Check ``arguments`` against the schema. A bare string (a ReAct ``tool[input]``) fills the
        tool's one required parameter."""
        params = self.parameters
        if isinstance(arguments, str):
            if len(params["required"]) != 1:
                raise ToolArgumentError(f"{self.name} takes {len(params['required'])} arguments; pass a JSON object")
            arguments = {params["required"][0]: arguments}
        if not isinstance(arguments, dict):
            raise ToolArgumentError(f"{self.name}: arguments must be an object, got {type(arguments).__name__}")
        unknown = sorted(set(arguments) - set(params["properties"]))
        missing = sorted(set(params["required"]) - set(arguments))
        if unknown or missing:
            raise ToolArgumentError(f"{self.name}: " + "; ".join(
                [f"unknown argument(s) {unknown}"] * bool(unknown) + [f"missing argument(s) {missing}"] * bool(missing)))
        for key, value in arguments.items():
            expected = params["properties"][key].get("type")
            if expected == "string" and not isinstance(value, str):
                raise ToolArgumentError(f"{self.name}: argument {key!r} must be a string")
        return arguments

    def __call__(self, arguments: dict[str, Any] | str) -> str:
        result = self.fn(**self.coerce(arguments))
        return result if isinstance(result, str) else str(result)


# ---------------------------------------------------------------------------------------- built-ins

TOOLS: Registry[Callable[..., Tool]] = Registry("tool")

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_ARITHMETIC = re.compile(r"[0-9.+\-*/%()^×\s]*")


def _evaluate(node: ast.AST, max_digits: int) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, max_digits)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, max_digits))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, max_digits), _evaluate(node.right, max_digits)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) * len(str(left)) > max_digits):
            raise ValueError("exponent too large (or not an integer)")
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ZeroDivisionError("division by zero")
        value = _BINARY[type(node.op)](left, right)
        value = Fraction(value)
        if len(str(value.numerator)) > max_digits:
            raise ValueError(f"result has more than {max_digits} digits")
        return value
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculate(expression: str, *, max_digits: int = 100) -> str:
    """Exact arithmetic on an expression string; integers print as integers, fractions as decimals."""
    if len(expression) > 500:
        raise ValueError("expression too long")
    if not _ARITHMETIC.fullmatch(expression):  # before ast.parse, which warns about e.g. "12ab"
        raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed: {expression!r}")
    try:
        tree = ast.parse(expression.strip().replace("^", "**").replace("×", "*"), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"cannot parse {expression!r}") from err
    value = _evaluate(tree, max_digits)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


@TOOLS.register("calculator")
def calculator_tool() -> Tool:
    """The ``calculator`` tool: evaluates an arithmetic expression exactly."""

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression exactly: integers, + - * / // % ** and parentheses.

        Args:
            expression: the expression, e.g. "417*823".
        """
        return calculate(expression)

    return Tool(calculator)


@TOOLS.register("python")
def python_tool(limits: dict | None = None, max_chars: int = 2000) -> Tool:
    """The ``python`` tool: runs a program in the sandbox; returns its stdout, or the error it hit."""
    from tether.runtime.sandbox import SandboxLimits, run_python

    sandbox_limits = SandboxLimits.model_validate(limits or {})

    def python(code: str) -> str:
        """Run a Python program in a sandbox (no network, no files kept) and return what it prints.

        Args:
            code: the program; print the values you need, e.g. "print(417*823)".
        """
        result = run_python(code, limits=sandbox_limits)
        if result.ok:
            return result.stdout.strip()[:max_chars] or "(no output)"
        reason = f"limit hit: {result.limit}" if result.limit else (result.error or f"exit {result.exit_code}")
        raise ToolExecutionError(f"{reason}", limit=result.limit, output=result.stdout.strip()[:max_chars])

    return Tool(python)


class ToolExecutionError(RuntimeError):
    """A tool ran but failed; ``limit`` names a sandbox limit that was hit, if any."""

    def __init__(self, message: str, *, limit: str | None = None, output: str = "") -> None:
        super().__init__(message)
        self.limit, self.output = limit, output


def _import(path: str) -> Callable:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def build_tools(specs: list[str | dict | Callable | Tool]) -> dict[str, Tool]:
    """Tools by name from config entries: a registered name, an import path ``"package.module:function"``
    (any typed, documented function), ``{name: ..., kwargs: {...}}``, a callable or a Tool."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        if isinstance(spec, Tool):
            tool = spec
        elif callable(spec):
            tool = Tool(spec)
        elif isinstance(spec, str) and ":" in spec and spec not in TOOLS:
            tool = Tool(_import(spec))
        elif isinstance(spec, str):
            tool = TOOLS.get(spec)()
        else:
            tool = TOOLS.get(spec["name"])(**spec.get("kwargs", {}))
        if tool.name in tools:
            raise ValueError(f"two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools
