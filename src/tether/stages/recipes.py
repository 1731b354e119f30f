"""Recipe files: the built-in recipes, loading a recipe by name or path, and dotted overrides.

Reading a recipe imports no trainer (``tether recipes`` lists them quickly); validating and running
one is :mod:`tether.stages.pipeline`.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from tether.config.base import ConfigError, apply_override, deep_merge, load_yaml, parse_overrides


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


def stage_references(value: Any) -> set[str]:
    """The stages a stage's raw config names with ``@stage`` or ``@stage/sub/path``."""
    if isinstance(value, dict):
        return set().union(*(stage_references(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(stage_references(v) for v in value))
    if isinstance(value, str) and value.startswith("@"):
        return {value[1:].partition("/")[0]}
    return set()


def select_stages(recipe: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``recipe`` with only the stages ``names`` and, transitively, the earlier stages they use (``@stage``),
    in the recipe's order (``tether run RECIPE --stages NAME``). A stage already finished in the run
    directory is reused as in any run, so a later run of the whole recipe there trains only the rest."""
    if not names:
        raise ConfigError("--stages names no stage")
    defaults = recipe.get("defaults") or {}
    stages = [deep_merge(defaults, raw) if isinstance(raw, dict) and isinstance(defaults, dict) else raw
              for raw in recipe["stages"]]
    order = [raw.get("name", raw.get("type", f"stage{i}")) if isinstance(raw, dict) else f"stage{i}"
             for i, raw in enumerate(stages)]
    by_name = {name: i for i, name in enumerate(order)}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ConfigError(f"--stages: no stage {', '.join(map(repr, unknown))} in recipe {recipe.get('name', '')!r}; "
                          f"its stages: {', '.join(by_name)}")
    needed, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo.extend(n for n in stage_references(stages[by_name[name]]) if n in by_name)
    return {**unshared(recipe), "stages": [unshared(raw) for name, raw in zip(order, recipe["stages"], strict=True)
                                           if name in needed]}
