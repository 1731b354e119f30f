"""The shape of the code, read from the source: no import cycle, trainers that stay thin, no long files.

The import graph here is built from the source with ``ast`` (every ``import`` statement, at module level
or inside a function), independently of import-linter, which checks the layer order in CI
(``lint-imports``, contracts in pyproject.toml).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tether"
TRAINER_BASE = {"loop", "optimization", "checkpoint", "distributed", "metrics", "parallel", "rl", "rollout_consistency", "entropy_control",
                "critic", "process_supervision", "turn_reference", "distillation", "rl_report", "async_rollout",
                "step_draws"}
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = ["tether", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The tether modules ``path`` imports: ``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "tether")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] != "tether":
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
    return {m for m in out if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(path, set(found)) for name, path in found.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the graph's strongly connected components."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in graph:
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert sorted(map(sorted, strongly_connected(graph))) == [["a", "b", "c"], ["d"], ["e"]]


def test_no_import_cycle_anywhere():
    cycles = [c for c in strongly_connected(import_graph()) if len(c) > 1]
    assert cycles == []


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    assert "tether.stages.pipeline" in graph["tether.cli"]  # imported inside the command functions only


def test_trainers_import_only_the_shared_base():
    """A trainer module imports no stage glue, no recipe runner and no sibling trainer except the shared base."""
    graph = import_graph()
    for name, deps in graph.items():
        if not name.startswith("tether.trainers."):
            continue
        for dep in deps:
            assert not dep.startswith(("tether.stages", "tether.cli")), (name, dep)
            if dep.startswith("tether.trainers."):
                assert dep.rsplit(".", 1)[1] in TRAINER_BASE, (name, dep)


def test_core_imports_nothing_of_tether_outside_core():
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("tether.core"):
            assert all(d.startswith("tether.core") for d in deps), (name, deps)


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_no_file_over_500_lines(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES
