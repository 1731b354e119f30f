"""The configuration reference, generated from the pydantic models: ``python -m tether.config.reference``.

Prints (or writes to a PATH) every config class of ``tether.config``, grouped by module, each field with its
type, default and description. The documentation site renders it when it is built (``docs/gen_ref.py``, its
page ``reference/configuration.md``), so nothing generated is committed; a test fails on a field without a
description.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from tether.config.base import StrictModel

MODULES = ("common", "sampling", "data", "rewards", "sft", "preference", "rl", "agent", "rlhf", "cai", "distill",
           "compare")
MAX_DEFAULT = 70


def config_classes() -> list[type[StrictModel]]:
    """Every config class defined in ``tether.config``'s modules, in module order, then source order."""
    out: list[type[StrictModel]] = []
    for short in MODULES:
        module = importlib.import_module(f"tether.config.{short}")
        members = [c for c in vars(module).values()
                   if inspect.isclass(c) and issubclass(c, StrictModel) and c.__module__ == module.__name__]
        out += sorted(members, key=lambda c: inspect.getsourcelines(c)[1])
    return out


def undescribed_fields() -> list[str]:
    """``Class.field`` for every field (inherited ones included) without a description."""
    return [f"{c.__name__}.{name}" for c in config_classes() for name, f in c.model_fields.items()
            if not (f.description or "").strip()]


def _type(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type(a) for a in args)}]" if args else name
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    if annotation is type(None):
        return "null"
    if inspect.isclass(annotation) and issubclass(annotation, enum.Enum):
        return " | ".join(json.dumps(m.value) for m in annotation)
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", exclude_defaults=True)
    if isinstance(value, list):
        value = [v.model_dump(mode="json", exclude_defaults=True) if isinstance(v, BaseModel) else v for v in value]
    if isinstance(value, dict):
        value = {k: v.model_dump(mode="json", exclude_defaults=True) if isinstance(v, BaseModel) else v
                 for k, v in value.items()}
    text = json.dumps(value, default=str)
    return f"`{text if len(text) <= MAX_DEFAULT else text[: MAX_DEFAULT - 3] + '...'}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_class(cls: type[StrictModel]) -> str:
    doc = inspect.cleandoc(cls.__doc__ or "")
    bases = [b.__name__ for b in cls.__bases__ if issubclass(b, StrictModel) and b is not StrictModel]
    lines = [f"### {cls.__name__}", ""]
    if doc:
        lines += [_cell(doc), ""]
    if bases:
        lines += ["Extends " + ", ".join(f"[{b}](#{b.lower()})" for b in bases) + ".", ""]
    lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for name, field in cls.model_fields.items():
        lines.append(f"| `{name}` | {_cell(_type(field.annotation))} | {_cell(_default(field))} | "
                     f"{_cell(field.description or '')} |")
    return "\n".join(lines)


def render() -> str:
    """The whole reference, as Markdown."""
    parts = ["# Configuration reference", "",
             "Generated from the pydantic models when the documentation is built (`python -m tether.config.reference` "
             "prints it); do not edit by hand. "
             "A recipe stage is a mapping of these keys (its `type` picks the stage config); nested blocks are "
             "the classes linked in the type column. Unknown keys are errors that list the valid ones.", ""]
    current = None
    for cls in config_classes():
        if cls.__module__ != current:
            current = cls.__module__
            summary = inspect.cleandoc(sys.modules[current].__doc__ or "").split("\n\n")[0]
            parts += [f"## `{current}`", "", _cell(summary), ""]
        parts += [render_class(cls), ""]
    return "\n".join(parts).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m tether.config.reference [PATH | -]``: print the reference (``-`` or nothing), or write it to PATH."""
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if not args or args[0] == "-":
        sys.stdout.write(text)
        return 0
    path = Path(args[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path} ({len(config_classes())} config classes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
