"""The reference pages, generated from the code each time the site is built (mkdocs-gen-files).

Nothing this writes is committed: ``mkdocs build`` (and ``mkdocs serve``) runs it and the pages exist
only in the build. It writes

- ``reference/configuration.md``: every config class and key (``tether.config.reference.render``);
- ``reference/cli.md``: every command of the ``tether`` CLI with its options, from the typer app;
- ``reference/registries.md``: every registry (losses, advantage estimators, KL estimators, reward
  functions, tasks, stage types, ...) with each entry's one-line description;
- ``reference/recipes.md``: the built-in recipes with their descriptions and stages;
- ``reference/api.md``: the public Python API, rendered by mkdocstrings from the docstrings.

It imports tether from this checkout's ``src/`` (not whatever tether is installed), so the pages
describe the code they are built with. ``python docs/gen_ref.py OUT_DIR`` writes the same pages to a
folder, for a look without mkdocs.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def first_line(obj: Any) -> str:
    """An object's one-line description: a ``description`` attribute, else its docstring's first paragraph."""
    description = getattr(obj, "description", None)
    if isinstance(description, str) and description.strip():
        return _cell(description)
    target = getattr(obj, "func", obj)  # functools.partial
    doc = inspect.getdoc(target) or ""
    return _cell(doc.split("\n\n")[0])


def import_all() -> None:
    """Import every tether module, so every registry is filled."""
    import tether

    for info in pkgutil.walk_packages(tether.__path__, "tether."):
        if not info.name.endswith("_sandbox_child"):
            importlib.import_module(info.name)


# ---------------------------------------------------------------- configuration


def configuration_page() -> str:
    from tether.config.reference import render

    return render()


# ---------------------------------------------------------------- command line


def _type_name(param: Any, ctx: Any) -> str:
    """The parameter's type as ``--help`` shows it (typer's API, or click's ``type.name``)."""
    display = getattr(param, "display_type", None)
    if callable(display):
        try:
            return str(display(ctx))
        except Exception:  # an older typer: fall through to click's attribute
            pass
    kind = getattr(param, "type", None)
    return str(getattr(kind, "name", kind or ""))


def _param_row(param: Any, ctx: Any) -> str:
    if param.param_type_name == "argument":
        name = f"`{(param.metavar or param.name).upper()}`"
        kind = "argument"
    else:
        names = [*param.opts, *param.secondary_opts]
        name = " / ".join(f"`{n}`" for n in names)
        kind = "flag" if getattr(param, "is_flag", False) else "option"
    type_name = _type_name(param, ctx).lower()
    if getattr(param, "is_flag", False):
        type_name = "flag"
    if getattr(param, "multiple", False) or getattr(param, "nargs", 1) == -1:
        type_name += ", repeatable"
    if param.required:
        default = "required"
    elif param.default is None or param.default == () or callable(param.default):
        default = ""
    else:
        default = f"`{param.default}`"
    help_text = getattr(param, "help", None) or ""
    return f"| {name} | {kind}: {_cell(type_name)} | {_cell(default)} | {_cell(help_text)} |"


def cli_page() -> str:
    import typer

    from tether.cli import app

    # typer may vendor its own click: everything below goes through the objects, never `import click`
    root = typer.main.get_command(app)
    root_ctx = root.context_class(root, info_name="tether")
    lines = ["# Command-line reference", "",
             "Generated from the `tether` typer app (`tether.cli`) when the site is built; "
             "`tether COMMAND --help` prints the same. A stage command takes `--config FILE` and dotted "
             "`key=value` overrides; `tether run` takes a recipe and overrides "
             "(see [Stages, recipes and the command line](../concepts/recipes.md)).", ""]
    names = sorted(root.commands)
    lines += ["| command | what it does |", "| --- | --- |"]
    for name in names:
        command = root.commands[name]
        summary = (command.help or "").strip().split("\n\n")[0]
        lines.append(f"| [`tether {name}`](#tether-{name}) | {_cell(summary)} |")
    lines.append("")
    for name in names:
        command = root.commands[name]
        ctx = command.context_class(command, info_name=name, parent=root_ctx)
        usage = " ".join(command.collect_usage_pieces(ctx))
        lines += [f"## `tether {name}`", "", "```", f"tether {name} {usage}".rstrip(), "```", ""]
        if command.help:
            lines += [inspect.cleandoc(command.help), ""]
        params = [p for p in command.params if p.name != "help" and not getattr(p, "hidden", False)]
        if params:
            lines += ["| parameter | kind | default | help |", "| --- | --- | --- | --- |"]
            lines += [_param_row(p, ctx) for p in params]
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------- registries


def registries() -> list[tuple[str, str, Any]]:
    """(variable name, module, registry) of every Registry in tether, by module."""
    from tether.core.registry import Registry

    import_all()
    found: dict[int, tuple[str, str, Any]] = {}
    for module_name, module in sorted(sys.modules.items()):
        if not module_name.startswith("tether") or module is None:
            continue
        for name, value in vars(module).items():
            if isinstance(value, Registry) and id(value) not in found and getattr(value, "kind", None):
                # the defining module: where the object's name was first bound to it
                found[id(value)] = (name, module_name, value)
    defining = {}
    for name, module_name, registry in found.values():
        defining[id(registry)] = (name, _defining_module(registry, module_name), registry)
    return sorted(defining.values(), key=lambda r: (r[1], r[0]))


def _defining_module(registry: Any, fallback: str) -> str:
    for module_name, module in sorted(sys.modules.items()):
        if module_name.startswith("tether") and module is not None:
            source = getattr(module, "__file__", "") or ""
            if source.endswith(".py"):
                try:
                    text = Path(source).read_text()
                except OSError:
                    continue
                if f'Registry("{registry.kind}")' in text:
                    return module_name
    return fallback


def _entries(registry: Any) -> list[tuple[str, list[str], Any]]:
    """(name, aliases, entry) with aliases folded into their first name."""
    by_object: dict[int, list[str]] = {}
    for name in registry.names():
        by_object.setdefault(id(registry.get(name)), []).append(name)
    out = []
    for names in by_object.values():
        entry = registry.get(names[0])
        primary = getattr(entry, "__name__", names[0])
        names = sorted(names, key=lambda n: (n != primary, n))
        out.append((names[0], names[1:], entry))
    return sorted(out)


def registries_page() -> str:
    lines = ["# Registries", "",
             "Every name a config can give (a loss, an advantage estimator, a KL estimator, a reward "
             "function, a task, a stage type, ...) is an entry of a registry "
             "(`tether.core.registry.Registry`): trainers look names up there and a wrong name fails with "
             "the list of valid ones. This page is generated from the registries when the site is built: "
             "each entry with its one-line description (its docstring's first paragraph, or a stage type's "
             "description) and the extra inputs it declares (`needs`). Registering a function under a new "
             "name makes it appear here.", ""]
    regs = registries()
    lines += ["| registry | kind | entries | module |", "| --- | --- | --- | --- |"]
    for name, module, registry in regs:
        lines.append(f"| [`{name}`](#{name.lower()}) | {registry.kind} | {len(registry)} | `{module}` |")
    lines.append("")
    for name, module, registry in regs:
        lines += [f"## {name}", "", f"Entries of kind \"{registry.kind}\", in `{module}`.", "",
                  "| name | description | aliases | needs |", "| --- | --- | --- | --- |"]
        for entry_name, aliases, entry in _entries(registry):
            needs = ", ".join(f"`{n}`" for n in sorted(registry.needs(entry_name)))
            alias_text = ", ".join(f"`{a}`" for a in aliases)
            lines.append(f"| `{entry_name}` | {first_line(entry) or '(no description)'} | {alias_text} | {needs} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def undescribed_registry_entries() -> list[str]:
    """``REGISTRY.name`` for every entry without a one-line description (a test keeps this empty)."""
    return [f"{name}.{entry_name}" for name, _, registry in registries()
            for entry_name, _, entry in _entries(registry) if not first_line(entry)]


# ---------------------------------------------------------------- recipes


def recipes_page() -> str:
    from tether.stages.recipes import builtin_recipes, load_recipe

    lines = ["# Built-in recipes", "",
             "Generated from the recipe files (`src/tether/recipes/*.yaml`) when the site is built; "
             "`tether recipes` prints the same list. `tether run NAME` runs one; the measured figures are in "
             "[Results](../results.md) and [Figures over seeds](../figures-over-seeds.md).", "",
             "| recipe | description | stages (name: type) |", "| --- | --- | --- |"]
    for name in sorted(builtin_recipes()):
        recipe = load_recipe(name)
        stages = ", ".join(f"`{s.get('name')}`: {s.get('type')}" for s in recipe["stages"])
        lines.append(f"| `{name}` | {_cell(recipe.get('description', ''))} | {stages} |")
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------- Python API

API_GROUPS: list[tuple[str, Callable[[str, Any], bool]]] = [
    ("One call per stage", lambda name, obj: name.startswith(("train_", "run_", "evaluate", "load_recipe",
                                                               "generate", "self_distill", "ai_labels",
                                                               "filter_", "write_report"))),
    ("Trainers", lambda name, obj: name.endswith("Trainer") or name == "RLBatch"),
    ("Models, scorers, engines and the rest", lambda name, obj: not name.endswith("Config")),
]


def api_page() -> str:
    import tether

    exports = sorted(tether._EXPORTS)
    lines = ["# Python API", "",
             "The public API, `from tether import ...`: one call per stage, the trainers, and the models, "
             "scorers and engines they use. Generated from the docstrings by mkdocstrings when the site is "
             "built. The config classes (`SFTConfig`, `GRPOConfig`, ...) are documented key by key in the "
             "[configuration reference](configuration.md).", ""]
    configs = [n for n in exports if n.endswith("Config") or n in ("RewardSpec", "TaskSource", "TaskSpec")]
    lines += ["Config classes: " + ", ".join(f"[`{n}`](configuration.md#{n.lower()})" for n in configs)
              + ".", ""]
    done = set(configs)
    for title, belongs in API_GROUPS:
        members = [n for n in exports if n not in done and belongs(n, None)]
        if not members:
            continue
        lines += [f"## {title}", ""]
        for name in members:
            done.add(name)
            obj = getattr(tether, name)
            path = f"{obj.__module__}.{getattr(obj, '__qualname__', name)}"
            lines += [f"::: {path}", "    options:", "      heading_level: 3", "      show_root_full_path: false",
                      "      members: false" if inspect.isclass(obj) else "      show_root_toc_entry: true", ""]
    return "\n".join(lines).rstrip() + "\n"


PAGES: dict[str, Callable[[], str]] = {
    "reference/configuration.md": configuration_page,
    "reference/cli.md": cli_page,
    "reference/registries.md": registries_page,
    "reference/recipes.md": recipes_page,
    "reference/api.md": api_page,
}


def write_pages(opener: Callable[[str], Any]) -> None:
    for path, build in PAGES.items():
        with opener(path) as handle:
            handle.write(build())


if __name__ == "__main__" and Path(sys.argv[0]).name == "gen_ref.py":
    out = Path(sys.argv[1])

    def _open(path: str) -> Any:
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        return open(out / path, "w")

    write_pages(_open)
else:
    import mkdocs_gen_files

    write_pages(lambda path: mkdocs_gen_files.open(path, "w"))
    for path in PAGES:
        mkdocs_gen_files.set_edit_path(path, "gen_ref.py")
