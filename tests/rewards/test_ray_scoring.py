"""Reward scoring on Ray actors (a local Ray instance with 2 CPUs): the same rewards as in process."""

from __future__ import annotations

import pytest
import torch

from tether.rewards import RewardComposer, RewardFunctionError, RewardSpec
from tether.rewards.ray_scoring import RayRewardComposer, shards

PROMPTS = [f"{a}+{b}=" for a, b in [(12, 30), (7, 5), (40, 2), (9, 9), (1, 1), (3, 4), (20, 22), (5, 0), (8, 8),
                                     (6, 7), (11, 11)]]
ANSWERS = ["42", "12", "42", "18", "2", "7", "42", "5", "16", "13", "22"]
COMPLETIONS = ["<think>2+0=2</think>42", "12", "<think>x</think>41", "<think></think>18", "two", "<think>7</think>7",
               "42!", "", "<think>8+8=16</think>16", "13 ", "<think>?</think>"]


def specs():
    return [
        {"name": "exact_match", "weight": 1.0},
        {"name": "format", "weight": 0.2},
        {"name": "length", "weight": 0.01, "kwargs": {"target": 5}},
        # a plain callable: None for some samples, non-finite for one, raising on one (scored 0 under "zero")
        RewardSpec(lambda p, c, **k: [None if "?" in s else (float("nan") if s == "12" else len(s) % 3)
                                      for s in c] if "two" not in c else 1 / 0, weight=2.0),
    ]


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'tether[ray]'")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_rewards_equal_the_in_process_rewards(local_ray):
    columns = {"answer": ANSWERS}
    expected = RewardComposer(specs(), on_error="zero").score(PROMPTS, COMPLETIONS, columns)
    composer = RayRewardComposer(specs(), on_error="zero", num_workers=2)
    try:
        got = composer.score(PROMPTS, COMPLETIONS, columns)
    finally:
        composer.close()
    torch.testing.assert_close(got.total, expected.total, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(got.valid, expected.valid)
    assert got.per_function.keys() == expected.per_function.keys()
    for label, values in expected.per_function.items():
        torch.testing.assert_close(got.per_function[label], values, equal_nan=True, rtol=0, atol=0)
    assert got.errors == expected.errors and got.errors["<lambda>"] == 1
    assert got.nonfinite == expected.nonfinite and got.nonfinite["<lambda>"] == 1
    assert got.metrics() == pytest.approx(expected.metrics(), nan_ok=True)


@pytest.mark.slow
def test_a_raising_reward_names_the_sample_of_the_whole_batch(local_ray):
    composer = RayRewardComposer(specs(), on_error="raise", num_workers=2)
    try:
        with pytest.raises(RewardFunctionError) as info:
            composer.score(PROMPTS, COMPLETIONS, {"answer": ANSWERS})
    finally:
        composer.close()
    assert info.value.function == "<lambda>" and info.value.index == COMPLETIONS.index("two")


def test_shards_cover_the_batch_in_order():
    assert shards(11, 2) == [(0, 6), (6, 11)]
    assert shards(2, 4) == [(0, 1), (1, 2)]
    assert shards(5, 1) == [(0, 5)]


@pytest.mark.slow
def test_grpo_with_ray_reward_workers_logs_the_in_process_rewards(local_ray, tmp_path):
    from tether.config.rl import GRPOConfig
    from tether.models import build_tiny
    from tether.trainers.rl import RLTrainer

    def rewards(workers: int) -> list[float]:
        model, tokenizer = build_tiny("tiny", seed=0)
        cfg = GRPOConfig(data={"task": {"name": "arithmetic", "n": 16}}, rollout={"group_size": 4, "max_new_tokens": 8},
                         rewards=[{"name": "accuracy", "kwargs": {"task": "arithmetic"}}, {"name": "format"},
                                  {"name": "length", "weight": 0.1, "kwargs": {"target": 4}}],
                         reward_workers=workers, train={"max_steps": 2, "batch_size": 2, "progress": False},
                         report_to=[])
        trainer = RLTrainer(cfg, model, tokenizer, tmp_path / str(workers))
        out = []
        for _ in range(2):
            out.append(trainer.training_step()["reward/total/mean"])
            trainer.step += 1
        return out

    assert rewards(2) == rewards(0)
