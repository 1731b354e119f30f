"""RL stage configs: one :class:`RLConfig` for the RL machinery, ``grpo`` (critic-free) and ``ppo`` (a critic).

PPO is the critic-enabled case of the same machinery (as in verl): both stages sample, score,
shape rewards, put the KL where ``kl`` says, estimate advantages with a registry estimator and
update with a registry policy loss; ``ppo`` adds ``critic`` and the GAE estimator's
``gamma`` / ``lam`` / ``whiten_advantages``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from tether.config.base import StrictModel, deep_merge, known_name
from tether.config.common import StageConfig, TaskSource
from tether.config.data import PREFIX_SHARING_MODES, PrefixSharing, PromptDataConfig
from tether.config.rewards import RewardRoutes, RewardSpec
from tether.config.sampling import SamplingConfig
from tether.core.advantages import ADVANTAGE_ESTIMATORS
from tether.core.aggregation import LOSS_AGGREGATIONS
from tether.core.distillation import DISTILLATION_DIVERGENCES
from tether.core.kl import KL_CONTROLLERS, KL_ESTIMATORS
from tether.core.policy_losses import POLICY_LOSSES, extra_arguments
from tether.core.reward_aggregation import REWARD_AGGREGATIONS
from tether.core.rollout_correction import ROLLOUT_CORRECTIONS


class RolloutConfig(SamplingConfig):
    """How an RL stage samples: ``group_size`` completions per prompt, on which engine."""

    group_size: int = Field(8, ge=1, description="completions per prompt")
    mask_truncated: bool = Field(False, description="no loss on completions cut at max_new_tokens (DAPO)")
    engine: Literal["hf", "vllm", "ray"] = Field("hf", description="hf: in process; vllm: colocated on the GPU "
                                                 "(extra tether[vllm]); ray: rollout workers (extra tether[ray])")
    workers: int = Field(2, ge=1, description="ray engine: rollout worker actors")
    engine_options: dict[str, Any] = Field(default_factory=dict, description="hf: dtype (bfloat16 decoding), "
                                           "continuous (continuous batching when engine_batch_size < the samples); "
                                           "vllm: vllm.LLM arguments (gpu_memory_utilization, ...); ray: num_cpus, "
                                           "num_gpus, address")

    @field_validator("temperature")
    @classmethod
    def _sampled(cls, value: float) -> float:
        if value == 0:
            raise ValueError("RL samples at temperature > 0: its log-probs are taken at the sampling temperature")
        return value


class KLConfig(StrictModel):
    """The KL penalty to the reference (the starting policy): in the loss, or in the reward per token."""

    coef: float = Field(0.0, ge=0, description="beta (the starting value under the adaptive controller); 0: off")
    estimator: str = Field("k3", description="per-token KL estimator: k1 (Ziegler et al.), k2, k3 (Schulman)")
    in_reward: bool = Field(False, description="subtract beta * KL from the reward per token instead of adding "
                                               "it to the loss")
    controller: str = Field("fixed", description="fixed, or adaptive (Ziegler et al.: beta moves toward a "
                                                 "target KL per completion)")
    target: float = Field(6.0, gt=0, description="adaptive: target KL per completion, nats")
    horizon: int = Field(10000, ge=1, description="adaptive: K_beta = batch size / horizon")

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        return known_name(KL_ESTIMATORS, value)

    @field_validator("controller")
    @classmethod
    def _known_controller(cls, value: str) -> str:
        return known_name(KL_CONTROLLERS, value)


class ClipConfig(StrictModel):
    """The clipped surrogate's ratio bounds: [1 - low, 1 + high], and dual-clip (Ye et al. 2020)."""

    low: float = Field(0.2, ge=0, description="epsilon below 1")
    high: float = Field(0.2, ge=0, description="epsilon above 1 (DAPO's clip-higher: larger)")
    dual: float | None = Field(None, gt=1, description="dual-clip bound c on negative advantages; None: off")


class OverlongConfig(StrictModel):
    """DAPO soft overlong punishment inside ``buffer`` tokens before ``rollout.max_new_tokens``."""

    buffer: int = Field(16, ge=1, description="tokens before the limit where the penalty ramps up")
    penalty: float = Field(1.0, ge=0, description="the penalty at the limit")


class DynamicSamplingConfig(StrictModel):
    """DAPO dynamic sampling: groups whose rewards are all equal are dropped and replaced."""

    enabled: bool = Field(False, description="drop and refill groups without reward variance")
    max_rounds: int = Field(4, ge=1, description="generation rounds per step before giving up filling")


class RolloutCorrectionConfig(StrictModel):
    """Correcting for the sampler-trainer mismatch: rho_t = pi_old / mu per token (ROLLOUT_CORRECTIONS);
    the weight multiplies the token's policy-gradient term."""

    mode: str = Field("none", description="none (measure only), tis (min(rho, cap)), mis (drop tokens outside "
                                          "[low, high]), icepop (rho inside [low, high], else 0), seq_tis / "
                                          "seq_mask (the same on each sequence's geometric-mean ratio)")
    cap: float = Field(2.0, gt=0, description="tis, seq_tis: the truncation C")
    low: float = Field(0.5, ge=0, description="mis, icepop, seq_mask: the lower bound of the kept band")
    high: float = Field(2.0, gt=0, description="mis, icepop, seq_mask: the upper bound of the kept band")

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, value: str) -> str:
        return known_name(ROLLOUT_CORRECTIONS, value)

    @model_validator(mode="after")
    def _band(self) -> RolloutCorrectionConfig:
        if self.low >= self.high:
            raise ValueError(f"rollout_correction.low ({self.low}) must be below high ({self.high})")
        return self


class AdaptiveEntropyConfig(StrictModel):
    """Skywork-OR1's adaptive entropy control: the bonus coefficient steps toward holding the entropy at a target."""

    target: float = Field(..., gt=0, description="the mean token entropy to hold, nats")
    lr: float = Field(5.0e-4, gt=0, description="the coefficient's change per training step")
    max_coef: float | None = Field(None, gt=0, description="an upper bound on the coefficient; None: none")


class EntropyConfig(StrictModel):
    """The entropy bonus (subtracted from the loss), fixed or adaptive, and a collapse warning."""

    coef: float = Field(0.0, ge=0, description="weight of the entropy bonus (the starting value when adaptive)")
    adaptive: AdaptiveEntropyConfig | None = Field(None, description="move the coefficient toward a target "
                                                                     "entropy; None: fixed")
    floor: float | None = Field(None, ge=0, description="log entropy/collapse = 1 and warn when the step's mean "
                                                        "token entropy falls below this; None: off")


class CriticConfig(StrictModel):
    """The value model: from the reward model (InstructGPT) or the policy, or a path."""

    init: Literal["reward_model", "policy"] = Field("reward_model", description="where a new critic starts")
    name_or_path: str | None = Field(None, description="a reward / value / causal-LM checkpoint; overrides init")
    lr: float | None = Field(None, gt=0, description="the critic's learning rate; None: optim.lr")
    coef: float = Field(0.1, ge=0, description="weight of the value loss in the joint loss (vf_coef)")
    clip_range: float | None = Field(0.2, gt=0, description="value clipping around the rollout values; None: off")
    share_backbone: bool = Field(False, description="one base model: policy and value LoRA adapters "
                                                    "(needs model.lora); the reference is the adapter-free base")
    seed: int = Field(0, description="initialises a new value head")
    warmup_steps: int = Field(0, ge=0, description="the first N training steps update only the critic (on the "
                                                   "value loss of fresh rollouts); the actor is frozen")


def check_shared_backbone(critic: CriticConfig | None, model: Any) -> None:
    """``critic.share_backbone`` needs LoRA on the policy and a critic built from the policy."""
    if critic is None or not critic.share_backbone:
        return
    if model.lora is None:
        raise ValueError("critic.share_backbone needs model.lora: the policy and value adapters live on it")
    if critic.init == "reward_model" or critic.name_or_path:
        raise ValueError("critic.share_backbone builds the critic on the policy's base model: "
                         "set critic.init: policy and no critic.name_or_path")


class ProcessRewardConfig(StrictModel):
    """The process reward model whose step scores a process-supervised estimator (``grpo_process``) reads."""

    path: str = Field(description="a process reward model (tether rm with process: true): a path or @stage")
    batch_size: int = Field(32, ge=1, description="completions scored per forward")


class TeacherConfig(StrictModel):
    """The teacher that scores the student's samples: a local causal LM sharing the student's tokenizer
    (``path``), a served OpenAI-compatible endpoint that returns prompt log-probs (``base_url``; echo +
    logprobs), or the student itself given a privileged context (``kind: self``, no gradient through it)."""

    kind: Literal["local", "served", "self"] = Field("local", description="where the teacher's log-probs come from")
    path: str | None = Field(None, description="local: a model path or @stage; served: the tokenizer's (default: "
                                               "the student's)")
    base_url: str | None = Field(None, description="served: the endpoint, e.g. http://127.0.0.1:8000/v1")
    served_model: str | None = Field(None, description="served: the model id at the endpoint")
    api_key_env: str | None = Field(None, description="served: the environment variable holding the API key")
    timeout: float = Field(60.0, gt=0, description="served: seconds per request")
    concurrency: int = Field(8, ge=1, description="served: requests in flight")
    privileged_prompt: str | None = Field(None, description="the teacher's prompt instead of the student's: a "
                                          "template of the record's fields, e.g. '{prompt}' with the answer "
                                          "shown ('Answer {answer}. {prompt}')")
    batch_size: int = Field(32, ge=1, description="samples per teacher forward / request batch")

    @model_validator(mode="after")
    def _where(self) -> TeacherConfig:
        if self.kind == "local" and self.path is None:
            raise ValueError("teacher: a local teacher needs path (a model path or @stage)")
        if self.kind == "served" and self.base_url is None:
            raise ValueError("teacher: a served teacher needs base_url (an OpenAI-compatible /v1 endpoint)")
        if self.kind == "self" and self.privileged_prompt is None:
            raise ValueError("teacher: self-distillation needs privileged_prompt (what the teacher sees that the "
                             "student does not), else teacher and student are the same")
        return self


class DistillConfig(StrictModel):
    """On-policy distillation: the teacher scores the student's own samples (``tether.core.distillation``).
    ``reverse_kl``: each token's advantage gains ``-coef * (log π_S - log π_T)`` at the sampled token (beside
    the rewards' advantage, if any); ``forward_kl`` / ``jsd``: ``coef`` x the divergence of the whole
    next-token distributions joins the loss (a local or self teacher)."""

    teacher: TeacherConfig = Field(description="the teacher")
    coef: float = Field(1.0, gt=0, description="weight of the distillation signal")
    divergence: str = Field("reverse_kl", description="DISTILLATION_DIVERGENCES: reverse_kl (sampled token), "
                                                      "forward_kl, jsd")
    beta: float = Field(0.5, ge=0, le=1, description="jsd: the mixture weight of the teacher")
    top_k: int | None = Field(None, ge=1, description="forward_kl / jsd over the teacher's top-k tokens only")

    @model_validator(mode="after")
    def _supported(self) -> DistillConfig:
        known_name(DISTILLATION_DIVERGENCES, self.divergence)
        whole = "distributions" in DISTILLATION_DIVERGENCES.needs(self.divergence)
        if whole and self.teacher.kind == "served":
            raise ValueError(f"distill.divergence {self.divergence!r} reads the teacher's whole distribution; a "
                             "served teacher returns the sampled tokens' log-probs: use reverse_kl")
        if self.top_k is not None and not whole:
            raise ValueError("distill.top_k restricts whole distributions (forward_kl, jsd), not reverse_kl")
        return self


class AsyncConfig(StrictModel):
    """Asynchronous RL (``tether.trainers.async_rollout``): a producer process samples step s with the policy
    of ``max(0, s - max_staleness)`` updates while the learner trains; deterministic, resumable."""

    max_staleness: int = Field(0, ge=0, description="how many updates the sampling policy may lag (0: the "
                                                    "synchronous loop)")
    threads: int = Field(1, ge=1, description="torch threads of the producer process")


class RLConfig(StageConfig):
    """The RL machinery's settings, shared by the ``grpo``, ``ppo`` and ``agent`` stages.
    ``train.batch_size`` is prompts per step; each gets ``rollout.group_size`` samples."""

    data: PromptDataConfig = Field(default_factory=lambda: PromptDataConfig(task=TaskSource()),
                                   description="the prompts (with answers for verifiers)")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="how completions are sampled")
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec("accuracy")],
                                      description="the reward functions, summed with their weights")
    reward_routes: RewardRoutes | None = Field(None, description="rewards per prompt type instead of rewards: "
                                               "{by: kind, routes: {reasoning: {rewards: [...]}, general: "
                                               "{rewards: [...], answer_only: true}}}")
    gold: RewardSpec | None = Field(None, description="a reward only logged (reward/gold), never trained on")
    distill: DistillConfig | None = Field(None, description="on-policy distillation from a teacher, alone "
                                                            "(rewards: []) or beside the rewards; None: off")
    async_rollout: AsyncConfig = Field(default_factory=AsyncConfig, validation_alias=AliasChoices("async",
                                       "async_rollout"), description="async: {max_staleness: K}: sample while "
                                       "training, K updates behind at most")
    reward_on_error: Literal["raise", "zero"] = Field("raise", description="a reward function that raises: stop, "
                                                                          "or score the sample 0")
    reward_aggregation: str = Field("sum", description="how the reward functions combine (REWARD_AGGREGATIONS): "
                                                       "sum (weighted), gdpo (each normalised within its group "
                                                       "first, then weighted)")
    reward_workers: int = Field(0, ge=0, description="score rewards in this many Ray actors (extra tether[ray]); "
                                                     "0: in process")
    reward_norm: Literal["none", "batch", "running"] = Field(
        "none", description="normalise scores: over the batch, or by the running mean / std of all so far")
    reward_clip: float | None = Field(None, gt=0, description="clip normalised scores to [-c, c]; None: off")
    missing_eos_penalty: float | None = Field(None, ge=0, description="subtracted when a completion has no EOS")
    overlong: OverlongConfig | None = Field(None, description="DAPO soft overlong punishment; None: off")
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig,
                                                    description="DAPO dynamic sampling")
    advantage: str = Field("grpo", description="an advantage estimator (ADVANTAGE_ESTIMATORS)")
    advantage_kwargs: dict[str, Any] = Field(default_factory=dict, description="the estimator's hyperparameters")
    process_reward: ProcessRewardConfig | None = Field(None, description="step rewards for a process-supervised "
                                                                         "estimator (advantage: grpo_process)")
    policy_loss: str = Field("ppo_clip", description="a policy loss (POLICY_LOSSES)")
    policy_loss_kwargs: dict[str, Any] = Field(default_factory=dict, description="the policy loss's own arguments "
                                               "(sapo: tau_pos, tau_neg; dppo_tv / dppo_kl: ratio_cap)")
    old_logprobs: Literal["recompute", "sampler"] = Field(
        "recompute", description="the old policy of the ratio: recompute (a trainer forward pass when a rollout "
                                 "is used more than once) or sampler (the engine's log-probs; no extra pass)")
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig,
                                                        description="correct for the sampler-trainer mismatch")
    loss_agg: str = Field("seq-mean-token-mean", description="how per-token losses become one (LOSS_AGGREGATIONS)")
    kl: KLConfig = Field(default_factory=KLConfig, description="the KL penalty to the reference")
    clip: ClipConfig = Field(default_factory=ClipConfig, description="the surrogate's clipping")
    entropy: EntropyConfig = Field(default_factory=EntropyConfig, description="the entropy bonus and its controls")
    top_entropy_quantile: float | None = Field(None, gt=0, le=1, description="the policy gradient on only this top "
                                               "fraction of tokens by entropy (Wang et al. 2025: 0.2); None: all")
    critic: CriticConfig | None = Field(None, description="a learned value model (the ppo stage); None: "
                                                          "critic-free")
    num_iterations: int = Field(1, ge=1, description="passes over each rollout batch (GRPO's mu, PPO's epochs)")
    mini_batches: int = Field(1, ge=1, description="optimiser steps per pass over a rollout batch")
    micro_batch_size: int | None = Field(None, ge=1, description="samples per forward/backward")
    row_tokens: int = Field(1024, ge=16, description="tokens per packed row in the update forward")
    prefix_sharing: PrefixSharing = Field(
        True, description="the update forward computes a prompt shared by a group's completions once; true: on a CPU "
                          "by cascade attention for groups of more than two, else under a dense row mask; "
                          + PREFIX_SHARING_MODES)
    sample_every: int = Field(10, ge=1, description="write sample completions every this many steps")

    @model_validator(mode="after")
    def _known_names(self) -> RLConfig:
        known_name(ADVANTAGE_ESTIMATORS, self.advantage)
        process = "step_rewards" in ADVANTAGE_ESTIMATORS.needs(self.advantage)
        if process != (self.process_reward is not None):
            raise ValueError(f"advantage {self.advantage!r} reads step rewards: set process_reward: {{path: PRM}}"
                             if process else f"process_reward is read by process-supervised estimators "
                             f"(advantage: grpo_process), not {self.advantage!r}")
        known_name(POLICY_LOSSES, self.policy_loss)
        unknown = sorted(set(self.policy_loss_kwargs) - set(extra_arguments(self.policy_loss)))
        if unknown:
            raise ValueError(f"policy_loss_kwargs {unknown} are not arguments of {self.policy_loss!r} "
                             f"(it takes {sorted(extra_arguments(self.policy_loss)) or 'none'})")
        if self.old_logprobs == "sampler" and self.rollout_correction.mode != "none":
            raise ValueError("rollout_correction weighs the trainer's old policy against the sampler: it needs "
                             "old_logprobs: recompute")
        known_name(LOSS_AGGREGATIONS, self.loss_agg)
        known_name(REWARD_AGGREGATIONS, self.reward_aggregation)
        if self.reward_routes is not None and "rewards" in self.model_fields_set:
            raise ValueError("reward_routes replaces rewards: list each kind's rewards under reward_routes.routes "
                             "and remove rewards")
        if self.async_rollout.max_staleness:
            if self.rollout_correction.mode == "none":
                raise ValueError("async: off-policy samples need a correction: set rollout_correction.mode (e.g. "
                                 "tis) so the sampler's log-probs are the behaviour policy")
            if self.dynamic_sampling.enabled:
                raise ValueError("async does not support dynamic sampling (its rounds depend on the rewards of "
                                 "the step's own samples): drop one")
        if self.dynamic_sampling.enabled and self.rollout.group_size < 2:
            raise ValueError("dynamic_sampling keeps groups whose rewards differ: it needs rollout.group_size >= 2")
        key, limit = self.length_limit()
        if self.overlong is not None and self.overlong.buffer > limit:
            raise ValueError(f"overlong.buffer ({self.overlong.buffer}) must be <= {key} ({limit})")
        return self

    def length_limit(self) -> tuple[str, int]:
        """The length that cuts a sample (DAPO's overlong term ramps to it): the key that sets it, its value."""
        return "rollout.max_new_tokens", self.rollout.max_new_tokens

    def advantage_hparams(self) -> dict[str, Any]:
        """The keyword arguments the advantage estimator is called with."""
        return dict(self.advantage_kwargs)

    def reward_model_path(self) -> str | None:
        """The ``path`` of the first ``reward_model`` reward, where the critic is initialised from."""
        return next((r.kwargs.get("path") for r in self.rewards if r.name == "reward_model"), None)


PRESETS: dict[str, dict[str, Any]] = {
    # Shao et al. 2024: group-normalised advantage, k3 KL in the loss, per-sequence mean.
    "grpo": {"advantage": "grpo", "loss_agg": "seq-mean-token-mean", "kl": {"coef": 0.04, "estimator": "k3"}},
    # Liu et al. 2025: no std division, no length normalisation (constant divisor), no KL.
    "dr_grpo": {"advantage": "dr_grpo", "loss_agg": "seq-mean-token-sum-norm", "kl": {"coef": 0.0}},
    # Ahmadian et al. 2024: leave-one-out baseline, sequence KL folded into the reward.
    "rloo": {"advantage": "rloo", "loss_agg": "token-mean",
             "kl": {"coef": 0.05, "estimator": "k1", "in_reward": True}},
    # Williams 1992 with a moving-average baseline.
    "reinforce": {"advantage": "reinforce", "loss_agg": "token-mean", "kl": {"coef": 0.0}},
    # Hu 2025: per-token KL in the reward, global batch normalisation.
    "reinforce_pp": {"advantage": "reinforce_pp", "loss_agg": "token-mean",
                     "kl": {"coef": 0.01, "estimator": "k2", "in_reward": True}},
    # Hu 2025 as written: one response per prompt, k1 KL per token in the reward, global normalisation.
    "reinforce_pp_paper": {"advantage": "reinforce_pp", "loss_agg": "token-mean", "rollout": {"group_size": 1},
                           "kl": {"coef": 0.01, "estimator": "k1", "in_reward": True}},
    # Li et al. 2023: a greedy rollout per prompt is the baseline.
    "remax": {"advantage": "remax", "loss_agg": "token-mean", "kl": {"coef": 0.0}},
    # Yu et al. 2025: clip-higher, token-level loss, dynamic sampling, overlong shaping, no KL.
    "dapo": {"advantage": "grpo", "loss_agg": "token-mean", "kl": {"coef": 0.0},
             "clip": {"low": 0.2, "high": 0.28}, "dynamic_sampling": {"enabled": True},
             "overlong": {"buffer": 16, "penalty": 1.0}},
    # Zheng et al. 2025: the sequence-level ratio (length-normalised), clipped per sequence, tiny range.
    "gspo": {"advantage": "grpo", "policy_loss": "gspo", "loss_agg": "seq-mean-token-mean", "kl": {"coef": 0.0},
             "clip": {"low": 3.0e-4, "high": 4.0e-4}},
    # MiniMax 2025: clipped, detached importance weight times the log-prob gradient; no lower bound.
    "cispo": {"advantage": "grpo", "policy_loss": "cispo", "loss_agg": "token-mean", "kl": {"coef": 0.0},
              "clip": {"low": 1.0, "high": 2.0}},
    # Zhao et al. 2025: geometric mean of the token ratios, clipped in log space to (-0.4, 0.4).
    "gmpo": {"advantage": "grpo", "policy_loss": "gmpo", "loss_agg": "seq-mean-token-mean", "kl": {"coef": 0.0},
             "clip": {"low": 0.4, "high": 0.4}},
    # Gao et al. 2025: a soft sigmoid gate instead of the clip, faster decay for negative advantages.
    "sapo": {"advantage": "grpo", "policy_loss": "sapo", "loss_agg": "seq-mean-token-mean", "kl": {"coef": 0.0},
             "policy_loss_kwargs": {"tau_pos": 1.0, "tau_neg": 1.05}},
    # Qi et al. 2026: a trust region on the sampled token's probability change (binary TV), not the ratio.
    "dppo": {"advantage": "grpo", "policy_loss": "dppo_tv", "loss_agg": "token-mean", "kl": {"coef": 0.0},
             "clip": {"low": 0.2, "high": 0.2}},
}


class GRPOConfig(RLConfig):
    """Critic-free RL: GRPO, Dr. GRPO, RLOO, REINFORCE(++), ReMax, DAPO, GSPO, CISPO, GMPO, SAPO, DPPO; ``algorithm`` fills in a named
    method's settings (explicit keys still win)."""

    type: Literal["grpo"] = Field("grpo", description="the stage type")
    algorithm: Literal["grpo", "dr_grpo", "rloo", "reinforce", "reinforce_pp", "reinforce_pp_paper", "remax", "dapo",
                       "gspo", "cispo", "gmpo", "sapo", "dppo"] | None = Field(
        None, description="a preset: the named method's advantage, loss aggregation, KL, clip and shaping")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("algorithm"):
            preset = PRESETS.get(data["algorithm"])
            if preset is not None:
                return deep_merge(preset, data)
        return data

    @model_validator(mode="after")
    def _no_critic_needed(self) -> GRPOConfig:
        if "values" in ADVANTAGE_ESTIMATORS.needs(self.advantage):
            raise ValueError(f"advantage {self.advantage!r} needs a critic's values: use the ppo stage")
        if self.critic is not None:
            raise ValueError("a critic makes the stage PPO: use the ppo stage (type: ppo)")
        return self


class PPORolloutConfig(RolloutConfig):
    """PPO's sampling: one completion per prompt by default (the critic is the baseline)."""

    group_size: int = Field(1, ge=1, description="completions per prompt (PPO's critic is the baseline: 1)")


class PPOKLConfig(KLConfig):
    """PPO's KL penalty: in the reward per token (Ziegler et al.), k1, beta 0.05 to start."""

    coef: float = Field(0.05, ge=0, description="beta (the starting value under the adaptive controller); 0: off")
    estimator: str = Field("k1", description="per-token KL estimator: k1 (Ziegler et al.), k2, k3 (Schulman)")
    in_reward: bool = Field(True, description="subtract beta * KL from the reward per token instead of adding "
                                              "it to the loss")


class PPOConfig(RLConfig):
    """PPO-RLHF with a critic (InstructGPT): GAE advantages from the critic's values, the KL in the reward
    per token, the clipped value loss beside the clipped surrogate."""

    type: Literal["ppo"] = Field("ppo", description="the stage type")
    data: PromptDataConfig = Field(default_factory=lambda: PromptDataConfig(task=TaskSource()),
                                   description="the prompts")
    rollout: PPORolloutConfig = Field(default_factory=PPORolloutConfig, description="how completions are sampled")
    rewards: list[RewardSpec] = Field(default_factory=list, description="the score: usually the reward model")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="the value model")  # type: ignore[assignment]
    kl: PPOKLConfig = Field(default_factory=PPOKLConfig, description="the KL penalty: in the reward per token, "
                                                                     "beta fixed or adapted toward a target")
    advantage: str = Field("gae", description="an advantage estimator that reads the critic's values")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda")
    whiten_advantages: bool = Field(True, description="whiten GAE advantages over the (global) batch")
    loss_agg: str = Field("token-mean", description="how per-token losses become one (LOSS_AGGREGATIONS)")
    num_iterations: int = Field(4, ge=1, validation_alias=AliasChoices("num_iterations", "ppo_epochs"),
                                description="passes over each rollout batch (PPO's epochs; ppo_epochs also works)")

    @model_validator(mode="after")
    def _consistent(self) -> PPOConfig:
        if "values" not in ADVANTAGE_ESTIMATORS.needs(self.advantage):
            raise ValueError(f"the ppo stage trains a critic for its advantage: {self.advantage!r} reads no values "
                             "(use gae, or the grpo stage)")
        check_shared_backbone(self.critic, self.model)
        return self

    def advantage_hparams(self) -> dict[str, Any]:
        return {"gamma": self.gamma, "lam": self.lam, "whiten": self.whiten_advantages, **self.advantage_kwargs}
