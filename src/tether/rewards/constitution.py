"""Constitutions: the written principles a judge critiques, revises and compares responses against.

A constitution is a list of principles, each a *critique request* and a *revision request* as in
Bai et al. 2022, "Constitutional AI: Harmlessness from AI Feedback" (Sec. 3.1 and Appendix C), plus
an optional *comparison* question for AI preference labels (their Sec. 4.1, "Which of these
responses is less harmful?"; without one, the critique request is used). A principle may carry a
sampling ``weight`` (default 1); each critique or label samples one principle.

Two file formats. YAML (``.yaml`` / ``.yml``)::

    name: my-constitution
    description: one line
    principles:
      - name: harmful                      # optional; default principle-N
        critique_request: Identify specific ways in which the assistant's last response is harmful.
        revision_request: Please rewrite the response to remove any harmful content.
        comparison: Which of these responses is less harmful?       # optional
        weight: 1.0                                                # optional

(a bare list of principles works too), or plain text (any other suffix): blocks separated by blank
lines, ``key: value`` lines with the same keys, an optional ``[name]`` line heading a block,
indented lines continuing the previous value, ``#`` comment lines::

    [harmful]
    critique_request: Identify specific ways in which the assistant's last response is harmful.
    revision_request: Please rewrite the response to remove any harmful content.

A bad file fails with a :class:`ConstitutionError` naming the file, the line and the field. The
default constitution (``load_constitution("default")``) ships as package data in
``tether/constitutions/default.yaml``: principles adapted from Bai et al.'s Appendix C, and one on
confidentiality that the ``secret`` task checks exactly.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

FIELDS = ("name", "critique_request", "revision_request", "comparison", "weight")
REQUIRED = ("critique_request", "revision_request")
TOP_LEVEL = ("name", "description", "principles")


class ConstitutionError(ValueError):
    """A constitution that cannot be used; ``source``, ``line`` (1-based) and ``field`` say where."""

    def __init__(self, message: str, *, source: str, line: int | None = None, field: str | None = None) -> None:
        where = source + (f", line {line}" if line is not None else "") + (f", field {field!r}" if field else "")
        super().__init__(f"{where}: {message}")
        self.source, self.line, self.field = source, line, field


@dataclass(frozen=True)
class Principle:
    name: str
    critique_request: str
    revision_request: str
    comparison: str | None = None
    weight: float = 1.0

    @property
    def comparison_text(self) -> str:
        """What a pairwise judge is asked to compare by: ``comparison``, else the critique request."""
        return self.comparison or self.critique_request


@dataclass(frozen=True)
class Constitution:
    name: str
    principles: tuple[Principle, ...]
    description: str = ""
    source: str = ""

    def __len__(self) -> int:
        return len(self.principles)

    def sample(self, rng: random.Random) -> Principle:
        """One principle, drawn in proportion to ``weight``."""
        return rng.choices(self.principles, weights=[p.weight for p in self.principles])[0]

    def get(self, name: str) -> Principle:
        for p in self.principles:
            if p.name == name:
                return p
        raise KeyError(f"constitution {self.name!r} has no principle {name!r}; it has: "
                       f"{', '.join(p.name for p in self.principles)}")


def constitution_names() -> list[str]:
    """The built-in constitutions (file stems of ``tether/constitutions/*.yaml``)."""
    folder = resources.files("tether") / "constitutions"
    return sorted(Path(str(p)).stem for p in folder.iterdir() if str(p).endswith(".yaml"))


def load_constitution(name_or_path: str | Path | Constitution = "default") -> Constitution:
    """A built-in constitution by name, or a YAML / plain-text constitution file."""
    if isinstance(name_or_path, Constitution):
        return name_or_path
    name = str(name_or_path)
    if name in constitution_names():
        text = (resources.files("tether") / "constitutions" / f"{name}.yaml").read_text(encoding="utf-8")
        return parse_constitution(text, source=f"constitution {name!r}", kind="yaml", default_name=name)
    path = Path(name)
    if not path.is_file():
        raise ConstitutionError(f"no such file, and not a built-in constitution ({', '.join(constitution_names())})",
                                source=name)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConstitutionError(f"not UTF-8 text (byte offset {err.start})", source=str(path)) from None
    kind = "yaml" if path.suffix in (".yaml", ".yml") else "text"
    return parse_constitution(text, source=str(path), kind=kind, default_name=path.stem)


def parse_constitution(text: str, *, source: str = "<string>", kind: str = "yaml",
                       default_name: str = "constitution") -> Constitution:
    """Parse constitution ``text`` (``kind``: ``yaml`` or ``text``); errors name ``source`` and the line."""
    if kind not in ("yaml", "text"):
        raise ValueError(f"kind must be 'yaml' or 'text', got {kind!r}")
    if kind == "yaml":
        meta, entries = _yaml_entries(text, source)
    else:
        meta, entries = {}, _text_entries(text, source)
    if not entries:
        raise ConstitutionError("no principles", source=source, field="principles")
    principles = [_principle(fields, line, i, source) for i, (fields, line) in enumerate(entries)]
    seen: dict[str, int] = {}
    for p, (_, line) in zip(principles, entries, strict=True):
        if p.name in seen:
            raise ConstitutionError(f"principle name {p.name!r} is used twice (first at line {seen[p.name]})",
                                    source=source, line=line, field="name")
        seen[p.name] = line
    return Constitution(name=str(meta.get("name") or default_name), principles=tuple(principles),
                        description=str(meta.get("description") or ""), source=source)


# ---- one principle -------------------------------------------------------------------------------------

Entry = tuple[dict[str, tuple[Any, int]], int]  # field -> (value, line), and the entry's first line


def _principle(fields: dict[str, tuple[Any, int]], line: int, index: int, source: str) -> Principle:
    label = f"principle {index + 1}"
    for key, (_, at) in fields.items():
        if key not in FIELDS:
            raise ConstitutionError(f"unknown field in {label}; valid fields: {', '.join(FIELDS)}",
                                    source=source, line=at, field=key)
    for key in REQUIRED:
        if key not in fields:
            raise ConstitutionError(f"{label} has no {key}", source=source, line=line, field=key)
    values: dict[str, Any] = {}
    for key, (value, at) in fields.items():
        if key == "weight":
            values[key] = _weight(value, source, at)
            continue
        if not isinstance(value, str) or not value.strip():
            raise ConstitutionError(f"{label}: expected non-empty text, got {value!r}", source=source, line=at,
                                    field=key)
        values[key] = " ".join(value.split()) if key == "name" else value.strip()
    values.setdefault("name", f"principle-{index + 1}")
    return Principle(**values)


def _weight(value: Any, source: str, line: int) -> float:
    try:
        weight = float(value)
    except (TypeError, ValueError):
        weight = math.nan
    if isinstance(value, bool) or not math.isfinite(weight) or weight <= 0:
        raise ConstitutionError(f"expected a positive number, got {value!r}", source=source, line=line,
                                field="weight")
    return weight


# ---- YAML, with line numbers ---------------------------------------------------------------------------


def _yaml_entries(text: str, source: str) -> tuple[dict[str, Any], list[Entry]]:
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise ConstitutionError(f"not valid YAML: {getattr(err, 'problem', None) or err}", source=source,
                                line=mark.line + 1 if mark else None) from None
    if root is None:
        raise ConstitutionError("empty file", source=source)
    meta: dict[str, Any] = {}
    if isinstance(root, yaml.MappingNode):
        items = {key.value: (key, value) for key, value in root.value}
        for key, (key_node, _) in items.items():
            if key not in TOP_LEVEL:
                raise ConstitutionError(f"unknown top-level key; valid keys: {', '.join(TOP_LEVEL)}",
                                        source=source, line=key_node.start_mark.line + 1, field=key)
        for key in ("name", "description"):
            if key in items:
                meta[key] = _scalar(items[key][1], source, key)
        if "principles" not in items:
            raise ConstitutionError("no principles", source=source, line=1, field="principles")
        root = items["principles"][1]
    if not isinstance(root, yaml.SequenceNode):
        raise ConstitutionError("principles must be a list", source=source, line=root.start_mark.line + 1,
                                field="principles")
    entries = []
    for i, node in enumerate(root.value):
        if not isinstance(node, yaml.MappingNode):
            raise ConstitutionError(f"principle {i + 1} must be a mapping of fields", source=source,
                                    line=node.start_mark.line + 1)
        fields: dict[str, tuple[Any, int]] = {}
        for key, value in node.value:
            if key.value in fields:
                raise ConstitutionError("field given twice", source=source, line=key.start_mark.line + 1,
                                        field=key.value)
            fields[key.value] = (_scalar(value, source, key.value), key.start_mark.line + 1)
        entries.append((fields, node.start_mark.line + 1))
    return meta, entries


def _scalar(node: yaml.Node, source: str, field: str) -> Any:
    if not isinstance(node, yaml.ScalarNode):
        raise ConstitutionError("expected a single value, not a list or mapping", source=source,
                                line=node.start_mark.line + 1, field=field)
    return yaml.constructor.SafeConstructor().construct_object(node)


# ---- plain text ----------------------------------------------------------------------------------------

_HEADER = re.compile(r"^\[(.+)\]\s*$")
_FIELD = re.compile(r"^([A-Za-z_][\w-]*)\s*:\s*(.*)$")


def _text_entries(text: str, source: str) -> list[Entry]:
    entries: list[Entry] = []
    fields: dict[str, tuple[Any, int]] = {}
    start, last = 0, None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.rstrip()
        if line.lstrip().startswith("#"):
            continue
        if not line.strip():
            if fields:
                entries.append((fields, start))
            fields, last = {}, None
            continue
        if raw[0] in " \t" and last is not None:  # a continuation of the previous value
            value, at = fields[last]
            fields[last] = (f"{value} {line.strip()}", at)
            continue
        start = start if fields else number
        header, match = _HEADER.match(line), _FIELD.match(line)
        if header is not None and not fields:
            fields["name"], last = (header[1].strip(), number), None
        elif match is not None:
            key = match[1].replace("-", "_")
            if key in fields:
                raise ConstitutionError("field given twice", source=source, line=number, field=key)
            fields[key], last = (match[2].strip(), number), key
        else:
            raise ConstitutionError(f"expected 'key: value' or a '[name]' heading, got {line.strip()[:60]!r}",
                                    source=source, line=number)
    if fields:
        entries.append((fields, start))
    return entries


# ---- templates -----------------------------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def fill(template: str, **values: str) -> str:
    """Replace ``{key}`` placeholders in one pass over the template, so text put in (a response holding
    ``{critique}``, say) is never substituted again; unknown placeholders stay as they are."""
    return _PLACEHOLDER.sub(lambda m: str(values[m[1]]) if m[1] in values else m[0], template)
