"""Agentic tool-use RL: GRPO-family (or PPO) updates on multi-turn trajectories.

A step of :class:`AgentRLTrainer` reads exactly like :class:`~tether.trainers.rl.RLTrainer`'s
(generate -> score -> advantage -> clipped policy gradient) with one change: ``collect`` runs the
multi-turn loop of :mod:`tether.rollout.agent` instead of one ``generate`` call. The trajectory
becomes the "completion" of an :class:`~tether.rollout.agent.AgentRollout`, whose completion mask
is 0 on observation tokens, so the policy loss, the KL term (in the loss or in the reward), the
entropy term, the old- and reference-policy log-probs used by them, and the advantages all act on
the policy's own tokens only. The reward is the environment's verifier (the ``trajectory`` reward
function), plus any other reward function of the final answer.

PPO with a critic (``algorithm: ppo``, or ``critic`` with ``advantage: gae``): the critic is built and
trained as in the ``ppo`` stage (:mod:`tether.trainers.critic`, ``critic.warmup_steps`` included) and
reads the whole episode in one forward pass, but only the action tokens' values are used: the
registry ``gae`` estimator takes the completion mask, so its recursion steps over the policy's tokens
alone, the episode's action tokens concatenated. gamma and lambda apply per action token, and an
observation between two turns is skipped (V_{t+1} and A_{t+1} carried across it, no discount for
its length): the environment's reply is a transition, not a step of the policy. The outcome reward
lands on the last action token, the KL (in the reward) on every action token; observation tokens get
advantage 0, return 0 and no value-loss term. Per-turn ``step_rewards`` are not used (as critic-free).

Asynchronous (``async: {max_staleness: K}``, :mod:`tether.trainers.async_rollout`): the producer process
runs the whole multi-turn loop (:class:`EpisodeSampler`: its own engine, environments and tools) with the
policy K versions behind and sends back the finished trajectories, which carry the sampler's log-probs
of the policy's tokens (NaN on observation tokens, which no correction reads).

Optional GiGPO (Feng et al. 2025; ``gigpo: {weight, gamma}``): a step-level advantage from
anchor-state groups is added, per turn, to GRPO's episode-level one (see :mod:`tether.core.gigpo`).

The SFT warm-up on scripted demonstrations is the ``agent_sft`` stage: the SFT trainer on
:func:`tether.rollout.agent.demonstration_records`, evaluated by :func:`tether.evaluation.evaluate_agent`.

How it departs from the papers: ReAct (Yao et al. 2023) prompts a frozen model with few-shot
traces; here the format is taught by SFT and then optimised by RL, as in agentic RL since. Turns
are chat messages ended by the end-of-turn token rather than one text with ``Observation:`` stops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tether.config.agent import AgentConfig, AgentLoopConfig, EnvironmentConfig, GiGPOConfig
from tether.core.advantages import AdvantageOutputs
from tether.core.gigpo import discounted_step_returns, step_group_advantages
from tether.data.sources import record_columns
from tether.evaluation import evaluate_agent
from tether.rollout import SamplingParams
from tether.rollout.agent import (
    AgentLoop,
    AgentRollout,
    Trajectory,
    environment_renderer,
    trajectory_metrics,
    trajectory_texts,
)
from tether.rollout.environment import environment_records
from tether.trainers.async_rollout import EngineSampler
from tether.trainers.rl import RLBatch, RLTrainer


class AgentRLTrainer(RLTrainer):
    """:class:`RLTrainer` whose ``collect`` runs multi-turn episodes; see the module docstring."""

    config: AgentConfig

    def __init__(self, config: AgentConfig, model: torch.nn.Module, tokenizer: Any, run_dir: str | Path, *,
                 records: list[dict] | None = None, reward_functions: list | None = None,
                 stage: str | None = None) -> None:
        records = records if records is not None else environment_records(config.environment, split="train")
        super().__init__(config, model, tokenizer, run_dir, records=records, reward_functions=reward_functions,
                         stage=stage)
        self.loop = self.async_sampler().loop(self.engine, tokenizer)

    def collect(self) -> RLBatch:
        if not self.config.async_rollout.max_staleness:  # RLTrainer's rounds (dynamic sampling) of sample_round
            return super().collect()
        indices, trajectories, figures = self.async_take()  # run ahead by the producer process
        rollout, rewards, metrics = self.episodes(indices, trajectories)
        return RLBatch(indices, rollout, rewards, {**metrics, **figures})

    def sample_round(self, indices: list[int], round_index: int) -> tuple[AgentRollout, torch.Tensor, dict[str, float]]:
        """One round of episodes of ``indices``' tasks, scored, with the ``agent/*`` figures."""
        return self.episodes(indices, self.loop.run(self.sampling_request(indices), self.sampling_params(round_index)))

    def greedy_rewards(self, indices: list[int]) -> torch.Tensor:
        """ReMax's baseline for episodes: one greedy episode per task, scored as the sampled ones are."""
        return self.episodes(indices, self.loop.run(self.sampling_request(indices), SamplingParams(greedy=True)))[1]

    def episodes(self, indices: list[int], trajectories: list[Trajectory]
                 ) -> tuple[AgentRollout, torch.Tensor, dict[str, float]]:
        rollout = AgentRollout.from_trajectories(trajectories, trajectory_texts(trajectories, self.tokenizer))
        rewards, metrics = self.score(indices, rollout)
        metrics.update({f"agent/{k}": v for k, v in
                        trajectory_metrics(trajectories, self.config.agent.success_threshold).items()})
        return rollout, rewards, metrics

    def async_sampler(self) -> EpisodeSampler:
        return EpisodeSampler(self.config.environment, self.config.agent, EngineSampler.of(self.config))

    def sampling_request(self, indices: list[int]) -> list[dict]:
        """The episodes' tasks (the sampler's payload)."""
        return [self.records[i] for i in indices]

    def score(self, indices: list[int], rollout: AgentRollout) -> tuple[torch.Tensor, dict[str, float]]:
        """The reward functions on the final answers, with the trajectories as the ``trajectory`` column; with
        ``overlong``, DAPO's length term on the episode's tokens (generated and observation) against
        ``agent.max_tokens``, the budget that cuts an episode."""
        records = [t.task for t in rollout.trajectories]
        columns = record_columns(records, exclude=("prompt", "plan", "solution"))
        columns["trajectory"] = rollout.trajectories
        result = self.rewards.score([r["prompt"] for r in records],
                                    [t.answer or "" for t in rollout.trajectories], columns)
        return self.with_overlong(self.combine(result), rollout), result.metrics()

    def advantages(self, batch: RLBatch) -> AdvantageOutputs:
        out = super().advantages(batch)
        if self.config.gigpo is not None:
            mask = batch.mask
            step = gigpo_token_advantages(batch.rollout.trajectories, batch.rewards.cpu(),
                                          self.config.rollout.group_size, mask.shape[1],
                                          self.config.gigpo).to(mask.device)
            out.advantages = out.advantages + self.config.gigpo.weight * step * (mask != 0)
        return out

    def evaluate(self) -> dict[str, float]:
        if self.config.eval is None:
            return {}
        return evaluate_agent(self.policy, self.tokenizer, self.config.environment, self.config.agent,
                              self.config.eval, progress=self.config.train.progress and self.dist.is_main,
                              label=f"{self.stage} eval")


@dataclass(frozen=True)
class EpisodeSampler:
    """The asynchronous producer's sampler for agents: the multi-turn loop over a request's tasks, with its
    own environments and the stage's engine (:class:`~tether.trainers.async_rollout.Sampler`)."""

    environment: EnvironmentConfig
    agent: AgentLoopConfig
    engine: EngineSampler

    def loop(self, engine: Any, tokenizer: Any) -> AgentLoop:
        """The multi-turn loop on ``engine``, with fresh environments of the stage's (the trainer's own loop too)."""
        make_env, renderer = environment_renderer(self.environment, tokenizer)
        return AgentLoop(engine, tokenizer, make_env, renderer, self.agent)

    def build(self, model: torch.nn.Module, tokenizer: Any) -> Callable[[list[dict], Any], list[Trajectory]]:
        return self.loop(self.engine.build_engine(model, tokenizer), tokenizer).run


def gigpo_token_advantages(trajectories: list[Trajectory], rewards: torch.Tensor, group_size: int, width: int,
                           cfg: GiGPOConfig) -> torch.Tensor:
    """GiGPO's step-level advantage of every turn, spread over that turn's generated tokens, shape (B, width).

    A turn's anchor state is (its group, the observations seen before it); its return discounts the
    per-step rewards and the episode's reward (``rewards``, on the last turn) by ``gamma`` per turn.
    """
    steps = max(len(t.turns) for t in trajectories)
    step_rewards = torch.zeros(len(trajectories), steps)
    step_mask = torch.zeros(len(trajectories), steps)
    for i, t in enumerate(trajectories):
        step_mask[i, : len(t.turns)] = 1
        step_rewards[i, : len(t.turns)] = torch.tensor(t.step_rewards)
        step_rewards[i, len(t.turns) - 1] += rewards[i]
    returns = discounted_step_returns(step_rewards, step_mask, cfg.gamma)
    keys: dict[tuple[int, str], int] = {}
    flat, anchors, where = [], [], []
    for i, t in enumerate(trajectories):
        for s, key in enumerate(t.state_keys[: len(t.turns)]):
            anchors.append(keys.setdefault((i // group_size, key), len(keys)))
            flat.append(returns[i, s])
            where.append((i, s))
    step_adv = step_group_advantages(torch.stack(flat), torch.tensor(anchors), normalize=cfg.normalize)
    out = torch.zeros(len(trajectories), width)
    for (i, s), value in zip(where, step_adv.tolist(), strict=True):
        start, end = trajectories[i].turn_spans[s]
        out[i, start:end] = value
    return out
