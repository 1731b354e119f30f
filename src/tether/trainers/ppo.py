"""PPO-RLHF, the InstructGPT loop: policy, frozen reference, reward model and a learned critic.

One step reads: sample a prompt batch -> ``rollout.group_size`` completions per prompt (1 by
default) -> score them with the reward functions (the reward model) -> old and reference log-probs
and the critic's values -> per-token rewards r_t = -beta * KL_t, plus the shaped score on the last
completion token -> GAE advantages and returns (the ``gae`` registry estimator) -> ``ppo_epochs``
passes of ``mini_batches`` updates of the clipped surrogate + the clipped value loss -> the KL
controller moves beta. Generation, scoring and log-probs are ``RLTrainer``'s.

Papers: Ziegler et al. 2019 (KL in the reward per token, the adaptive controller), Stiennon et
al. 2020 and Ouyang et al. 2022 (InstructGPT), Schulman et al. 2017 (PPO) and 2016 (GAE).

How it departs from them:

- policy and critic form one module trained on ``pg_loss + critic.coef * value_loss`` by one
  optimiser (a parameter group each, with its own learning rate) under one gradient-norm clip,
  as TRL's PPO trainer does; lm-human-preferences and OpenRLHF step two optimisers.
- no pretraining-mix term (InstructGPT's PPO-ptx).
- the KL in the reward uses the behaviour policy's log-probs, recomputed by a forward pass after
  generation (as ``RLTrainer`` does), not the sampler's.
- the score is shaped before it enters the reward, in this order: normalised (``reward_norm``:
  batch whitening, or running mean / std as lm-human-preferences' reward normalisation, which fixes
  its gain once on the initial policy), clipped to ``[-reward_clip, reward_clip]``, then
  ``missing_eos_penalty`` subtracted from completions cut at ``rollout.max_new_tokens`` (TRL's).
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, field_validator, model_validator

from tether.config import StageConfig, StrictModel, known_name
from tether.core.advantages import AdvantageInputs, compute_advantages
from tether.core.aggregation import LOSS_AGGREGATIONS, masked_mean
from tether.core.kl import KL_CONTROLLERS, KL_ESTIMATORS, kl_penalty
from tether.core.policy_loss import POLICY_LOSSES, value_loss_clipped
from tether.data import tokenize_prompts
from tether.models.value_model import (
    ActorCritic,
    SharedLoraActorCritic,
    completion_values,
    load_value_model,
    value_model_from,
)
from tether.rewards import RewardComposer, RewardSpec
from tether.rollout import HFEngine, Rollout, SamplingParams
from tether.tasks import eval_records, get_task
from tether.trainers.rl import (
    ClipConfig,
    DynamicSamplingConfig,
    RewardConfig,
    RLDataConfig,
    RLTrainer,
    RolloutConfig,
    UpdateLayoutConfig,
)

log = logging.getLogger(__name__)


class PPOKLConfig(StrictModel):
    """The KL penalty in the reward: r_t -= beta * KL_t, beta fixed or adapted toward a target KL."""

    coef: float = Field(0.05, ge=0, description="beta (the starting value under the adaptive controller)")
    estimator: str = Field("k1", description="per-token KL estimator: k1 (Ziegler et al.), k3, k2")
    controller: Literal["fixed", "adaptive"] = "fixed"
    target: float = Field(6.0, gt=0, description="adaptive: target KL per completion, nats")
    horizon: int = Field(10000, ge=1, description="adaptive: K_beta = batch size / horizon")

    @field_validator("estimator")
    @classmethod
    def _known(cls, value: str) -> str:
        return known_name(KL_ESTIMATORS, value)


class CriticConfig(StrictModel):
    """The value model: from the reward model (InstructGPT) or the policy, or a path."""

    init: Literal["reward_model", "policy"] = "reward_model"
    name_or_path: str | None = Field(None, description="a reward / value / causal-LM checkpoint; overrides init")
    lr: float | None = Field(None, gt=0, description="the critic's learning rate; None: optim.lr")
    coef: float = Field(0.1, ge=0, description="weight of the value loss in the joint loss (vf_coef)")
    clip_range: float | None = Field(0.2, gt=0, description="value clipping around the rollout values; None: off")
    share_backbone: bool = Field(False, description="one base model: policy and value LoRA adapters "
                                                    "(needs model.lora); the reference is the adapter-free base")
    seed: int = Field(0, description="initialises a new value head")


class PPORolloutConfig(RolloutConfig):
    group_size: int = Field(1, ge=1, description="completions per prompt (PPO's critic is the baseline: 1)")


class PPOConfig(UpdateLayoutConfig, StageConfig):
    """PPO with a critic. ``train.batch_size`` is prompts per step; each gets ``rollout.group_size`` samples."""

    type: Literal["ppo"] = "ppo"
    data: RLDataConfig = Field(default_factory=lambda: RLDataConfig(task={}))
    rollout: PPORolloutConfig = Field(default_factory=PPORolloutConfig)
    rewards: list[RewardConfig] = Field(default_factory=list, description="the score: usually the reward model")
    gold: RewardConfig | None = Field(None, description="a reward only logged (reward/gold), never trained on")
    reward_on_error: Literal["raise", "zero"] = "raise"
    kl: PPOKLConfig = Field(default_factory=PPOKLConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    whiten_advantages: bool = True
    reward_norm: Literal["none", "batch", "running"] = "none"
    reward_clip: float | None = Field(None, gt=0)
    missing_eos_penalty: float | None = Field(None, ge=0, description="subtracted when a completion has no EOS")
    policy_loss: str = "ppo_clip"
    loss_agg: str = "token-mean"
    clip: ClipConfig = Field(default_factory=ClipConfig)
    entropy_coef: float = 0.0
    ppo_epochs: int = Field(4, ge=1, description="passes over each rollout batch")
    sample_every: int = Field(10, ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> PPOConfig:
        known_name(POLICY_LOSSES, self.policy_loss)
        known_name(LOSS_AGGREGATIONS, self.loss_agg)
        if self.critic.share_backbone:
            if self.model.lora is None:
                raise ValueError("critic.share_backbone needs model.lora: the policy and value adapters live on it")
            if self.critic.init == "reward_model" or self.critic.name_or_path:
                raise ValueError("critic.share_backbone builds the critic on the policy's base model: "
                                 "set critic.init: policy and no critic.name_or_path")
        return self

    # What RLTrainer's generate / score code reads; no dynamic sampling or DAPO overlong shaping here.
    @property
    def dynamic_sampling(self) -> DynamicSamplingConfig:
        return DynamicSamplingConfig()

    @property
    def overlong(self) -> None:
        return None

    def reward_model_path(self) -> str | None:
        """The ``path`` of the first ``reward_model`` reward, where the critic is initialised from."""
        return next((r.kwargs.get("path") for r in self.rewards if r.name == "reward_model"), None)


class RunningMoments:
    """Running mean and variance of every score seen (Chan et al.'s parallel update), for ``reward_norm``."""

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 0

    def update(self, x: torch.Tensor) -> None:
        n = x.numel()
        if n == 0:
            return
        mean, var = float(x.mean()), float(x.var(correction=0))
        total = self.count + n
        delta = mean - self.mean
        self.var = (self.var * self.count + var * n + delta**2 * self.count * n / total) / total
        self.mean += delta * n / total
        self.count = total

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], int(state["count"])


def shape_scores(scores: torch.Tensor, truncated: torch.Tensor, *, norm: str, clip: float | None,
                 missing_eos_penalty: float | None, moments: RunningMoments | None = None,
                 eps: float = 1e-8) -> torch.Tensor:
    """Scores (B,) -> the outcome reward (B,): normalised, clipped, minus the no-EOS penalty.

    ``norm``: "none"; "batch" (whitened over this batch); "running" (by the running mean / std of
    every score so far, ``moments`` updated with this batch first). ``truncated``: shape (B,), bool.
    """
    out = scores.float()
    if norm == "batch" and out.numel() > 1:
        out = (out - out.mean()) / (out.std(correction=0) + eps)
    elif norm == "running":
        moments.update(out)
        out = (out - moments.mean) / (moments.var**0.5 + eps)
    if clip is not None:
        out = out.clamp(-clip, clip)
    if missing_eos_penalty:
        out = out - missing_eos_penalty * truncated.float()
    return out


class PPOTrainer(RLTrainer):
    """Generate -> score -> KL-penalised per-token reward -> GAE -> clipped policy and value updates."""

    def __init__(self, config: PPOConfig, model: torch.nn.Module, tokenizer: Any, run_dir: str | Path, *,
                 critic: Any = None, records: list[dict] | None = None, reward_functions: list | None = None,
                 gold_functions: list | None = None, stage: str | None = None) -> None:
        if not (reward_functions or config.rewards):
            raise ValueError("PPO needs a reward: config.rewards (e.g. {name: reward_model, kwargs: {path: ...}}) "
                             "or reward_functions")
        if not isinstance(model, ActorCritic | SharedLoraActorCritic):
            model = build_actor_critic(config, model, tokenizer, critic, reward_functions)
        super().__init__(config, model, tokenizer, run_dir, records=records, reward_functions=reward_functions,
                         stage=stage)
        cfg = self.config
        self.engine = HFEngine(model.generator, tokenizer, batch_size=cfg.rollout.engine_batch_size)
        kl = cfg.kl
        self.kl_controller = KL_CONTROLLERS.get(kl.controller)(kl.coef, target=kl.target, horizon=kl.horizon)
        self.moments = RunningMoments()
        gold = gold_functions if gold_functions is not None else (
            [RewardSpec(cfg.gold.name, cfg.gold.weight, dict(cfg.gold.kwargs))] if cfg.gold else [])
        self.gold = RewardComposer([g if isinstance(g, RewardSpec | dict) else RewardSpec(g) for g in gold],
                                   on_error=cfg.reward_on_error) if gold else None

    # ---- set-up ------------------------------------------------------------------------------
    def total_updates(self) -> int:
        return self.config.train.max_steps * self.config.ppo_epochs * self.config.mini_batches

    def optimizer_parts(self) -> list[tuple[list[torch.nn.Parameter], float]]:
        policy, critic = self.model.parts()
        optim = self.config.optim
        return [(policy, optim.lr), (critic, self.config.critic.lr or optim.lr)]

    def _reference_model(self) -> torch.nn.Module | None:
        """A frozen copy of the initial policy, always (KL is logged even at beta = 0); none under LoRA."""
        policy = self.model.generator
        if hasattr(policy, "disable_adapter"):
            return None  # the base model with adapters disabled is the reference
        ref = copy.deepcopy(policy).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def load_model_weights(self, checkpoint: Path) -> None:
        self.model.load_pretrained_weights(checkpoint)

    def extra_state(self) -> dict[str, Any]:
        return {**super().extra_state(), "kl_controller": self.kl_controller.state_dict(),
                "reward_moments": self.moments.state_dict()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        super().load_extra_state(state)
        if "kl_controller" in state:
            self.kl_controller.load_state_dict(state["kl_controller"])
            self.moments.load_state_dict(state["reward_moments"])

    # ---- values -----------------------------------------------------------------------------
    def values(self, rollout: Rollout, rows: torch.Tensor) -> torch.Tensor:
        """V(s_t) of the given samples' completion tokens, shape (len(rows), longest completion of the rollout)."""
        ids = rows.tolist()
        width = max(len(c) for c in rollout.completion_ids)
        values = completion_values(self.model, [rollout.prompt_ids[i] for i in ids],
                                   [rollout.completion_ids[i] for i in ids], row_tokens=self.config.row_tokens,
                                   pad_token_id=self.tokenizer.pad_token_id)
        return torch.nn.functional.pad(values, (0, width - values.shape[1]))

    @torch.no_grad()
    def frozen_values(self, rollout: Rollout) -> torch.Tensor:
        self.model.eval()
        return torch.cat([self.values(rollout, rows) for rows in self.micro_batches(torch.arange(len(rollout)))])

    def score_with(self, composer: RewardComposer, indices: list[int], rollout: Rollout) -> torch.Tensor:
        """One value per sample from ``composer`` (NaN where it gives none)."""
        records = [self.records[indices[i]] for i in rollout.prompt_index]
        prompts = [self.prompts[indices[i]] for i in rollout.prompt_index]
        columns = {k: [r.get(k) for r in records] for k in records[0] if k != "prompt"}
        return composer.score(prompts, rollout.texts, columns).total

    # ---- the step ---------------------------------------------------------------------------
    def training_step(self) -> dict[str, Any]:
        cfg = self.config
        start = time.perf_counter()
        indices, rollout, scores, metrics = self.collect()
        gen_time = time.perf_counter() - start
        mask, truncated, scores = self.rollout_tensors(rollout, scores)
        valid = ~torch.isnan(scores)
        mask = mask * valid.float()[:, None]
        old = self.frozen_logprobs(rollout, reference=False)
        ref = self.frozen_logprobs(rollout, reference=True)
        old_values = self.frozen_values(rollout)
        kl = torch.where(mask != 0, kl_penalty(old, ref, cfg.kl.estimator), 0.0)
        beta = self.kl_controller.value
        outcome = shape_scores(scores.nan_to_num(0.0), truncated, norm=cfg.reward_norm, clip=cfg.reward_clip,
                               missing_eos_penalty=cfg.missing_eos_penalty, moments=self.moments)
        adv = compute_advantages("gae", AdvantageInputs(
            rewards=outcome, mask=mask, group_size=cfg.rollout.group_size, token_rewards=-beta * kl,
            values=old_values), gamma=cfg.gamma, lam=cfg.lam, whiten=cfg.whiten_advantages)
        update_metrics = self.update(rollout, mask, adv.advantages, adv.returns, old, old_values)

        sequence_kl = kl.sum(1)[valid].mean() if valid.any() else torch.tensor(0.0)
        self.kl_controller.update(float(sequence_kl), int(valid.sum()))
        metrics.update({f"advantage/{k}": v for k, v in adv.metrics.items()})
        metrics.update(update_metrics)
        metrics.update(self.rollout_metrics(rollout, scores, valid, mask, truncated, kl, beta, adv.returns))
        gold = self.score_with(self.gold, indices, rollout) if self.gold is not None else None
        if gold is not None:
            metrics["reward/gold"] = gold.nanmean()
        metrics.update({"time/generation": gen_time,
                        "completions_per_s": len(rollout) / (time.perf_counter() - start)})
        if self.step % cfg.sample_every == 0:
            self.logger.write_samples(self.step, [
                {"prompt": self.records[indices[rollout.prompt_index[i]]]["prompt"], "completion": rollout.texts[i],
                 "reward": float(scores[i]), **({"gold": float(gold[i])} if gold is not None else {})}
                for i in range(min(8, len(rollout)))])
        return metrics

    def rollout_metrics(self, rollout: Rollout, scores: torch.Tensor, valid: torch.Tensor, mask: torch.Tensor,
                        truncated: torch.Tensor, kl: torch.Tensor, beta: float, returns: torch.Tensor
                        ) -> dict[str, Any]:
        """What the rollout looked like: score (proxy) statistics, KL to the reference, lengths, returns."""
        present = scores[valid]
        lengths = mask.new_tensor([len(c) for c in rollout.completion_ids])
        return {
            "reward/mean": present.mean() if present.numel() else float("nan"),
            "reward/std": present.std() if present.numel() > 1 else 0.0,
            "reward/proxy": present.mean() if present.numel() else float("nan"),
            "reward/proxy_std": present.std(correction=0) if present.numel() else float("nan"),
            "kl": masked_mean(kl, mask), "kl/sequence": kl.sum(1)[valid].mean() if valid.any() else 0.0,
            "kl_coef": beta, "returns/mean": masked_mean(returns, mask),
            "completion/length_mean": lengths.mean(), "completion/length_max": lengths.max(),
            "completion/truncated_frac": truncated.float().mean(),
        }

    def update(self, rollout: Rollout, mask: torch.Tensor, advantages: torch.Tensor, returns: torch.Tensor,
               old: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        """``ppo_epochs`` passes of ``mini_batches`` optimiser steps; the last step's metrics."""
        out = self.minibatch_updates(mask, self.config.ppo_epochs, lambda rows, d: self.loss(
            rollout, rows, mask, advantages, returns, old, old_values, d))
        out["lr/critic"] = self.scheduler.get_last_lr()[-1]
        return out

    def loss(self, rollout: Rollout, rows: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
             returns: torch.Tensor, old: torch.Tensor, old_values: torch.Tensor, denominators: dict[str, float]
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Clipped surrogate + critic.coef * clipped value loss - entropy_coef * entropy, for one micro-batch."""
        cfg = self.config
        logps, entropy = self.logprobs(self.model, rollout, rows, with_entropy=True,
                                       entropy_grad=bool(cfg.entropy_coef))
        values = self.values(rollout, rows)
        m = mask[rows]
        agg = {**denominators, "loss_agg": cfg.loss_agg, "norm_constant": cfg.rollout.max_new_tokens}
        pg_loss, pg_metrics = POLICY_LOSSES.get(cfg.policy_loss)(
            logps, old[rows], advantages[rows], m, clip_low=cfg.clip.low, clip_high=cfg.clip.high,
            dual_clip=cfg.clip.dual, **agg)
        vf_loss, vf_metrics = value_loss_clipped(values, old_values[rows], returns[rows], m,
                                                 clip_range=cfg.critic.clip_range, **agg)
        loss = pg_loss + cfg.critic.coef * vf_loss
        metrics = {f"policy/{k}": v for k, v in pg_metrics.items()}
        metrics.update({"policy/loss": pg_loss.detach(), "value/loss": vf_loss.detach(),
                        "value/clip_frac": vf_metrics["value_clip_frac"],
                        "value/explained_variance": vf_metrics["explained_variance"],
                        "value/mean": vf_metrics["value_mean"], "entropy": masked_mean(entropy.detach(), m)})
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * masked_mean(entropy, m)
        return loss, metrics

    # ---- evaluation -------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out figures: greedy task accuracy (``evaluate_task``); the proxy (reward) and gold means of
        ``eval.samples`` completions per prompt sampled as in training (``rollout`` temperature, top-p,
        top-k) and of the greedy completion (``*_greedy``); the sampled completions' KL to the reference
        per completion (k1, summed over tokens)."""
        cfg = self.config
        if cfg.eval is None:
            return {}
        from tether.evaluation import evaluate_task

        # greedy accuracy only: the sampled figures below are this stage's own (no pass@k)
        figures = evaluate_task(self.model.generator, self.tokenizer, cfg.eval.model_copy(update={"samples": 1}))
        records = eval_records(get_task(cfg.eval.task, **cfg.eval.options), cfg.eval.n, seed=cfg.eval.seed)
        prompts = [cfg.data.prompt_template.format(prompt=r["prompt"]) for r in records]
        ids = tokenize_prompts(prompts, self.tokenizer, chat=cfg.data.chat)
        r = cfg.rollout
        sampled = self.engine.generate(ids, SamplingParams(n=cfg.eval.samples, temperature=r.temperature, top_p=r.top_p,
                                                           top_k=r.top_k, max_new_tokens=cfg.eval.max_new_tokens,
                                                           seed=cfg.eval.seed))
        greedy = self.engine.generate(ids, SamplingParams(greedy=True, max_new_tokens=cfg.eval.max_new_tokens))
        for suffix, rollout in (("", sampled), ("_greedy", greedy)):
            prompt_of = [prompts[i] for i in rollout.prompt_index]
            columns = {k: [records[i].get(k) for i in rollout.prompt_index] for k in records[0] if k != "prompt"}
            for name, composer in (("proxy", self.rewards), ("gold", self.gold)):
                if composer is not None:
                    figures[name + suffix] = float(composer.score(prompt_of, rollout.texts, columns).total.nanmean())
        mask = sampled.to_padded(self.tokenizer.pad_token_id, self.device)["completion_mask"].float()
        kl = kl_penalty(self.frozen_logprobs(sampled, reference=False),
                        self.frozen_logprobs(sampled, reference=True), "k1")
        figures["kl"] = float((kl * mask).sum(1).mean())
        return figures


def build_actor_critic(config: PPOConfig, policy: torch.nn.Module, tokenizer: Any, critic: Any = None,
                       reward_functions: list | None = None) -> ActorCritic | SharedLoraActorCritic:
    """Policy + critic. The critic: ``critic`` (a loaded value / reward / causal LM, or a path), else
    ``config.critic.name_or_path``, else by ``config.critic.init`` the reward model (the path of the
    config's ``reward_model`` reward, or a ``RewardModelScorer`` among ``reward_functions``) or the policy."""
    cc = config.critic
    if cc.share_backbone:
        return SharedLoraActorCritic(policy, seed=cc.seed)
    device, seed = config.model.device, cc.seed
    source = critic if critic is not None else cc.name_or_path
    if source is None and cc.init == "reward_model":
        source = config.reward_model_path()
        scorers = [f for f in reward_functions or [] if hasattr(f, "model") and hasattr(f, "score")]
        if source is None and scorers:
            source = scorers[0].model
        if source is None:
            raise ValueError("critic.init is 'reward_model' but no reward model is named: add a reward_model "
                             "reward with a path, set critic.name_or_path, or critic.init: policy")
    if source is None:
        source = policy
    if isinstance(source, str | Path):
        value_model, _ = load_value_model(str(source), seed=seed, dtype=config.model.dtype, device=device,
                                          tokenizer=tokenizer)
    else:
        value_model = value_model_from(source, seed=seed)
    return ActorCritic(policy, value_model)
