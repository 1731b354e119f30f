"""The base of every config: strict pydantic models, registry-name checks, and YAML / override parsing.

Unknown keys are rejected with the list of valid ones; every field carries a description (a test
checks it), from which the documentation site generates its configuration reference (``tether.config.reference``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, model_validator


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says which key and why."""


def describe_validation_error(err: Any) -> str:
    """A pydantic ``ValidationError`` as one problem per line, ``key.path: message``, without pydantic's
    framing and web links; a single problem stays on one line."""
    problems = []
    for item in err.errors(include_url=False):
        where = ".".join(str(part) for part in item.get("loc", ())) or "config"
        message = str(item.get("msg", "invalid")).removeprefix("Value error, ").removeprefix("Assertion failed, ")
        given = item.get("input")
        if item.get("type") in ("missing", "extra_forbidden") or isinstance(given, dict | list):
            problems.append(f"{where}: {message}")
        else:
            problems.append(f"{where}: {message} (got {given!r:.60})")
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems:\n" + "\n".join(f"  {p}" for p in problems)


def known_name(registry: Any, name: str) -> str:
    """Validate a registry name inside a pydantic validator (ValueError lists the valid names)."""
    if name not in registry:
        raise ValueError(f"unknown {registry.kind} {name!r}; valid names: {', '.join(registry.names())}")
    return name


class StrictModel(BaseModel):
    """Base for every config: unknown keys fail with the valid names listed."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            valid = set(cls.model_fields) | {alias for f in cls.model_fields.values() for alias in _aliases(f)}
            unknown = sorted(k for k in data if k not in valid)
            if unknown:
                raise ValueError(
                    f"unknown key(s) {', '.join(map(repr, unknown))} in {cls.__name__}; "
                    f"valid keys: {', '.join(sorted(valid))}"
                )
        return data


def _aliases(field: Any) -> list[str]:
    """The other names a field accepts (``alias``, and the choices of a ``validation_alias``)."""
    names = [field.alias] if field.alias else []
    choices = getattr(field.validation_alias, "choices", None)
    if choices:
        names += [c for c in choices if isinstance(c, str)]
    elif isinstance(field.validation_alias, str):
        names.append(field.validation_alias)
    return names


def deep_merge(base: dict, update: dict) -> dict:
    """``update`` merged into a copy of ``base``, mappings merged key by key, everything else replaced."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start})") from None
    except (yaml.YAMLError, RecursionError) as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def parse_value(text: str) -> Any:
    """An override's value, parsed as YAML (``3``, ``1e-4``, ``true``, ``[a, b]``, ``null``)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:  # YAML 1.1 reads "1e-4" as a string
            return float(value)
        except ValueError:
            pass
    return value


def apply_override(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c=value`` in a nested dict, creating mappings as needed."""
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {key!r} is not a mapping")
        node = child
    node[keys[-1]] = value


def parse_overrides(items: list[str]) -> list[tuple[str, Any]]:
    pairs = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        key, value = item.split("=", 1)
        pairs.append((key.strip(), parse_value(value)))
    return pairs
