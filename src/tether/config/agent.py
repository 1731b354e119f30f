"""Agentic tool-use stages: the environment, the multi-turn loop, the SFT warm-up, the RL stage, and the
stages that sample episodes into preference pairs (``agent_episodes``) and evaluate a model's episodes
(``agent_eval``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from tether.config.base import StrictModel, deep_merge
from tether.config.common import StageConfig, TaskSource
from tether.config.rewards import RewardSpec
from tether.config.rl import PRESETS, CriticConfig, GRPOConfig, check_shared_backbone
from tether.config.sft import SFTConfig
from tether.core.advantages import ADVANTAGE_ESTIMATORS


class EnvironmentConfig(StrictModel):
    """A tool-use environment: which task, which tools, which action format."""

    name: str = Field("tools", description="a registered environment (ENVIRONMENTS)")
    task: TaskSource = Field(default_factory=lambda: TaskSource(name="multiplication"),
                             description="the tasks episodes solve (n: training tasks)")
    tools: list[str | dict[str, Any]] = Field(
        default_factory=lambda: ["calculator"],
        description="built-in tools (calculator, python), import paths 'package.module:function' or {name, kwargs}")
    action_format: Literal["react", "hermes"] = Field("react", description="how the policy writes tool calls")
    rendering: Literal["chat", "text"] = Field(
        "chat", description="chat: turns through the tokenizer's chat template, ended by its end-of-turn token; "
                            "text: ReAct as one plain text (Question: / Action: / Observation:), each turn stopped "
                            "at 'Observation:', for models without a chat template (action_format: react)")
    system_prompt: bool = Field(True, description="describe the tools in a system message (or the template's)")
    max_observation_chars: int = Field(256, ge=1, description="longer tool output is cut")
    eval_n: int = Field(200, ge=1, description="held-out tasks for evaluation")
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="share of the task's problems held out")

    @model_validator(mode="after")
    def _text_is_react(self) -> EnvironmentConfig:
        if self.rendering == "text" and self.action_format != "react":
            raise ValueError("rendering: text is ReAct's plain-text layout: set action_format: react (hermes tool "
                             "calls need a chat template)")
        return self


class AgentLoopConfig(StrictModel):
    """Episode limits and concurrency of the multi-turn loop."""

    max_turns: int = Field(4, ge=1, description="policy turns per episode")
    max_tokens: int = Field(256, ge=2, description="generated + observation tokens per episode")
    max_tokens_per_turn: int = Field(64, ge=1, description="tokens the policy generates per turn at most")
    tool_workers: int = Field(4, ge=1, description="threads running tool calls and verifiers")
    tool_wait_s: float | None = Field(None, ge=0, description="null: every round waits for all tool calls "
                                      "(reproducible); a number: slower calls join a later round")
    success_threshold: float = Field(1.0, description="an episode succeeds when its verifier score reaches this")


class GiGPOConfig(StrictModel):
    """GiGPO's step-level advantage (Feng et al. 2025), added per turn to the episode-level one."""

    weight: float = Field(1.0, ge=0, description="omega: weight of the step-level advantage")
    gamma: float = Field(0.95, ge=0, le=1, description="discount of the step returns")
    normalize: bool = Field(True, description="divide by the step group's std (F_norm = std), else 1")


class AgentEvalConfig(StrictModel):
    """Held-out episodes of the environment's task, greedy; ``samples`` = k > 0 adds k sampled episodes per
    task (``sampled/success`` etc., and ``pass@k``); ``before`` also evaluates before training."""

    n: int = Field(200, ge=1, description="held-out tasks")
    seed: int = Field(0, description="which held-out tasks (and samples)")
    samples: int = Field(0, ge=0, description="sampled episodes per task beside the greedy one (k of pass@k)")
    temperature: float = Field(1.0, ge=0, description="sampled episodes' temperature (0: greedy)")
    before: bool = Field(False, description="also evaluate the starting model (figures prefixed before/)")
    batch_size: int | None = Field(None, ge=1, description="episodes decoded together; None: all")

    held_out: ClassVar[bool] = True  # its seed picks the held-out tasks: a recipe's seed leaves it alone


class AgentSFTConfig(SFTConfig):
    """SFT on demonstrations of ``environment`` (``environment.task.n`` of them; ``data`` sets only
    tokenisation, or ``data.path`` / ``data.mix`` gives your own chat records with tool messages)."""

    type: Literal["agent_sft"] = Field("agent_sft", description="the stage type")
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig, description="the environment")
    agent: AgentLoopConfig = Field(default_factory=AgentLoopConfig, description="the multi-turn loop")
    eval: AgentEvalConfig | None = Field(None, description="held-out episodes after training")

    @model_validator(mode="before")
    @classmethod
    def _data_from_environment(cls, data: Any) -> Any:
        given = (data.get("data") or {}) if isinstance(data, dict) else {}
        if isinstance(data, dict) and not (given.get("path") or given.get("mix")):
            env = data.get("environment") or {}
            task = env.get("task") if isinstance(env, dict) else None
            data = {**data, "data": {**(data.get("data") or {}), "task": task or {"name": "multiplication"}}}
        return data


class EpisodeSamplingConfig(StrictModel):
    """``samples`` sampled episodes of each of ``n`` training tasks."""

    n: int = Field(400, ge=1, description="training tasks (the environment task's train split, first n)")
    samples: int = Field(8, ge=2, description="episodes per task, K: a task with both a success and a failure "
                                              "gives min(successes, failures) pairs")
    temperature: float = Field(1.0, gt=0, description="sampling temperature")
    seed: int = Field(0, description="the sampling seed (and the pairing's shuffle)")
    batch_size: int | None = Field(None, ge=1, description="episodes decoded together; None: all")


class AgentEpisodesConfig(StageConfig):
    """Sample episodes of ``environment`` from ``model`` and pair each task's successes with its failures
    (DMPO's data, :func:`tether.data.episode_pairs.episode_pairs`): ``STAGE/episodes.jsonl`` and
    ``STAGE/pairs.jsonl``, the pairs a ``dpo`` stage reads as ``data: {path: "@STAGE/pairs.jsonl"}``."""

    type: Literal["agent_episodes"] = Field("agent_episodes", description="the stage type")
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig, description="the environment")
    agent: AgentLoopConfig = Field(default_factory=AgentLoopConfig, description="the multi-turn loop "
                                                                                "(success_threshold splits "
                                                                                "successes from failures)")
    episodes: EpisodeSamplingConfig = Field(default_factory=EpisodeSamplingConfig, description="what is sampled")
    eval: None = Field(None, description="not used: evaluate with an agent_eval stage")

    @model_validator(mode="after")
    def _chat_rendering(self) -> AgentEpisodesConfig:
        if self.environment.rendering != "chat":
            raise ValueError("agent_episodes writes episode pairs as conversations for DPO (observations as tool "
                             "messages, which carry no loss): it needs environment.rendering: chat")
        return self


class AgentEvalStageConfig(StageConfig):
    """Held-out episodes of ``environment`` by ``model`` (greedy, and sampled with ``eval.samples``), no
    training: the agent counterpart of the ``eval`` stage, for models trained by other stages (``dpo``)."""

    type: Literal["agent_eval"] = Field("agent_eval", description="the stage type")
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig, description="the environment")
    agent: AgentLoopConfig = Field(default_factory=AgentLoopConfig, description="the multi-turn loop")
    eval: AgentEvalConfig = Field(default_factory=AgentEvalConfig, description="what is evaluated")


def _trajectory() -> list[RewardSpec]:
    return [RewardSpec("trajectory")]


# PPO on episodes: PPOConfig's defaults (one episode per task, the KL in the reward per token, GAE,
# four epochs), the critic from the policy (an agent stage has no reward model to start it from).
AGENT_PPO: dict[str, Any] = {
    "advantage": "gae", "advantage_kwargs": {"gamma": 1.0, "lam": 0.95, "whiten": True}, "critic": {"init": "policy"},
    "rollout": {"group_size": 1}, "loss_agg": "token-mean", "kl": {"coef": 0.05, "estimator": "k1", "in_reward": True},
    "num_iterations": 4}


class AgentConfig(GRPOConfig):
    """GRPO-family RL, or PPO with a critic (``algorithm: ppo``, or ``critic`` with ``advantage: gae``), on
    multi-turn episodes of ``environment``. ``train.batch_size`` tasks per step, ``rollout.group_size``
    episodes each; ``rollout`` sets sampling (``max_new_tokens`` and ``stop`` are replaced by
    ``agent.max_tokens_per_turn`` and the end-of-turn token); ``data`` is unused."""

    type: Literal["agent"] = Field("agent", description="the stage type")
    algorithm: Literal["grpo", "dr_grpo", "rloo", "reinforce", "reinforce_pp", "reinforce_pp_paper", "remax", "dapo",
                       "gspo", "cispo", "gmpo", "sapo", "dppo", "ppo"] | None = Field(
        None, description="a preset: a critic-free method's settings, or ppo (a critic from the policy, GAE over "
                          "the action tokens, the KL in the reward, one episode per task)")
    critic: CriticConfig | None = Field(None, description="a learned value model on the action tokens (PPO; "
                                                          "advantage: gae); None: critic-free")
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig, description="the environment")
    agent: AgentLoopConfig = Field(default_factory=AgentLoopConfig, description="the multi-turn loop")
    rewards: list[RewardSpec] = Field(default_factory=_trajectory, description="the environment's verifier "
                                      "(trajectory) and any reward of the final answer")
    gigpo: GiGPOConfig | None = Field(None, description="add GiGPO's step-level advantage; None: off")
    eval: AgentEvalConfig | None = Field(None, description="held-out episodes after training")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:  # replaces GRPOConfig's: the presets plus ppo
        if isinstance(data, dict) and data.get("algorithm"):
            preset = AGENT_PPO if data["algorithm"] == "ppo" else PRESETS.get(data["algorithm"])
            if preset is not None:
                return deep_merge(preset, data)
        return data

    @model_validator(mode="after")
    def _no_critic_needed(self) -> AgentConfig:  # replaces GRPOConfig's: a critic is allowed, and needs gae
        reads_values = "values" in ADVANTAGE_ESTIMATORS.needs(self.advantage)
        if self.critic is not None and not reads_values:
            raise ValueError(f"critic is set but advantage {self.advantage!r} reads no values: set advantage: gae "
                             "(or algorithm: ppo), or drop the critic")
        if self.critic is None and reads_values:
            raise ValueError(f"advantage {self.advantage!r} needs a critic's values: set critic (e.g. "
                             "{init: policy}) or algorithm: ppo")
        if self.critic is not None and self.gigpo is not None:
            raise ValueError("agent PPO does not support gigpo (a group baseline beside GAE's per-token credit): "
                             "drop one")
        check_shared_backbone(self.critic, self.model)
        return self

    @model_validator(mode="after")
    def _agent_supported(self) -> AgentConfig:
        if "step_rewards" in ADVANTAGE_ESTIMATORS.needs(self.advantage):
            raise ValueError(f"advantage {self.advantage!r} reads a process reward model's step scores, which the "
                             "agent trainer has none of: use an episode-level estimator (grpo, rloo, remax, gae, ...)")
        return self

    def length_limit(self) -> tuple[str, int]:
        """An episode's budget of generated and observation tokens (``rollout.max_new_tokens`` is unused)."""
        return "agent.max_tokens", self.agent.max_tokens

