"""Every Python block of the README runs as written, in order, in an empty directory, at tiny size.

"At tiny size": before a block runs, its step counts become 2, problem counts at most 40, batch sizes
4, rounds 1, samples per prompt 2 and seed lists two seeds (except on a line the README marks "not
shrunk"); ``load_recipe`` returns the recipe with the same shrinking overrides. Nothing else in a block is changed, so every call, argument and path
the README shows is exercised. The one outside service a block needs, ``tether serve`` at
``127.0.0.1:8000``, is started here on a free port (the block's address is rewritten to it).
"""

import json
import re
from pathlib import Path

import pytest

import tether.stages.recipes as recipes
from tether.serve.process import ServerProcess

README = Path(__file__).resolve().parents[1] / "README.md"
RECIPE_OVERRIDES = ["*.train.max_steps=2", "*.train.batch_size=4", "*.eval.n=8", "*.eval.max_new_tokens=8",
                    "pretrain.data.task.n=32", "sft.data.task.n=32"]
SHRINK = [  # (pattern, replacement) applied to a block's text
    (r'("max_steps":\s*|max_steps=)\d+', r"\g<1>2"),
    (r'"n":\s*(\d+)', lambda m: f'"n": {min(int(m.group(1)), 40)}'),
    (r'("batch_size":\s*|batch_size=)\d+', r"\g<1>4"),
    (r'"rounds":\s*\d+', '"rounds": 1'),
    (r'("samples":\s*|"group_size":\s*)\d+', r"\g<1>2"),
    (r"seeds=\[[^\]]*\]", "seeds=[0, 1]"),
]


def python_blocks() -> list[tuple[int, str]]:
    """(line number, code) of every ```python block, in README order."""
    text = README.read_text()
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


def shrink(code: str) -> str:
    """The block at tiny size; a line the README marks "not shrunk" (a model that must learn something for
    the next call to have data) keeps its sizes."""
    lines = []
    for line in code.splitlines(keepends=True):
        if "not shrunk" not in line:
            for pattern, replacement in SHRINK:
                line = re.sub(pattern, replacement, line)
        lines.append(line)
    return "".join(lines)


def test_the_readme_has_python_blocks_and_shrinking_changes_only_sizes():
    blocks = python_blocks()
    assert len(blocks) >= 10
    assert shrink('train={"max_steps": 300, "batch_size": 32}, seeds=[0, 1, 2], "n": 2000, "n": 8') == \
        'train={"max_steps": 2, "batch_size": 4}, seeds=[0, 1], "n": 40, "n": 8'
    assert shrink('{"max_steps": 300}  # not shrunk\n{"max_steps": 300}\n') == '{"max_steps": 300}  # not shrunk\n{"max_steps": 2}\n'


@pytest.mark.slow
def test_every_python_block_of_the_readme_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MY_KEY", "readme-test-key")
    original = recipes.load_recipe
    monkeypatch.setattr(recipes, "load_recipe",
                        lambda name: recipes.apply_recipe_overrides(original(name), RECIPE_OVERRIDES))
    namespace: dict = {"__name__": "readme"}
    server = None
    try:
        for line, code in python_blocks():
            code = shrink(code)
            if "127.0.0.1:8000" in code:
                server = ServerProcess("runs/sft-arith/sft", api_key_env="MY_KEY", extra_args=["--threads", "1"])
                server.start()
                code = code.replace("http://127.0.0.1:8000", server.base_url.removesuffix("/v1"))
            try:
                exec(compile(code, f"README.md:{line}", "exec"), namespace)
            except Exception as error:
                raise AssertionError(f"the README's Python block at line {line} failed: {error!r}") from error
    finally:
        if server is not None:
            server.stop()
    assert Path("runs/sft-arith/report.html").exists() and Path("runs/seeds/results.json").exists()
    assert json.loads(Path("runs/seeds/results.json").read_text())["sft"]["accuracy"]["n"] == 2
    assert namespace["result"].stdout == "45\n"
