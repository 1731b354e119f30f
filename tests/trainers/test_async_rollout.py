"""Asynchronous RL: a producer process samples K versions behind; the run is bitwise a function of its seed,
its staleness is exactly the schedule's, and the reward still rises. (SIGKILL and resume: the reliability
harness's ``async_grpo`` family.)"""

import sys
from pathlib import Path

import pytest
import torch

from tether.config.agent import AgentConfig
from tether.config.rl import GRPOConfig, PPOConfig
from tether.models import build_tiny
from tether.trainers.rl import RLTrainer

sys.path.insert(0, str(Path(__file__).parent))


def digit_fraction(prompts, completions, **columns):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def config(k, steps=8, **extra):
    return GRPOConfig(name="rl", algorithm="grpo", data={"task": {"name": "arithmetic", "n": 64}},
                      rollout={"group_size": 4, "max_new_tokens": 12},
                      train={"max_steps": steps, "batch_size": 8, "log_every": 1, "progress": False},
                      optim={"lr": 1e-2, "schedule": "constant"}, report_to=[],
                      rollout_correction={"mode": "tis"}, **{"async": {"max_staleness": k}}, **extra)


def train(trainer, steps):
    """``steps`` training steps; the trainer and each step's metrics."""
    metrics = []
    for _ in range(steps):
        metrics.append(trainer.training_step())
        trainer.step += 1
    return trainer, metrics


def run(tmp_path, k, steps=8):
    model, tokenizer = build_tiny("tiny", seed=0)
    return train(RLTrainer(config(k, steps), model, tokenizer, tmp_path, reward_functions=[digit_fraction]), steps)


def test_staleness_one_is_bitwise_reproducible_and_still_learns(tmp_path):
    a, metrics = run(tmp_path / "a", 1)
    b, metrics_b = run(tmp_path / "b", 1)
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values(),
                                                  strict=True))
    assert [m["reward/mean"] for m in metrics] == [m["reward/mean"] for m in metrics_b]
    assert [m["async/staleness_max"] for m in metrics] == [0.0] + [1.0] * 7
    rewards = [float(m["reward/mean"]) for m in metrics]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.1, rewards
    assert all(0.0 <= m["async/training_busy"] <= 1.0 for m in metrics[1:])
    assert not a.async_rollouts.process.is_alive()  # stopped after the last step


@pytest.mark.slow
def test_staleness_two_follows_the_schedule_and_differs_from_the_synchronous_run(tmp_path):
    _, metrics = run(tmp_path / "k2", 2, steps=5)
    assert [m["async/staleness_mean"] for m in metrics] == [0.0, 1.0, 2.0, 2.0, 2.0]
    _, sync = run(tmp_path / "k0", 0, steps=5)
    assert "async/staleness_mean" not in sync[0]
    assert [m["reward/mean"] for m in sync][:1] == [m["reward/mean"] for m in metrics][:1]  # step 0: version 0
    assert [m["reward/mean"] for m in sync] != [m["reward/mean"] for m in metrics]


@pytest.mark.slow
def test_ppo_with_a_critic_runs_async_and_reproducibly(tmp_path):
    from tether.trainers.ppo import PPOTrainer

    def ppo(run_dir):
        cfg = PPOConfig(name="ppo", data={"task": {"name": "arithmetic", "n": 64}}, rollout={"max_new_tokens": 10},
                        kl={"coef": 0.0}, critic={"init": "policy", "lr": 3e-3}, ppo_epochs=2, row_tokens=64,
                        train={"max_steps": 4, "batch_size": 8, "log_every": 1, "progress": False},
                        optim={"lr": 1e-2, "schedule": "constant"}, report_to=[], rollout_correction={"mode": "tis"},
                        **{"async": {"max_staleness": 1}})
        model, tokenizer = build_tiny("tiny", seed=0)
        return train(PPOTrainer(cfg, model, tokenizer, run_dir, reward_functions=[digit_fraction]), 4)

    a, metrics = ppo(tmp_path / "a")
    b, _ = ppo(tmp_path / "b")
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values(),
                                                  strict=True))
    assert [m["async/staleness_max"] for m in metrics] == [0.0, 1.0, 1.0, 1.0] and "value/loss" in metrics[-1]


def test_what_async_does_not_support_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"rollout_correction\.mode"):
        GRPOConfig(**{"async": {"max_staleness": 1}})
    with pytest.raises(ValueError, match="dynamic sampling"):
        config(1, dynamic_sampling={"enabled": True})
    with pytest.raises(ValueError, match=r"rollout_correction\.mode"):
        AgentConfig(**{"async": {"max_staleness": 1}})
    assert AgentConfig(rollout_correction={"mode": "tis"}, **{"async": {"max_staleness": 1}}).async_rollout.max_staleness


def test_agent_episodes_run_in_the_producer_reproducibly_and_on_schedule(tmp_path):
    """The whole multi-turn loop (turns, calculator calls, observations) runs in the producer one version
    behind: two runs are bitwise equal, step 0 (version 0) equals the synchronous run's, later steps differ
    from it, and the sampler's log-probs reach the correction (NaN only on observation tokens)."""
    from test_agent import config as agent_config
    from test_agent import trainer as agent_trainer

    def agent(run_dir, k):
        cfg = agent_config(rollout_correction={"mode": "tis"}, **{"async": {"max_staleness": k}},
                           train={"max_steps": 4, "batch_size": 4, "log_every": 1, "progress": False})
        t = agent_trainer(run_dir, cfg)
        batches, collect = [], t.collect
        t.collect = lambda: batches.append(collect()) or batches[-1]
        return (*train(t, 4), batches)

    a, metrics, batches = agent(tmp_path / "a", 1)
    b, metrics_b, _ = agent(tmp_path / "b", 1)
    _, sync, _ = agent(tmp_path / "sync", 0)
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values(),
                                                  strict=True))
    assert [m["reward/mean"] for m in metrics] == [m["reward/mean"] for m in metrics_b]
    assert [m["async/staleness_max"] for m in metrics] == [0.0, 1.0, 1.0, 1.0]
    assert metrics[0]["reward/mean"] == sync[0]["reward/mean"] and metrics[0]["agent/turns"] == \
        sync[0]["agent/turns"]
    assert [m["reward/mean"] for m in metrics[1:]] != [m["reward/mean"] for m in sync[1:]]
    rollout = batches[-1].rollout
    for logprobs, mask in zip(rollout.completion_logprobs, rollout.action_masks, strict=True):
        assert all((lp == lp) == bool(m) for lp, m in zip(logprobs, mask, strict=True))  # NaN off the actions
    assert float(metrics[-1]["mismatch/frac_tokens_corrected"]) >= 0.0
    assert not a.async_rollouts.process.is_alive()


@pytest.mark.slow
def test_a_ray_producer_samples_with_the_version_it_holds(tmp_path):
    """``rollout.engine: ray`` under async: the producer drives Ray workers that take its copy of the weights
    (version v(s)) before each batch; the run is reproducible and equals the in-process producer's."""
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'tether[ray]'")

    def ray_run(run_dir, engine):
        cfg = config(1, steps=3, model={"name_or_path": "tether/tiny", "seed": 0})
        cfg.rollout.engine, cfg.rollout.workers = engine, 1
        model, tokenizer = build_tiny("tiny", seed=0)
        trainer, metrics = train(RLTrainer(cfg, model, tokenizer, run_dir, reward_functions=[digit_fraction]), 3)
        return trainer, [m["reward/mean"] for m in metrics]

    a, rewards = ray_run(tmp_path / "a", "ray")
    b, rewards_b = ray_run(tmp_path / "b", "ray")
    _, local = ray_run(tmp_path / "hf", "hf")
    assert rewards == rewards_b == local
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values(),
                                                  strict=True))
