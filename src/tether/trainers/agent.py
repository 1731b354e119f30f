"""Agentic tool-use RL: SFT warm-up on tool-use demonstrations, then GRPO on multi-turn trajectories.

A step of :class:`AgentRLTrainer` reads exactly like :class:`~tether.trainers.rl.RLTrainer`'s
(generate -> score -> advantage -> clipped policy gradient) with one change: ``collect`` runs the
multi-turn loop of :mod:`tether.rollout.agent` instead of one ``generate`` call. The trajectory
becomes the "completion" of an :class:`~tether.rollout.agent.AgentRollout`, whose completion mask
is 0 on observation tokens, so the policy loss, the KL term (in the loss or in the reward), the
entropy term, the old- and reference-policy log-probs used by them, and the advantages all act on
the policy's own tokens only. The reward is the environment's verifier (the ``trajectory`` reward
function), plus any other reward function of the final answer.

Optional GiGPO (Feng et al. 2025; ``gigpo: {weight, gamma}``): a step-level advantage from
anchor-state groups is added, per turn, to GRPO's episode-level one (see :mod:`tether.core.gigpo`).

:class:`AgentSFTTrainer` is the warm-up: scripted demonstrations of the environment (tools executed
for real) as chat conversations whose tool messages carry no loss, trained with the SFT trainer.

How it departs from the papers: ReAct (Yao et al. 2023) prompts a frozen model with few-shot
traces; here the format is taught by SFT and then optimised by RL, as in agentic RL since. Turns
are chat messages ended by the end-of-turn token rather than one text with ``Observation:`` stops.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from tether.config import StrictModel
from tether.core.advantages import AdvantageInputs, AdvantageOutputs
from tether.core.gigpo import discounted_step_returns, step_group_advantages
from tether.rollout import HFEngine, SamplingParams
from tether.rollout.agent import (
    AgentLoop,
    AgentLoopConfig,
    AgentRollout,
    ChatRenderer,
    Trajectory,
    trajectory_metrics,
    trajectory_texts,
)
from tether.rollout.environment import EnvironmentConfig, environment_factory, environment_records
from tether.rollout.tools import build_tools
from tether.trainers.rl import GRPOConfig, RewardConfig, RLTrainer
from tether.trainers.sft import SFTConfig, SFTTrainer

log = logging.getLogger(__name__)


class GiGPOConfig(StrictModel):
    weight: float = Field(1.0, ge=0, description="omega: weight of the step-level advantage")
    gamma: float = Field(0.95, ge=0, le=1, description="discount of the step returns")
    normalize: bool = Field(True, description="divide by the step group's std (F_norm = std), else 1")


class AgentEvalConfig(StrictModel):
    """Held-out episodes of the environment's task, greedy; ``samples`` > 0 adds that many sampled episodes
    per task (``sampled/success`` etc.); ``before`` also evaluates before training."""

    n: int = Field(200, ge=1)
    seed: int = 0
    samples: int = Field(0, ge=0)
    temperature: float = Field(1.0, gt=0)
    before: bool = False
    batch_size: int | None = Field(None, ge=1)


def _env_renderer(env: EnvironmentConfig, tokenizer: Any) -> tuple[Any, ChatRenderer]:
    from tether.rollout.actions import get_action_format

    tools = build_tools(env.tools)
    renderer = ChatRenderer(tokenizer, get_action_format(env.action_format),
                            [t.schema for t in tools.values()], system_prompt=env.system_prompt)
    return environment_factory(env), renderer


@torch.no_grad()
def evaluate_agent(model: torch.nn.Module, tokenizer: Any, env: EnvironmentConfig, loop: AgentLoopConfig,
                   eval_cfg: AgentEvalConfig | None = None) -> dict[str, float]:
    """Greedy episodes on held-out tasks: ``success`` rate, mean verifier ``score`` and the loop metrics
    (and the same for sampled episodes, prefixed ``sampled/``, when ``eval_cfg.samples`` > 0)."""
    eval_cfg = eval_cfg or AgentEvalConfig()
    make_env, renderer = _env_renderer(env, tokenizer)
    engine = HFEngine(model, tokenizer, batch_size=eval_cfg.batch_size)
    records = environment_records(env, split="eval", n=eval_cfg.n, seed=eval_cfg.seed)
    agent = AgentLoop(engine, tokenizer, make_env, renderer, loop)
    results = trajectory_metrics(agent.run(records, SamplingParams(n=1, greedy=True)), loop.success_threshold)
    if eval_cfg.samples:
        sampled = agent.run(records, SamplingParams(n=eval_cfg.samples, temperature=eval_cfg.temperature,
                                                    seed=eval_cfg.seed))
        results.update({f"sampled/{k}": v for k, v in trajectory_metrics(sampled, loop.success_threshold).items()})
    return results


# ---------------------------------------------------------------------------------------- SFT warm-up


def demonstration_records(env: EnvironmentConfig, tokenizer: Any, n: int | None = None,
                          seed: int | None = None, workers: int = 4) -> list[dict]:
    """Chat records ``{"messages": [...]}`` of scripted episodes (tools run for real, ``workers`` at a
    time), rendered exactly as the agent loop renders prompts and observations; tool messages carry
    no SFT loss."""
    make_env, renderer = _env_renderer(env, tokenizer)

    def record(task: dict) -> dict:
        environment = make_env()
        first = environment.reset(task)
        out = {"messages": renderer.messages(first, environment.demonstration(task))}
        return {**out, "tools": renderer.template_tools} if renderer.template_tools else out

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(record, environment_records(env, split="train", n=n, seed=seed)))


class AgentSFTConfig(SFTConfig):
    """SFT on demonstrations of ``environment`` (``environment.task.n`` of them; ``data`` sets only
    tokenisation, or ``data.path`` gives your own chat records with tool messages)."""

    type: Literal["agent_sft"] = "agent_sft"
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    agent: AgentLoopConfig = Field(default_factory=AgentLoopConfig)
    eval: AgentEvalConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _data_from_environment(cls, data: Any) -> Any:
        if isinstance(data, dict) and not (data.get("data") or {}).get("path"):
            env = data.get("environment") or {}
            task = env.get("task") if isinstance(env, dict) else None
            data = {**data, "data": {**(data.get("data") or {}), "task": task or {"name": "multiplication"}}}
        return data


class AgentSFTTrainer(SFTTrainer):
    """The SFT trainer on tool-use demonstrations, evaluated by running the agent loop."""

    def __init__(self, config: AgentSFTConfig, model: torch.nn.Module, tokenizer: Any, run_dir: str | Path, *,
                 records: list[dict] | None = None, stage: str | None = None) -> None:
        if records is None and config.data.path is None:
            records = demonstration_records(config.environment, tokenizer, workers=config.agent.tool_workers)
        super().__init__(config, model, tokenizer, run_dir, records=records, stage=stage)

    def evaluate(self) -> dict[str, float]:
        if self.config.eval is None:
            return {}
        return evaluate_agent(self.model, self.tokenizer, self.config.environment, self.config.agent,
                              self.config.eval)


# ---------------------------------------------------------------------------------------- RL


class AgentConfig(GRPOConfig):
    """GRPO-family RL on multi-turn episodes of ``environment``. ``train.batch_size`` tasks per step,
    ``rollout.group_size`` episodes each; ``rollout`` sets sampling (``max_new_tokens`` and ``stop``
    are replaced by ``agent.max_tokens_per_turn`` and the end-of-turn token); ``data`` is unused."""

    type: Literal["agent"] = "agent"
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    agent: AgentLoopConfig = Field(default_factory=AgentLoopConfig)
    rewards: list[RewardConfig] = Field(default_factory=lambda: [RewardConfig(name="trajectory")])
    gigpo: GiGPOConfig | None = None
    eval: AgentEvalConfig | None = None

    @model_validator(mode="after")
    def _agent_supported(self) -> AgentConfig:
        if self.advantage == "remax" or self.dynamic_sampling.enabled or self.overlong is not None:
            raise ValueError("the agent trainer does not support remax, dynamic_sampling or overlong shaping")
        return self


class AgentRLTrainer(RLTrainer):
    """:class:`RLTrainer` whose ``collect`` runs multi-turn episodes; see the module docstring."""

    def __init__(self, config: AgentConfig, model: torch.nn.Module, tokenizer: Any, run_dir: str | Path, *,
                 records: list[dict] | None = None, reward_functions: list | None = None,
                 stage: str | None = None) -> None:
        records = records if records is not None else environment_records(config.environment, split="train")
        super().__init__(config, model, tokenizer, run_dir, records=records, reward_functions=reward_functions,
                         stage=stage)
        make_env, self.renderer = _env_renderer(config.environment, tokenizer)
        self.loop = AgentLoop(self.engine, tokenizer, make_env, self.renderer, config.agent)

    def collect(self) -> tuple[list[int], AgentRollout, torch.Tensor, dict[str, float]]:
        indices = self.next_prompts(self.config.train.batch_size)
        trajectories = self.loop.run([self.records[i] for i in indices], self.sampling_params(0))
        rollout = AgentRollout.from_trajectories(trajectories, trajectory_texts(trajectories, self.tokenizer))
        rewards, metrics = self.score(indices, rollout)
        metrics.update({f"agent/{k}": v for k, v in
                        trajectory_metrics(trajectories, self.config.agent.success_threshold).items()})
        return indices, rollout, rewards, metrics

    def score(self, indices: list[int], rollout: AgentRollout) -> tuple[torch.Tensor, dict[str, float]]:
        """The reward functions on the final answers, with the trajectories as the ``trajectory`` column."""
        records = [t.task for t in rollout.trajectories]
        columns = {k: [r.get(k) for r in records] for k in records[0] if k not in ("prompt", "plan", "solution")}
        columns["trajectory"] = rollout.trajectories
        result = self.rewards.score([r["prompt"] for r in records],
                                    [t.answer or "" for t in rollout.trajectories], columns)
        return result.total.clone(), result.metrics()

    def advantages(self, rollout: AgentRollout, inputs: AdvantageInputs) -> AdvantageOutputs:
        out = super().advantages(rollout, inputs)
        if self.config.gigpo is not None:
            step = gigpo_token_advantages(rollout.trajectories, inputs.rewards.cpu(), inputs.group_size,
                                          inputs.mask.shape[1], self.config.gigpo).to(inputs.mask.device)
            out.advantages = out.advantages + self.config.gigpo.weight * step * (inputs.mask != 0)
        return out

    def evaluate(self) -> dict[str, float]:
        if self.config.eval is None:
            return {}
        return evaluate_agent(self.model, self.tokenizer, self.config.environment, self.config.agent,
                              self.config.eval)


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


# ---------------------------------------------------------------------------------------- public API


def _config(config: Any, cls: type) -> Any:
    return config if isinstance(config, cls) else cls.model_validate(config)


def train_agent_sft(config: AgentSFTConfig | dict, *, out: str | Path, model: Any = None, tokenizer: Any = None,
                    dataset: Any = None, resume: bool = False) -> dict[str, float]:
    """SFT warm-up on tool-use demonstrations of ``config.environment`` (or ``dataset``: chat records
    with tool messages). Returns the held-out agent figures when ``config.eval`` is set."""
    from tether.data import load_records
    from tether.models.loading import resolve_model

    cfg = _config(config, AgentSFTConfig)
    model, tokenizer = resolve_model(model, tokenizer, cfg.model)
    records = load_records(dataset) if dataset is not None else None
    return AgentSFTTrainer(cfg, model, tokenizer, out, records=records, stage=cfg.name or cfg.type).fit(resume=resume)


def train_agent(config: AgentConfig | dict, *, out: str | Path, model: Any = None, tokenizer: Any = None,
                dataset: Any = None, reward_functions: list | None = None, resume: bool = False) -> dict[str, float]:
    """Multi-turn tool-use RL (GRPO family, optional GiGPO) in ``config.environment``.

    ``dataset``: task records ``{"prompt", "answer", ...}`` replacing the environment's task draw;
    ``reward_functions``: callables ``fn(prompts, completions, trajectory, **columns)`` (completions are
    the final answers), replacing ``config.rewards``.
    """
    from tether.data import load_records
    from tether.models.loading import resolve_model

    cfg = _config(config, AgentConfig)
    model, tokenizer = resolve_model(model, tokenizer, cfg.model)
    records = load_records(dataset) if dataset is not None else None
    trainer = AgentRLTrainer(cfg, model, tokenizer, out, records=records, reward_functions=reward_functions,
                             stage=cfg.name or cfg.type)
    return trainer.fit(resume=resume)


def _register() -> None:
    from tether.pipeline import register_stage

    @register_stage("agent_sft", AgentSFTConfig, "SFT on tool-use demonstrations, observation tokens masked")
    def run_agent_sft(cfg: AgentSFTConfig, run_dir: Path, resume: bool) -> dict[str, float]:
        return train_agent_sft(cfg, out=run_dir, resume=resume)

    @register_stage("agent", AgentConfig, "multi-turn tool-use RL (GRPO family, GiGPO), observation tokens masked")
    def run_agent(cfg: AgentConfig, run_dir: Path, resume: bool) -> dict[str, float]:
        return train_agent(cfg, out=run_dir, resume=resume)


_register()
