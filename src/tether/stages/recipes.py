"""Recipe files: the built-in recipes, loading a recipe by name or path, and dotted overrides.

Reading a recipe imports no trainer (``tether recipes`` lists them quickly); validating and running
one is :mod:`tether.stages.pipeline`.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from tether.config.base import ConfigError, apply_override, load_yaml, parse_overrides


def builtin_recipes() -> dict[str, Path]:
    folder = resources.files("tether") / "recipes"
    return {Path(str(p)).stem: Path(str(p)) for p in folder.iterdir() if str(p).endswith(".yaml")}


def load_recipe(name_or_path: str) -> dict[str, Any]:
    recipes = builtin_recipes()
    if name_or_path in recipes:
        data = load_yaml(recipes[name_or_path])
    elif Path(name_or_path).exists():
        data = load_yaml(name_or_path)
    else:
        raise ConfigError(f"no recipe {name_or_path!r}: not a file, and not one of the built-in recipes "
                          f"({', '.join(sorted(recipes))})")
    if not isinstance(data.get("stages"), list) or not data["stages"]:
        raise ConfigError(f"recipe {name_or_path!r} has no 'stages' list")
    data.setdefault("name", Path(name_or_path).stem)
    return unshared(data)


def unshared(value: Any) -> Any:
    """``value`` with every dict and list copied: YAML anchors (``<<: *stage``) make stages share nested
    dicts, and an override of one stage must not reach the others (``copy.deepcopy`` keeps the sharing)."""
    if isinstance(value, dict):
        return {k: unshared(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unshared(v) for v in value]
    return value


def apply_recipe_overrides(recipe: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Dotted overrides: ``STAGE.key.path=v`` for one stage, ``*.key.path=v`` for every stage,
    anything else at the recipe's top level (``defaults.optim.lr=1e-3``)."""
    recipe = unshared(recipe)
    names = [s.get("name") for s in recipe["stages"]]
    for key, value in parse_overrides(overrides):
        head, _, rest = key.partition(".")
        if head == "*" and rest:
            for stage in recipe["stages"]:
                apply_override(stage, rest, value)
        elif head in names and rest:
            apply_override(recipe["stages"][names.index(head)], rest, value)
        elif head in ("name", "description", "defaults", "stages") or not rest:
            apply_override(recipe, key, value)
        else:
            raise ConfigError(f"override {key!r}: {head!r} is neither a stage ({', '.join(names)}) nor "
                              "'*' nor a recipe key")
    return recipe
