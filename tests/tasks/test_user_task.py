"""A user's own task by import path (``package.module:factory``) is built, trained on and evaluated exactly as
a built-in task is; an unknown or broken one fails before any stage trains."""

import textwrap

import pytest

from tether.config.base import ConfigError
from tether.stages.pipeline import run_recipe, validate_recipe
from tether.tasks import get_task

MODULE = '''
from tether.tasks.base import Problem


class Doubling:
    """'n*2=' -> 2n."""

    name = "doubling"

    def __init__(self, top=50):
        self.top = top

    def sample(self, rng):
        n = rng.randint(0, self.top)
        return Problem(prompt=f"{n}*2=", answer=str(2 * n), reasoning=f"{n}+{n}")

    def verify(self, completion, answer):
        return float(completion.strip() == answer)

    def pretrain_text(self, problem):
        return problem.prompt + problem.answer


def make(top=50):
    return Doubling(top)


def broken():
    return object()
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_tasks:make"


def test_a_user_task_trains_and_is_evaluated_like_a_built_in(tmp_path, user_module):
    task = get_task(user_module, top=20)
    assert task.name == "doubling" and task.top == 20
    recipe = {"name": "user", "defaults": {"train": {"threads": 1, "progress": False}, "report_to": []}, "stages": [
        {"name": "sft", "type": "sft", "model": {"name_or_path": "tether/tiny"},
         "data": {"task": {"name": user_module, "options": {"top": 400}, "n": 64, "think": False}},
         "train": {"max_steps": 2, "batch_size": 8},
         "eval": {"task": user_module, "options": {"top": 400}, "n": 8, "max_new_tokens": 6}}]}
    results = run_recipe(recipe, tmp_path / "run", report=False)
    assert 0.0 <= results["sft"]["accuracy"] <= 1.0 and results["sft"]["n"] == 8


def test_unknown_and_broken_tasks_fail_before_training(tmp_path, user_module):
    stage = {"name": "sft", "type": "sft", "model": {"name_or_path": "tether/tiny"},
             "data": {"task": {"name": "arithmetic", "n": 8}}}
    for task, message in (("arithmetik", "unknown task 'arithmetik'"), ("my_tasks:nope", "no attribute 'nope'"),
                          ("my_tasks:broken", "without name, sample, verify, pretrain_text")):
        with pytest.raises(ConfigError, match=message):
            validate_recipe({"name": "x", "stages": [{**stage, "eval": {"task": task}}]}, tmp_path)
    with pytest.raises(ConfigError, match="unknown reward function"):
        validate_recipe({"name": "x", "stages": [{**stage, "type": "grpo", "rewards": [{"name": "acuracy"}]}]},
                        tmp_path)
