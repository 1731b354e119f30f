"""The code verifier: hidden unit tests in the sandbox, robust to programs that crash, loop, exit or lie."""

import json

import pytest

from tether.rewards.code import code_tests_reward
from tether.runtime.sandbox import run_tests
from tether.tasks.code import extract_code

TESTS = ["assert f(1) == 2", "assert f(5) == 6", "assert f(-1) == 0"]


def test_extract_code():
    assert extract_code("<think>hmm</think>def f(x): return x") == "def f(x): return x"
    assert extract_code("Here:\n```python\ndef f(x):\n    return 1\n```\nand\n```\nprint(2)\n```") == "print(2)\n"


@pytest.mark.parametrize(("code", "passed"), [
    ("def f(x):\n    return x + 1", 3),
    ("def f(x):\n    return x + 1 if x > 0 else 7", 2),
    ("def f(x): return x +", 0),                               # syntax error
    ("import os\nos._exit(0)", 0),                              # leaves before the tests run
    ("print('\\nabc 3 3')\ndef f(x): return 100", 0),            # prints a fake summary
    ("while True: pass", 0),                                    # loops until the CPU limit
    ("import sys\nsys.stdout.write('x' * 10**6)\ndef f(x): return x + 1", 0),  # floods its output
])
def test_run_tests_counts_only_real_passes(code, passed):
    got, result = run_tests(code, TESTS, limits={"cpu_s": 1, "wall_s": 2, "output_bytes": 10_000})
    assert got == passed, result


def test_code_tests_reward_partial_and_all_or_nothing():
    completions = ["def f(x): return x + 1", "def f(x): return 2", "def f(x): return x + 1"]
    tests = [TESTS, TESTS, None]
    assert code_tests_reward(["p"] * 3, completions, tests=tests) == [1.0, pytest.approx(1 / 3), None]
    assert code_tests_reward(["p"] * 2, completions[:2], answer=[json.dumps(TESTS)] * 2, partial=False) == [1.0, 0.0]
    with pytest.raises(ValueError, match="tests"):
        code_tests_reward(["p"], ["x"])


def test_code_task_verifies_with_hidden_tests_and_demonstrates_its_solution():
    import random

    from tether.tasks import get_task, rl_records, sft_records

    task = get_task("code", families=["add", "gt"])
    problem = task.sample(random.Random(3))
    assert "assert" not in problem.prompt and task.verify(problem.solution, problem.answer) == 1.0
    assert task.verify("def f(x): return None", problem.answer) == 0.0
    sft = sft_records(task, 4, think=False)
    assert all(r["completion"].startswith("def f(x):") for r in sft)
    assert json.loads(rl_records(task, 1)[0]["answer"])[0].startswith("assert f(")


def test_code_tests_reward_in_grpo(tmp_path):
    """Loop 5: the code verifier as the reward of the plain GRPO trainer."""
    from tether.config.rl import GRPOConfig
    from tether.models import build_tiny
    from tether.trainers.rl import RLTrainer

    cfg = GRPOConfig(name="rl", data={"task": {"name": "code", "n": 8}}, rollout={"group_size": 2, "max_new_tokens": 8},
                     rewards=[{"name": "code_tests"}], train={"max_steps": 1, "batch_size": 2, "progress": False},
                     report_to=[])
    model, tokenizer = build_tiny()
    metrics = RLTrainer(cfg, model, tokenizer, tmp_path).training_step()
    assert metrics["reward/code_tests/mean"] == 0.0 and metrics["reward/code_tests/none"] == 0.0
