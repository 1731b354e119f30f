"""The critic-free policy-gradient family: GRPO, Dr. GRPO, RLOO, REINFORCE, REINFORCE++, ReMax, DAPO.

One step reads: sample a prompt batch -> generate ``group_size`` completions per prompt ->
score them with the reward functions -> old / reference log-probs -> advantages (a registry
estimator) -> ``num_iterations`` passes of minibatch updates with a registry policy loss.
The algorithm is configuration (``advantage``, ``kl``, ``clip``, ``loss_agg``); ``algorithm:``
presets fill those in for the named methods (explicit keys still win).

How it departs from the papers: the KL estimators, the clipped surrogate, the aggregation
and the advantages are exactly as in ``tether.core``; generation happens with the live policy
weights (no separate inference engine), so "old" log-probs are recomputed by a forward pass
when more than one update uses a rollout, and equal the current log-probs (ratio 1)
otherwise, as in TRL and verl.
"""

from __future__ import annotations

import copy
import logging
import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, field_validator, model_validator

from tether.config import StageConfig, StrictModel, TaskSource, known_name
from tether.core.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, AdvantageOutputs
from tether.core.aggregation import LOSS_AGGREGATIONS, agg_loss, num_seqs, num_tokens
from tether.core.kl import KL_ESTIMATORS, kl_penalty
from tether.core.policy_loss import POLICY_LOSSES
from tether.data import load_records, tokenize_prompts
from tether.data.prefix_sharing import sequence_token_logprobs
from tether.pipeline import deep_merge
from tether.rewards import RewardComposer, RewardSpec
from tether.rewards.ray_scoring import RayRewardComposer
from tether.rewards.shaping import overlong_penalty
from tether.rollout import Rollout, SamplingParams
from tether.rollout.engines import build_engine
from tether.tasks import get_task, rl_records
from tether.trainers.loop import Trainer
from tether.trainers.parallel import full_parameters, global_advantages

log = logging.getLogger(__name__)

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
    # Li et al. 2023: a greedy rollout per prompt is the baseline.
    "remax": {"advantage": "remax", "loss_agg": "token-mean", "kl": {"coef": 0.0}},
    # Yu et al. 2025: clip-higher, token-level loss, dynamic sampling, overlong shaping, no KL.
    "dapo": {"advantage": "grpo", "loss_agg": "token-mean", "kl": {"coef": 0.0},
             "clip": {"low": 0.2, "high": 0.28}, "dynamic_sampling": {"enabled": True},
             "overlong": {"buffer": 16, "penalty": 1.0}},
}


class SamplingConfig(StrictModel):
    """How completions are sampled (the RL and the online preference trainers' rollouts)."""

    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(64, ge=1)
    stop: list[str] = Field(default_factory=list)
    engine_batch_size: int | None = Field(None, ge=1)


class RolloutConfig(SamplingConfig):
    group_size: int = Field(8, ge=1, description="completions per prompt")
    mask_truncated: bool = Field(False, description="no loss on completions cut at max_new_tokens (DAPO)")
    engine: Literal["hf", "vllm", "ray"] = Field("hf", description="hf: in process; vllm: colocated on the GPU "
                                                 "(extra tether[vllm]); ray: rollout workers (extra tether[ray])")
    workers: int = Field(2, ge=1, description="ray engine: rollout worker actors")
    engine_options: dict[str, Any] = Field(default_factory=dict, description="vllm: vllm.LLM arguments "
                                           "(gpu_memory_utilization, ...); ray: num_cpus, num_gpus, address")


class KLConfig(StrictModel):
    coef: float = Field(0.0, ge=0)
    estimator: str = "k3"
    in_reward: bool = Field(False, description="subtract coef*KL from the reward instead of adding it to the loss")

    @field_validator("estimator")
    @classmethod
    def _known(cls, value: str) -> str:
        return known_name(KL_ESTIMATORS, value)


class ClipConfig(StrictModel):
    low: float = Field(0.2, ge=0)
    high: float = Field(0.2, ge=0)
    dual: float | None = Field(None, gt=1)


class OverlongConfig(StrictModel):
    """DAPO soft overlong punishment inside ``buffer`` tokens before ``rollout.max_new_tokens``."""

    buffer: int = Field(16, ge=1)
    penalty: float = Field(1.0, ge=0)


class DynamicSamplingConfig(StrictModel):
    enabled: bool = False
    max_rounds: int = Field(4, ge=1, description="generation rounds per step before giving up filling")


class RLDataConfig(StrictModel):
    """Prompts with their answers: a ``prompt_answer`` file, or a task generator."""

    path: str | None = None
    task: TaskSource | None = None
    chat: bool = False
    prompt_template: str = Field("{prompt}", description="e.g. '{prompt}<think>' for an R1-Zero template")

    @model_validator(mode="after")
    def _one_source(self) -> RLDataConfig:
        if "{prompt}" not in self.prompt_template:
            raise ValueError("data.prompt_template must contain '{prompt}'")
        if (self.path is None) == (self.task is None):
            raise ValueError("data needs exactly one of 'path' or 'task'")
        return self


class RewardConfig(StrictModel):
    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = Field(default_factory=dict)


class UpdateLayoutConfig(StrictModel):
    """How a rollout batch is cut and laid out for the policy update (the RL and PPO trainers)."""

    mini_batches: int = Field(1, ge=1, description="optimiser steps per pass over a rollout batch")
    micro_batch_size: int | None = Field(None, ge=1, description="samples per forward/backward")
    row_tokens: int = Field(1024, ge=16, description="tokens per packed row in the update forward")
    prefix_sharing: bool | Literal["auto"] = Field(
        True, description="the update forward computes a prompt shared by a group's completions once (sdpa / "
                          "eager attention; others ignore it); auto: only where a cost model says it is cheaper "
                          "(not on narrow models with short prompts)")


class GRPOConfig(UpdateLayoutConfig, StageConfig):
    """Critic-free RL. ``train.batch_size`` is prompts per step; each gets ``rollout.group_size`` samples."""

    type: Literal["grpo"] = "grpo"
    algorithm: Literal["grpo", "dr_grpo", "rloo", "reinforce", "reinforce_pp", "remax", "dapo"] | None = None
    data: RLDataConfig = Field(default_factory=lambda: RLDataConfig(task=TaskSource()))
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    rewards: list[RewardConfig] = Field(default_factory=lambda: [RewardConfig(name="accuracy")])
    reward_on_error: Literal["raise", "zero"] = "raise"
    reward_workers: int = Field(0, ge=0, description="score rewards in this many Ray actors (extra tether[ray]); "
                                                     "0: in process")
    advantage: str = "grpo"
    advantage_kwargs: dict[str, Any] = Field(default_factory=dict)
    policy_loss: str = "ppo_clip"
    loss_agg: str = "seq-mean-token-mean"
    kl: KLConfig = Field(default_factory=KLConfig)
    clip: ClipConfig = Field(default_factory=ClipConfig)
    entropy_coef: float = 0.0
    num_iterations: int = Field(1, ge=1, description="passes over each rollout batch (GRPO's mu)")
    overlong: OverlongConfig | None = None
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    sample_every: int = Field(10, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("algorithm"):
            preset = PRESETS.get(data["algorithm"])
            if preset is not None:
                return deep_merge(preset, data)
        return data

    @model_validator(mode="after")
    def _known_names(self) -> GRPOConfig:
        known_name(ADVANTAGE_ESTIMATORS, self.advantage)
        known_name(POLICY_LOSSES, self.policy_loss)
        known_name(LOSS_AGGREGATIONS, self.loss_agg)
        if self.overlong is not None and self.overlong.buffer > self.rollout.max_new_tokens:
            raise ValueError(f"overlong.buffer ({self.overlong.buffer}) must be <= rollout.max_new_tokens "
                             f"({self.rollout.max_new_tokens})")
        if self.advantage == "gae":
            raise ValueError("advantage 'gae' needs a critic: use the PPO trainer")
        return self


def rl_prompt_records(data: RLDataConfig) -> list[dict]:
    if data.path is not None:
        return load_records(data.path)  # prompt_answer rows, or prompts alone for RM / judge rewards
    source = data.task
    return rl_records(get_task(source.name, **source.options), source.n, seed=source.seed)


def prompt_texts(data: RLDataConfig, records: list[dict] | None, stage: str | None) -> tuple[list[dict], list[str]]:
    """The records (given, or from ``data``) and their prompts through ``data.prompt_template``; an
    empty set is an error."""
    records = records if records is not None else rl_prompt_records(data)
    if not records:
        raise ValueError(f"stage {stage!r}: no prompts")
    return records, [data.prompt_template.format(prompt=r["prompt"]) for r in records]


def training_prompts(data: RLDataConfig, records: list[dict] | None, tokenizer: Any, stage: str
                     ) -> tuple[list[dict], list[str], list[list[int]]]:
    """:func:`prompt_texts` and the prompts' token ids (chat-templated with ``data.chat``)."""
    records, prompts = prompt_texts(data, records, stage)
    return records, prompts, tokenize_prompts(prompts, tokenizer, chat=data.chat)


def completion_logprobs(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], *,
                        temperature: float, row_tokens: int, pad_token_id: int, with_entropy: bool = False,
                        entropy_grad: bool = False, share_prompts: bool | Literal["auto"] = True
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of each completion given its prompt, shape (N, C).

    The prompt+completion sequences are packed; with ``share_prompts`` the completions of one prompt
    (a group) share it, so it goes through the model once (:mod:`tether.data.prefix_sharing`);
    ``"auto"``: only where that is cheaper than plain packing (:func:`~tether.data.prefix_sharing.sharing_pays`).
    Position j of row i scores ``completions[i][j]``; positions past a completion's length are 0.
    """
    index: dict[tuple[int, ...], int] = {}
    groups = [index.setdefault(tuple(p), len(index)) for p in prompts] if share_prompts else None
    logps, _, entropy = sequence_token_logprobs(
        model, [p + c for p, c in zip(prompts, completions, strict=True)], first_targets=[len(p) for p in prompts],
        groups=groups, temperature=temperature, row_tokens=row_tokens, pad_token_id=pad_token_id,
        with_entropy=with_entropy, entropy_grad=entropy_grad, only_if_cheaper=share_prompts == "auto")
    return logps, entropy


class RLTrainer(Trainer):
    """Generate -> score -> advantage -> clipped policy-gradient updates, on the shared loop."""

    def __init__(self, config: GRPOConfig, model: torch.nn.Module, tokenizer: Any, run_dir: str | Path, *,
                 records: list[dict] | None = None, reward_functions: list | None = None,
                 stage: str | None = None) -> None:
        super().__init__(config, model, tokenizer, run_dir, stage=stage)
        cfg = self.config
        self.records, self.prompts, self.prompt_ids = training_prompts(cfg.data, records, tokenizer, self.stage)
        self.engine = build_engine(cfg.rollout.engine, model, tokenizer, batch_size=cfg.rollout.engine_batch_size,
                                   workers=cfg.rollout.workers, options=cfg.rollout.engine_options,
                                   worker_model=cfg.model.model_dump(exclude={"lora", "device"}))
        if reward_functions is not None:  # plain callables, RewardSpecs or {name, weight, kwargs} dicts
            specs = [f if isinstance(f, RewardSpec | dict) else RewardSpec(f) for f in reward_functions]
        else:
            specs = [RewardSpec(r.name, r.weight, dict(r.kwargs)) for r in cfg.rewards]
        if getattr(cfg, "reward_workers", 0):  # the same composer, its batches scored by Ray actors
            self.rewards = RayRewardComposer(specs, on_error=cfg.reward_on_error, num_workers=cfg.reward_workers)
        else:
            self.rewards = RewardComposer(specs, on_error=cfg.reward_on_error)
        self.ref_model = self._reference_model()
        self.running_baseline: torch.Tensor | None = None
        self.prompt_cursor = 0

    # ---- set-up ------------------------------------------------------------------------------
    def total_updates(self) -> int:
        cfg = self.config
        return cfg.train.max_steps * cfg.num_iterations * cfg.mini_batches

    def _reference_model(self) -> torch.nn.Module | None:
        """A frozen copy of the initial policy, only when a KL term is used; none under LoRA."""
        if self.config.kl.coef == 0:
            return None
        if hasattr(self.model, "disable_adapter"):
            return None  # LoRA: the base model with the adapter disabled is the reference
        ref = copy.deepcopy(self.model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def extra_state(self) -> dict[str, Any]:
        return {"running_baseline": self.running_baseline, "prompt_cursor": self.prompt_cursor}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.running_baseline = state.get("running_baseline")
        self.prompt_cursor = state.get("prompt_cursor", 0)

    # ---- generate and score ---------------------------------------------------------------------
    def next_prompts(self, count: int) -> list[int]:
        """The next ``count`` prompt indices of a per-epoch shuffled order (seeded, resumable).

        Under torchrun the order is shared and dealt round-robin: a draw takes ``count * world_size``
        positions and rank r the r-th of every ``world_size``, so the ranks' prompts together are
        the single-process batch and ``prompt_cursor`` (positions used) is the same on every rank.
        """
        out = []
        n = len(self.records)
        rank, world = self.dist.rank, self.dist.world_size
        for i in range(count):
            epoch, offset = divmod(self.prompt_cursor + i * world + rank, n)
            order = list(range(n))
            random.Random(f"{self.config.train.seed}:{epoch}").shuffle(order)
            out.append(order[offset])
        self.prompt_cursor += count * world
        return out

    def sampling_params(self, round_index: int) -> SamplingParams:
        r = self.config.rollout
        seed = self.config.train.seed * 1_000_003 + self.step * 101 + round_index
        return SamplingParams(n=r.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, stop=list(r.stop), seed=seed)

    def score(self, indices: list[int], rollout: Rollout) -> tuple[torch.Tensor, dict[str, float]]:
        records = [self.records[indices[i]] for i in rollout.prompt_index]
        prompts = [self.prompts[indices[i]] for i in rollout.prompt_index]
        columns = {k: [r.get(k) for r in records] for k in records[0] if k != "prompt"}
        result = self.rewards.score(prompts, rollout.texts, columns)
        rewards = result.total.clone()
        if self.config.overlong is not None:
            lengths = torch.tensor([len(c) for c in rollout.completion_ids], dtype=torch.float32)
            rewards = rewards + overlong_penalty(lengths, max_length=self.config.rollout.max_new_tokens,
                                                 buffer=self.config.overlong.buffer,
                                                 penalty=self.config.overlong.penalty)
        return rewards, result.metrics()

    def collect(self) -> tuple[list[int], Rollout, torch.Tensor, dict[str, float]]:
        """One step's rollouts; with dynamic sampling, groups whose rewards are all equal are
        dropped and more prompts are sampled until the batch is full (or ``max_rounds``)."""
        cfg = self.config
        want, size = cfg.train.batch_size, cfg.rollout.group_size
        dynamic = cfg.dynamic_sampling.enabled
        kept_idx: list[int] = []
        kept: list[Rollout] = []
        kept_rewards: list[torch.Tensor] = []
        metrics: dict[str, float] = {}
        dropped = 0
        for round_index in range(cfg.dynamic_sampling.max_rounds if dynamic else 1):
            indices = self.next_prompts(want - len(kept_idx))
            with full_parameters(self.model):  # FSDP2 (re-entrant): whole weights while decoding
                rollout = self.engine.generate([self.prompt_ids[i] for i in indices],
                                               self.sampling_params(round_index))
            rewards, reward_metrics = self.score(indices, rollout)
            if round_index == 0:
                metrics.update(reward_metrics)
            groups = rewards.view(-1, size)
            informative = ~torch.isclose(groups.nan_to_num(0.0), groups.nan_to_num(0.0)[:, :1]).all(1)
            for g, index in enumerate(indices):
                if dynamic and not informative[g] and round_index < cfg.dynamic_sampling.max_rounds - 1:
                    dropped += 1
                    continue
                kept_idx.append(index)
                kept.append(rollout.select(range(g * size, (g + 1) * size)))
                kept_rewards.append(groups[g])
            if len(kept_idx) >= want:
                break
        if dynamic:
            metrics["dynamic_sampling/dropped_groups"] = dropped
        return kept_idx, Rollout.concat(kept), torch.cat(kept_rewards), metrics

    def remax_baseline(self, indices: list[int], rollout: Rollout) -> torch.Tensor:
        """ReMax: the reward of one greedy completion per prompt, repeated over its group."""
        with full_parameters(self.model):
            greedy = self.engine.generate([self.prompt_ids[i] for i in indices],
                                          SamplingParams(greedy=True, max_new_tokens=self.config.rollout.max_new_tokens))
        baseline, _ = self.score(indices, greedy)
        return baseline.nan_to_num(0.0).repeat_interleave(self.config.rollout.group_size).to(self.device)

    # ---- log-probs -------------------------------------------------------------------------------
    def logprobs(self, model: torch.nn.Module, rollout: Rollout, rows: torch.Tensor, *,
                 with_entropy: bool = False, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = rows.tolist()
        width = max(len(c) for c in rollout.completion_ids)
        logps, entropy = completion_logprobs(
            model, [rollout.prompt_ids[i] for i in ids], [rollout.completion_ids[i] for i in ids],
            temperature=self.config.rollout.temperature, row_tokens=self.config.row_tokens,
            pad_token_id=self.tokenizer.pad_token_id, with_entropy=with_entropy, entropy_grad=entropy_grad,
            share_prompts=self.config.prefix_sharing)
        pad = width - logps.shape[1]
        if pad:
            logps = torch.nn.functional.pad(logps, (0, pad))
            entropy = torch.nn.functional.pad(entropy, (0, pad)) if entropy is not None else None
        return logps, entropy

    @torch.no_grad()
    def frozen_logprobs(self, rollout: Rollout, *, reference: bool) -> torch.Tensor:
        """Old-policy or reference log-probs for the whole rollout, in micro-batches."""
        self.model.eval()
        context = nullcontext()
        model = self.model
        if reference:
            if self.ref_model is not None:
                model = self.ref_model
            else:
                context = self.model.disable_adapter()
        chunks = []
        with context:
            for rows in self.micro_batches(torch.arange(len(rollout))):
                chunks.append(self.logprobs(model, rollout, rows)[0])
        return torch.cat(chunks)

    def micro_batches(self, rows: torch.Tensor) -> list[torch.Tensor]:
        size = self.config.micro_batch_size or len(rows)
        return list(rows.split(size))

    # ---- the step ---------------------------------------------------------------------------------
    def training_step(self) -> dict[str, Any]:
        cfg = self.config
        start = time.perf_counter()
        with full_parameters(self.model):  # FSDP2: whole weights while this rank decodes its share
            indices, rollout, rewards, metrics = self.collect()
        gen_time = time.perf_counter() - start
        mask, truncated, rewards = self.rollout_tensors(rollout, rewards)
        valid = ~torch.isnan(rewards)
        if cfg.rollout.mask_truncated:
            mask = mask * (~truncated).float()[:, None]
        mask = mask * valid.float()[:, None]
        rewards = torch.where(valid, rewards, rewards.view(-1, cfg.rollout.group_size).nanmean(1)
                              .nan_to_num(0.0).repeat_interleave(cfg.rollout.group_size))

        reuse = cfg.num_iterations > 1 or cfg.mini_batches > 1
        old = self.frozen_logprobs(rollout, reference=False) if reuse else None
        ref = self.frozen_logprobs(rollout, reference=True) if cfg.kl.coef > 0 else None
        token_rewards = None
        if ref is not None and cfg.kl.in_reward:
            behaviour = old if old is not None else self.frozen_logprobs(rollout, reference=False)
            token_rewards = -cfg.kl.coef * kl_penalty(behaviour, ref, cfg.kl.estimator) * mask
        baseline = self.remax_baseline(indices, rollout) if cfg.advantage == "remax" else None
        adv = self.advantages(
            rollout,
            AdvantageInputs(rewards=rewards, mask=mask, group_size=cfg.rollout.group_size,
                            token_rewards=token_rewards, baseline_rewards=baseline,
                            running_baseline=self.running_baseline))
        if "running_baseline" in adv.state:
            self.running_baseline = adv.state["running_baseline"]

        update_metrics = self.minibatch_updates(
            mask, cfg.num_iterations, lambda rows, d: self.loss(rollout, rows, mask, adv.advantages, old, ref, d))

        elapsed = time.perf_counter() - start
        lengths = mask.new_tensor([len(c) for c in rollout.completion_ids])
        metrics.update({f"advantage/{k}": v for k, v in adv.metrics.items()})
        metrics.update(update_metrics)
        metrics.update({
            "reward/mean": rewards[valid].mean() if valid.any() else float("nan"),
            "reward/std": rewards[valid].std() if valid.sum() > 1 else 0.0,
            "completion/length_mean": lengths.mean(), "completion/length_max": lengths.max(),
            "completion/truncated_frac": truncated.float().mean(),
            "time/generation": gen_time, "completions_per_s": len(rollout) / elapsed,
        })
        if self.step % cfg.sample_every == 0:
            self.logger.write_samples(self.step, [
                {"prompt": self.records[indices[rollout.prompt_index[i]]]["prompt"],
                 "completion": rollout.texts[i], "reward": float(rewards[i])} for i in range(min(8, len(rollout)))])
        return metrics

    def rollout_tensors(self, rollout: Rollout, rewards: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The completion mask (N, C) as floats, the truncation flags (N,) and ``rewards`` (N,), on the
        model's device, beside the log-probs they are combined with."""
        device = self.device
        mask = rollout.to_padded(self.tokenizer.pad_token_id, device)["completion_mask"].float()
        truncated = torch.tensor([r == "length" for r in rollout.finish_reasons], device=device)
        return mask, truncated, rewards.to(device)

    def minibatch_updates(self, mask: torch.Tensor, passes: int,
                          loss: Callable[[torch.Tensor, dict[str, float]], tuple[torch.Tensor, dict]]
                          ) -> dict[str, float]:
        """``passes`` passes over the rollout's rows (``mask`` is (N, C)), each in ``mini_batches``
        shuffled minibatches of one optimiser step; ``loss(rows, denominators)`` with the minibatch's
        global token and sequence counts. Returns the last step's metrics."""
        out: dict[str, float] = {}
        shuffle = torch.Generator().manual_seed(self.config.train.seed * 7919 + self.step)  # a pure function of the step
        for _ in range(passes):
            for minibatch in torch.randperm(mask.shape[0], generator=shuffle).chunk(self.config.mini_batches):
                denominators = {"global_tokens": self.global_count(num_tokens(mask[minibatch])),
                                "global_seqs": self.global_count(num_seqs(mask[minibatch]))}
                out = self.optimizer_step(self.micro_batches(minibatch), lambda rows, d=denominators: loss(rows, d))
        return out

    def advantages(self, rollout: Rollout, inputs: AdvantageInputs) -> AdvantageOutputs:
        """The configured estimator; a subclass may add terms that need the rollout (the agent
        trainer's GiGPO step-level advantages)."""
        # under torchrun: on every rank's rollouts gathered (global batch statistics), this rank's rows back
        return global_advantages(self.config.advantage, inputs, **self.config.advantage_kwargs)

    def loss(self, rollout: Rollout, rows: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
             old: torch.Tensor | None, ref: torch.Tensor | None, denominators: dict[str, float]
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.config
        logps, entropy = self.logprobs(self.model, rollout, rows, with_entropy=True,
                                       entropy_grad=bool(cfg.entropy_coef))
        m = mask[rows]
        agg = {"global_tokens": denominators["global_tokens"], "global_seqs": denominators["global_seqs"],
               "norm_constant": cfg.rollout.max_new_tokens}
        old_rows = old[rows] if old is not None else logps.detach()
        loss, metrics = POLICY_LOSSES.get(cfg.policy_loss)(
            logps, old_rows, advantages[rows], m, clip_low=cfg.clip.low, clip_high=cfg.clip.high,
            dual_clip=cfg.clip.dual, loss_agg=cfg.loss_agg, **agg)
        metrics = {f"policy/{k}": v for k, v in metrics.items()}
        metrics["policy/loss"] = loss.detach()
        if ref is not None:
            kl = kl_penalty(logps, ref[rows], cfg.kl.estimator)
            kl_term = agg_loss(kl, m, cfg.loss_agg, **agg)
            metrics["kl"] = (kl.detach() * m).sum() / m.sum().clamp(min=1)
            if not cfg.kl.in_reward:
                loss = loss + cfg.kl.coef * kl_term
        if entropy is not None:
            ent_term = agg_loss(entropy, m, cfg.loss_agg, **agg)
            metrics["entropy"] = (entropy.detach() * m).sum() / m.sum().clamp(min=1)
            if cfg.entropy_coef:
                loss = loss - cfg.entropy_coef * ent_term
        return loss, metrics
