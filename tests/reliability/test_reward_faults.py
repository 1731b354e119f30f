"""Reward functions that misbehave inside a real GRPO step: NaN, inf, None and exceptions are handled as
configured (``reward_on_error``), counted in the logged metrics, and never reach the weights."""

import math

import pytest
import torch

from tether.config.rl import GRPOConfig
from tether.models import build_tiny
from tether.rewards import RewardFunctionError
from tether.trainers.rl import RLTrainer

torch.set_num_threads(1)


def config(**overrides):
    return GRPOConfig(**{"name": "rl", "algorithm": "grpo", "data": {"task": {"name": "arithmetic", "n": 16}},
                         "rollout": {"group_size": 4, "max_new_tokens": 8},
                         "train": {"max_steps": 2, "batch_size": 4, "log_every": 1, "progress": False},
                         "optim": {"lr": 1e-2, "schedule": "constant"}, "report_to": [], **overrides})


def unreliable(prompts, completions, **columns):
    """Every fourth sample NaN, every fourth None, every fourth inf; raises on completions with a '7'."""
    if any("7" in c for c in completions):
        raise ConnectionError("judge endpoint reset the connection")
    return [[math.nan, None, math.inf, len(c) / 8][i % 4] for i, c in enumerate(completions)]


def test_nan_none_inf_and_errors_are_counted_and_skipped(tmp_path):
    model, tokenizer = build_tiny("tiny", seed=0)
    trainer = RLTrainer(config(reward_on_error="zero"), model, tokenizer, tmp_path,
                        reward_functions=[unreliable, lambda p, c, **k: [1.0] * len(c)])
    metrics = [trainer.training_step() for _ in range(2)]
    for m in metrics:
        assert m["reward/unreliable/nonfinite"] + m["reward/unreliable/errors"] > 0
        assert m["reward/unreliable/none"] >= m["reward/unreliable/nonfinite"]
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_on_error_raise_names_the_function_and_the_sample(tmp_path):
    model, tokenizer = build_tiny("tiny", seed=0)

    def broken(prompts, completions, **columns):
        raise ValueError("malformed JSON from the judge")

    trainer = RLTrainer(config(), model, tokenizer, tmp_path, reward_functions=[broken])
    with pytest.raises(RewardFunctionError, match=r"reward function 'broken' raised ValueError: malformed JSON"):
        trainer.training_step()
