"""Every code block of the README and of the documentation site runs as written, in order, at tiny size.

Which blocks: every ```python and ```bash (``sh``, ``shell``) block of ``README.md`` and then of each page
in the site's navigation (``mkdocs.yml``, in its order), except one whose fence is preceded by an
``<!-- not-runnable: reason -->`` line. They run in one empty directory and the Python blocks in one
namespace, so a later block may use what an earlier one made (``runs/sft-arith/sft``). Shell blocks are
``tether`` command lines, run in-process through the CLI.

"At tiny size": before a block runs, its step counts become 2, problem counts at most 40, batch sizes
4, rounds 1, samples per prompt 2 and seed lists two seeds (except on a line marked "not shrunk"), and a
command's ``--n`` at most 8 and ``--seeds`` two seeds; ``load_recipe`` returns the recipe with every stage
shrunk (2 steps of batch 4, 8 evaluation problems of 8 tokens, task data of 32 problems). Nothing else in
a block is changed, so every call, argument and path the docs show is exercised. The one outside service
a block needs, ``tether serve`` at ``127.0.0.1:8000``, is started here on a free port (the block's
address is rewritten to it). The fast test checks that every block is found and shrinkable and runs the
README's example; the slow one runs them all.
"""

from __future__ import annotations

import json
import re
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

import tether.stages.recipes as recipes

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
LANGUAGES = {"python": "python", "bash": "shell", "sh": "shell", "shell": "shell"}
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[\w-]+)[^\n]*\n(?P<code>.*?)^(?P=indent)```[ ]*$", re.M | re.S)
NOT_RUNNABLE = re.compile(r"^\s*<!--\s*not-runnable\b.*-->\s*$")
SHRINK = [  # (pattern, replacement) applied to a Python block's text
    (r'("max_steps":\s*|max_steps=)\d+', r"\g<1>2"),
    (r'"n":\s*(\d+)', lambda m: f'"n": {min(int(m.group(1)), 40)}'),
    (r'("batch_size":\s*|batch_size=)\d+', r"\g<1>4"),
    (r'"rounds":\s*\d+', '"rounds": 1'),
    (r'("samples":\s*|"group_size":\s*)\d+', r"\g<1>2"),
    (r"seeds=\[[^\]]*\]", "seeds=[0, 1]"),
]
SHELL_SHRINK = [  # (pattern, replacement) applied to a command line
    (r"(--n[ =])(\d+)", lambda m: f"{m.group(1)}{min(int(m.group(2)), 8)}"),
    (r"(--seeds[ =])\S+", r"\g<1>0,1"),
    (r"(max_steps=)\d+", r"\g<1>2"),
]


@dataclass
class Block:
    file: str
    line: int
    lang: str  # "python" or "shell"
    code: str
    runnable: bool

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def doc_files() -> list[Path]:
    """The README, then every page of the site's navigation that is a file in docs/ (generated pages are not)."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[0] + "\n") or {}
    assert config.get("docs_dir", "docs") == "docs"
    nav = yaml.safe_load("nav:" + (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1])["nav"]
    pages: list[str] = []

    def walk(item: Any) -> None:
        if isinstance(item, str):
            pages.append(item)
        elif isinstance(item, dict):
            for value in item.values():
                walk(value)
        elif isinstance(item, list):
            for value in item:
                walk(value)

    walk(nav)
    return [README] + [DOCS / page for page in pages if (DOCS / page).is_file()]


def blocks_of(path: Path) -> list[Block]:
    text = path.read_text()
    lines = text.splitlines()
    out = []
    for match in FENCE.finditer(text):
        lang = LANGUAGES.get(match.group("lang"))
        if lang is None:
            continue
        line = text[: match.start()].count("\n")  # 0-based index of the fence line
        before = next((lines[i] for i in range(line - 1, -1, -1) if lines[i].strip()), "")
        code = textwrap.dedent(match.group("code"))
        out.append(Block(str(path.relative_to(ROOT)), line + 2, lang, code, not NOT_RUNNABLE.match(before)))
    return out


def all_blocks() -> list[Block]:
    return [block for path in doc_files() for block in blocks_of(path)]


def shrink(code: str) -> str:
    """A Python block at tiny size; a line marked "not shrunk" (a model that must learn something for the
    next call to have data) keeps its sizes."""
    lines = []
    for line in code.splitlines(keepends=True):
        if "not shrunk" not in line:
            for pattern, replacement in SHRINK:
                line = re.sub(pattern, replacement, line)
        lines.append(line)
    return "".join(lines)


def shell_commands(code: str) -> list[list[str]]:
    """The argument lists of a shell block's commands (comments dropped, continuations joined), shrunk."""
    commands, pending = [], ""
    for raw in code.splitlines():
        line = pending + raw
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        words = shlex.split(line, comments=True)
        if words:
            command = " ".join(shlex.quote(w) for w in words)
            for pattern, replacement in SHELL_SHRINK:
                command = re.sub(pattern, replacement, command)
            commands.append(shlex.split(command))
    return commands


def shrink_recipe(recipe: dict[str, Any]) -> dict[str, Any]:
    """Every stage of ``recipe`` at tiny size: 2 training steps of batch 4, 8 evaluation problems of at most 8
    new tokens, task data of 32 problems (only keys the stage's config class has)."""
    from tether.stages.registry import STAGE_TYPES

    overrides = []
    for stage in recipe["stages"]:
        name, fields = stage["name"], STAGE_TYPES.get(stage["type"]).config_class.model_fields
        for block, keys in (("train", {"max_steps": 2, "batch_size": 4}), ("eval", {"n": 8, "max_new_tokens": 8})):
            if block in fields:
                block_fields = getattr(fields[block].annotation, "model_fields", {})
                overrides += [f"{name}.{block}.{k}={v}" for k, v in keys.items() if k in block_fields]
        data = stage.get("data")
        if isinstance(data, dict) and isinstance(data.get("task"), dict):
            overrides.append(f"{name}.data.task.n=32")
    return recipes.apply_recipe_overrides(recipe, overrides)


def test_the_docs_have_runnable_blocks_every_one_parses_and_shrinking_changes_only_sizes():
    blocks = all_blocks()
    runnable = [b for b in blocks if b.runnable]
    assert len([b for b in runnable if b.lang == "python"]) >= 15
    assert any(b.file == "README.md" and b.runnable and b.lang == "python" for b in blocks)
    assert any(b.lang == "shell" and b.runnable for b in blocks)
    for block in runnable:
        if block.lang == "python":
            compile(shrink(block.code), block.where, "exec")  # a SyntaxError names the block
        else:
            commands = shell_commands(block.code)
            assert commands and all(c[0] == "tether" for c in commands), f"{block.where}: not a tether command"
    assert shrink('train={"max_steps": 300, "batch_size": 32}, seeds=[0, 1, 2], "n": 2000, "n": 8') == \
        'train={"max_steps": 2, "batch_size": 4}, seeds=[0, 1], "n": 40, "n": 8'
    assert shrink('{"max_steps": 300}  # not shrunk\n{"max_steps": 300}\n') == '{"max_steps": 300}  # not shrunk\n{"max_steps": 2}\n'
    assert shell_commands("tether eval --n 200 -k 4   # a comment\ntether run x \\\n  --seeds 5 'a.b=c d' s.train.max_steps=50\n") == [
        ["tether", "eval", "--n", "8", "-k", "4"], ["tether", "run", "x", "--seeds", "0,1", "a.b=c d", "s.train.max_steps=2"]]


def test_not_runnable_blocks_say_why():
    for path in doc_files():
        for line in path.read_text().splitlines():
            if NOT_RUNNABLE.match(line):
                assert re.search(r"not-runnable:\s*\S", line), f"{path.name}: {line.strip()} gives no reason"


def test_every_recipe_shrinks_to_a_valid_tiny_recipe():
    from tether.stages.pipeline import validate_recipe

    for name in sorted(recipes.builtin_recipes()):
        recipe = shrink_recipe(recipes.load_recipe(name))
        validate_recipe(recipe)
        for stage in recipe["stages"]:
            assert stage.get("train", {}).get("max_steps", 2) == 2


def run_python(block: Block, namespace: dict[str, Any], server_holder: list) -> None:
    from tether.serve.process import ServerProcess

    code = shrink(block.code)
    if "127.0.0.1:8000" in code:
        if not server_holder:
            server = ServerProcess("runs/sft-arith/sft", api_key_env="MY_KEY", extra_args=["--threads", "1"])
            server.start()
            server_holder.append(server)
        code = code.replace("http://127.0.0.1:8000", server_holder[0].base_url.removesuffix("/v1"))
    try:
        exec(compile(code, block.where, "exec"), namespace)
    except Exception as error:
        raise AssertionError(f"the Python block at {block.where} failed: {error!r}") from error


def run_shell(block: Block) -> None:
    from typer.testing import CliRunner

    from tether.cli import app

    for command in shell_commands(block.code):
        result = CliRunner().invoke(app, command[1:], catch_exceptions=False)
        assert result.exit_code == 0, f"{block.where}: `{shlex.join(command)}` exited {result.exit_code}:\n{result.output}"


@pytest.fixture
def tiny_recipes(monkeypatch):
    original = recipes.load_recipe
    monkeypatch.setattr(recipes, "load_recipe", lambda name: shrink_recipe(original(name)))


def test_the_readme_example_runs(tmp_path, monkeypatch, tiny_recipes):
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "docs"}
    example = next(b for b in blocks_of(README) if b.runnable and b.lang == "python")
    run_python(example, namespace, [])
    assert 0.0 <= namespace["figures"]["accuracy"] <= 1.0 and Path("runs/readme/sft").is_dir()


@pytest.mark.slow
def test_every_runnable_block_of_the_docs_runs_as_written(tmp_path, monkeypatch, tiny_recipes):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MY_KEY", "readme-test-key")
    namespace: dict[str, Any] = {"__name__": "docs"}
    servers: list = []
    ran = []
    try:
        for block in all_blocks():
            if not block.runnable:
                continue
            run_python(block, namespace, servers) if block.lang == "python" else run_shell(block)
            ran.append(block.where)
    finally:
        for server in servers:
            server.stop()
    assert Path("runs/sft-arith/report.html").exists() and Path("runs/seeds/results.json").exists()
    assert json.loads(Path("runs/seeds/results.json").read_text())["sft"]["accuracy"]["n"] == 2
    assert namespace["result"].stdout == "45\n"
    assert len(ran) == len([b for b in all_blocks() if b.runnable])
