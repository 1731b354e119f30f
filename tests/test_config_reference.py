"""Every config field is described, and the configuration reference (generated when the docs are built) renders."""

import importlib
import pkgutil

import tether
from tether.config.base import StrictModel
from tether.config.reference import config_classes, main, render, undescribed_fields


def all_config_models() -> list[type[StrictModel]]:
    """Every StrictModel subclass anywhere in tether (the sandbox limits too), after importing every module."""
    for info in pkgutil.walk_packages(tether.__path__, "tether."):
        if not info.name.endswith("_sandbox_child"):
            importlib.import_module(info.name)
    seen, stack = set(), [StrictModel]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
    return sorted(seen, key=lambda c: f"{c.__module__}.{c.__name__}")


def test_every_config_field_has_a_description():
    missing = [f"{c.__module__}.{c.__name__}.{name}" for c in all_config_models()
               for name, field in c.model_fields.items() if not (field.description or "").strip()]
    assert missing == []
    assert undescribed_fields() == []


def test_the_reference_covers_every_config_class_of_the_config_package():
    defined = {c for c in all_config_models() if c.__module__.startswith("tether.config.")}
    assert defined == set(config_classes())


def test_the_reference_renders_every_class_once_and_main_prints_or_writes_it(tmp_path, capsys):
    text = render()
    for cls in config_classes():
        assert text.count(f"\n### {cls.__name__}\n") == 1
    assert main([]) == 0 and capsys.readouterr().out == text
    assert main([str(tmp_path / "ref.md")]) == 0 and (tmp_path / "ref.md").read_text() == text


def test_the_reference_shows_type_default_and_description():
    text = render()
    assert "| `temperature` | float | `1.0` | softmax temperature; 0: greedy |" in text
    assert "| `kl` | [PPOKLConfig](#ppoklconfig) |" in text
    assert "| `preference_model` | str | required |" in text
