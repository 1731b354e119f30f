"""The RL machinery every RL stage runs on: the GRPO family directly, PPO with a critic, agents multi-turn.

One step (:meth:`RLTrainer.training_step`) reads: sample a prompt batch -> generate ``group_size``
completions per prompt -> score them with the reward functions (and shape the scores) -> the frozen
passes each term needs (old-policy and reference log-probs, the critic's values) -> the KL to the
reference, in the reward or in the loss -> advantages (a registry estimator, over the whole job's
batch) -> ``num_iterations`` passes of minibatch updates of a registry policy loss (plus the value
loss when there is a critic, and the entropy bonus), every term aggregated by ``agg_loss``. The step
carries one :class:`RLBatch`. What an advantage estimator reads beyond rewards (ReMax's greedy
baseline, GAE's values) is declared by its registry entry (``ADVANTAGE_ESTIMATORS.needs``); the
critic exists when the config has one (``ppo``); its values, value loss and warm-up (the first
``critic.warmup_steps`` steps update the critic alone) are in critic.py.

How it departs from the papers: the KL estimators, the clipped surrogate, the aggregation and the
advantages are exactly as in ``tether.core``; "old" log-probs are recomputed by a forward pass when
more than one update uses a rollout (or the KL goes into the reward), and equal the current log-probs
(ratio 1) otherwise, as in TRL and verl; with ``old_logprobs: sampler`` the engine's own log-probs are
the old policy and that pass is skipped. Every step compares the sampler's log-probs with the trainer's
(``mismatch/*``) and, with ``rollout_correction``, weights each token's policy-gradient term by the
registry correction (see rollout_consistency.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tether.config.base import ConfigError
from tether.config.rl import RLConfig
from tether.core.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, AdvantageOutputs
from tether.core.aggregation import agg_loss, num_seqs, num_tokens
from tether.core.kl import KL_CONTROLLERS, kl_penalty
from tether.core.policy_losses import POLICY_LOSSES
from tether.core.reward_aggregation import REWARD_AGGREGATIONS
from tether.data.sources import record_columns, training_prompts
from tether.models.loading import frozen_copy
from tether.models.logprobs import completion_logprobs
from tether.models.value_model import build_actor_critic
from tether.rewards import RunningMoments, overlong_penalty, shape_scores
from tether.rollout import Rollout, SamplingParams
from tether.scoring import reward_composer
from tether.trainers.async_rollout import AsyncSteps, EngineSampler
from tether.trainers.critic import CriticSteps, in_critic_warmup, warmup_metrics
from tether.trainers.distillation import Distillation, DistillationSteps
from tether.trainers.distributed import all_gather_rows, all_reduce_sum
from tether.trainers.entropy_control import EntropyControl
from tether.trainers.loop import Trainer
from tether.trainers.parallel import average_unsynced_gradients, full_parameters, global_advantages
from tether.trainers.process_supervision import ProcessRewards
from tether.trainers.rl_report import RolloutReport
from tether.trainers.rollout_consistency import MismatchTracker, sampler_as_old
from tether.trainers.step_draws import StepDraws


@dataclass
class RLBatch:
    """One step's rollouts and what the step computes from them. B samples (groups of ``group_size``
    contiguous), T the longest completion; tensors on the model's device."""

    prompt_indices: list[int]  # the record index of each group
    rollout: Rollout  # prompt and completion token ids, texts, finish reasons
    scores: torch.Tensor  # (B,) the reward functions' weighted sum plus shaping terms; NaN: no reward
    metrics: dict[str, Any]  # what collecting and scoring measured
    mask: torch.Tensor | None = None  # (B, T) float: 1 on the completion tokens trained on
    truncated: torch.Tensor | None = None  # (B,) bool: cut at max_new_tokens
    valid: torch.Tensor | None = None  # (B,) bool: has a reward
    sampler_logprobs: torch.Tensor | None = None  # (B, T) the sampler's per-token log-probs
    rewards: torch.Tensor | None = None  # (B,) the outcome reward the advantages see
    old_logprobs: torch.Tensor | None = None  # (B, T) the behaviour policy's (None: ratio 1)
    ref_logprobs: torch.Tensor | None = None  # (B, T) the reference policy's
    values: torch.Tensor | None = None  # (B, T) the critic's V(s_t) at rollout time
    kl: torch.Tensor | None = None  # (B, T) per-token KL(behaviour || reference), 0 off the mask
    token_rewards: torch.Tensor | None = None  # (B, T) -beta * kl when the KL is in the reward
    advantages: torch.Tensor | None = None  # (B, T)
    returns: torch.Tensor | None = None  # (B, T) the critic's targets
    gold: torch.Tensor | None = None  # (B,) the gold reward, logged only
    teacher_prompts: list[list[int]] | None = None  # each sample's prompt as the distillation teacher reads it
    distill_advantages: torch.Tensor | None = None  # (B, T) the sampled-token distillation signal
    mismatch: MismatchTracker | None = None  # the trainer's log-probs beside the sampler's; the correction

    def __len__(self) -> int:
        return len(self.rollout)


class RLTrainer(StepDraws, CriticSteps, DistillationSteps, AsyncSteps, RolloutReport, Trainer):
    """Generate -> score -> advantage -> clipped policy-gradient updates (and a critic), on the shared loop."""

    compares_frozen_passes = True

    config: RLConfig

    def __init__(self, config: RLConfig, model: torch.nn.Module, tokenizer: Any, run_dir: str | Path, *,
                 records: list[dict] | None = None, reward_functions: list | None = None,
                 gold_functions: list | None = None, critic: Any = None, stage: str | None = None) -> None:
        if config.critic is not None and not hasattr(model, "values"):
            model = build_actor_critic(config, model, tokenizer, critic, reward_functions)
        super().__init__(config, model, tokenizer, run_dir, stage=stage)
        cfg = self.config
        if not (reward_functions or cfg.rewards or cfg.distill):
            raise ConfigError(f"stage {self.stage!r} needs a reward: config.rewards (e.g. {{name: reward_model, "
                             "kwargs: {path: ...}}) or reward_functions")
        self.records, self.prompts, self.prompt_ids = training_prompts(cfg.data, records, tokenizer, self.stage)
        self.engine = EngineSampler.of(cfg).build_engine(self.policy, tokenizer)
        defaults = cfg.reward_defaults()
        self.rewards = reward_composer(reward_functions if reward_functions is not None else cfg.rewards,
                                       on_error=cfg.reward_on_error, defaults=defaults, workers=cfg.reward_workers,
                                       routes=cfg.reward_routes if reward_functions is None else None
                                       ) if reward_functions or cfg.rewards or cfg.reward_routes else None
        self.distillation = Distillation(cfg.distill, self.policy, tokenizer, temperature=cfg.rollout.temperature,
                                         row_tokens=cfg.row_tokens) if cfg.distill else None
        gold = gold_functions if gold_functions is not None else ([cfg.gold] if cfg.gold else [])
        self.gold = reward_composer(gold, on_error=cfg.reward_on_error, defaults=defaults) if gold else None
        self.ref_model = self._reference_model()
        kl = cfg.kl
        self.kl_controller = KL_CONTROLLERS.get(kl.controller)(kl.coef, target=kl.target, horizon=kl.horizon)
        self.moments = RunningMoments()
        self.entropy = EntropyControl(cfg.entropy, cfg.top_entropy_quantile)
        self.running_baseline: torch.Tensor | None = None
        self.process_rewards: ProcessRewards | None = None  # built on first use (grpo_process)
        self.prompt_cursor = 0

    # ---- set-up ------------------------------------------------------------------------------
    @property
    def policy(self) -> torch.nn.Module:
        """The causal LM that samples (an actor-critic's policy)."""
        return getattr(self.model, "generator", self.model)

    def total_updates(self) -> int:
        cfg = self.config
        return cfg.train.max_steps * cfg.num_iterations * cfg.mini_batches

    def optimizer_parts(self) -> list[tuple[list[torch.nn.Parameter], float]] | None:
        """With a critic: the policy at ``optim.lr``, the critic at ``critic.lr``."""
        if self.config.critic is None:
            return None
        policy, critic = self.model.parts()
        return [(policy, self.config.optim.lr), (critic, self.config.critic.lr or self.config.optim.lr)]

    def load_model_weights(self, checkpoint: Path) -> None:
        if self.config.critic is None:
            super().load_model_weights(checkpoint)
        else:
            self.model.load_pretrained_weights(checkpoint)

    def needs_reference(self) -> bool:
        """Whether a reference model is kept: for a KL term that is on (or adapted from 0)."""
        return self.config.kl.coef > 0 or self.config.kl.controller != "fixed"

    def _reference_model(self) -> torch.nn.Module | None:
        """A frozen copy of the initial policy when :meth:`needs_reference`; none under LoRA (the base model
        with the adapter disabled is the reference)."""
        if not self.needs_reference() or hasattr(self.policy, "disable_adapter"):
            return None
        return frozen_copy(self.policy)

    def extra_state(self) -> dict[str, Any]:
        return {"running_baseline": self.running_baseline, "prompt_cursor": self.prompt_cursor,
                "kl_controller": self.kl_controller.state_dict(), "reward_moments": self.moments.state_dict(),
                "entropy_control": self.entropy.state_dict(), "async": self.async_state(),
                "distill_tokens": self.distillation.teacher_tokens_total if self.distillation else 0}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.running_baseline = state.get("running_baseline")
        self.prompt_cursor, self.async_restored = state.get("prompt_cursor", 0), state.get("async")
        if self.distillation is not None:
            self.distillation.teacher_tokens_total = state.get("distill_tokens", 0)
        if "kl_controller" in state:
            self.kl_controller.load_state_dict(state["kl_controller"])
            self.moments.load_state_dict(state["reward_moments"])
        if "entropy_control" in state:
            self.entropy.load_state_dict(state["entropy_control"])

    # ---- generate and score ---------------------------------------------------------------------
    def columns(self, indices: list[int], rollout: Rollout) -> tuple[list[str], dict[str, list]]:
        """Each sample's prompt and its record's other columns (``answer``, ...), for the reward functions."""
        records = [self.records[indices[i]] for i in rollout.prompt_index]
        prompts = [self.prompts[indices[i]] for i in rollout.prompt_index]
        return prompts, record_columns(records)

    def score(self, indices: list[int], rollout: Rollout) -> tuple[torch.Tensor, dict[str, float]]:
        """The reward functions' weighted sum per sample (NaN: none), plus DAPO's overlong term when on."""
        if self.rewards is None:  # distillation alone
            return torch.zeros(len(rollout)), {}
        prompts, columns = self.columns(indices, rollout)
        result = self.rewards.score(prompts, rollout.texts, columns)
        return self.with_overlong(self.combine(result), rollout), result.metrics()

    def with_overlong(self, rewards: torch.Tensor, rollout: Rollout) -> torch.Tensor:
        """``rewards`` plus, when on, DAPO's overlong term on the completions' lengths (config.length_limit)."""
        if self.config.overlong is None:
            return rewards
        lengths = torch.tensor([len(c) for c in rollout.completion_ids], dtype=torch.float32)
        return rewards + overlong_penalty(lengths, max_length=self.config.length_limit()[1],
                                          buffer=self.config.overlong.buffer, penalty=self.config.overlong.penalty)

    def combine(self, result: Any) -> torch.Tensor:
        """One reward per sample from the reward functions' values, by ``reward_aggregation``."""
        weights = torch.tensor(result.weights or [1.0] * len(result.per_function), dtype=result.total.dtype)
        return REWARD_AGGREGATIONS.get(self.config.reward_aggregation)(result.scores(), weights,
                                                                       self.config.rollout.group_size)

    def collect(self) -> RLBatch:
        """One step's rollouts; with dynamic sampling, groups whose rewards are all equal are
        dropped and more prompts are sampled until the batch is full (or ``max_rounds``)."""
        cfg = self.config
        if cfg.async_rollout.max_staleness:  # sampled ahead by the producer process (async_rollout.py)
            return RLBatch(*self.async_collect())
        want, size = cfg.train.batch_size, cfg.rollout.group_size
        dynamic = cfg.dynamic_sampling.enabled
        kept_idx: list[int] = []
        kept: list[Rollout] = []
        kept_rewards: list[torch.Tensor] = []
        metrics: dict[str, float] = {}
        dropped = 0
        for round_index in range(cfg.dynamic_sampling.max_rounds if dynamic else 1):
            indices = self.next_prompts(want - len(kept_idx))
            rollout, rewards, reward_metrics = self.sample_round(indices, round_index)
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
        return RLBatch(kept_idx, kept[0].concat(kept), torch.cat(kept_rewards), metrics)

    def sample_round(self, indices: list[int], round_index: int) -> tuple[Rollout, torch.Tensor, dict[str, float]]:
        """One generation round of ``collect``: the samples of ``indices``' prompts, their rewards and figures."""
        with full_parameters(self.model):  # FSDP2 (re-entrant): whole weights while decoding
            rollout = self.engine.generate(self.sampling_request(indices), self.sampling_params(round_index))
        return rollout, *self.score(indices, rollout)

    def greedy_baseline(self, batch: RLBatch) -> torch.Tensor:
        """ReMax's baseline: the reward of one greedy completion per prompt, repeated over its group."""
        baseline = self.greedy_rewards(batch.prompt_indices).nan_to_num(0.0)
        return baseline.repeat_interleave(self.config.rollout.group_size).to(self.device)

    def greedy_rewards(self, indices: list[int]) -> torch.Tensor:
        with full_parameters(self.model):
            greedy = self.engine.generate([self.prompt_ids[i] for i in indices],
                                          SamplingParams(greedy=True, max_new_tokens=self.config.rollout.max_new_tokens))
        return self.score(indices, greedy)[0]

    # ---- the step's tensors ---------------------------------------------------------------------
    def prepare(self, batch: RLBatch) -> None:
        """Masks, flags and rewards on the model's device: unscored samples are masked out and take their
        group's mean reward (0 for a group of one); scores are normalised, clipped and the no-EOS penalty
        subtracted as configured, over the whole job's batch."""
        cfg = self.config
        padded = batch.rollout.to_padded(self.tokenizer.pad_token_id, self.device)
        mask = padded["completion_mask"].float()
        batch.sampler_logprobs = padded["logprobs"]
        batch.truncated = torch.tensor([r == "length" for r in batch.rollout.finish_reasons], device=self.device)
        scores = batch.scores.to(self.device)
        batch.scores = scores
        batch.valid = ~torch.isnan(scores)
        if cfg.rollout.mask_truncated:
            mask = mask * (~batch.truncated).float()[:, None]
        batch.mask = mask * batch.valid.float()[:, None]
        batch.mismatch = MismatchTracker(batch.sampler_logprobs, batch.mask, cfg.rollout_correction,
                                         policy_version=lambda: self.scheduler.last_epoch)
        size = cfg.rollout.group_size
        filled = torch.where(batch.valid, scores, scores.view(-1, size).nanmean(1).nan_to_num(0.0).repeat_interleave(size))
        batch.rewards = self._global(filled, lambda whole, flags: shape_scores(
            whole, flags, norm=cfg.reward_norm, clip=cfg.reward_clip, missing_eos_penalty=cfg.missing_eos_penalty,
            moments=self.moments), batch.truncated)

    def _global(self, values: torch.Tensor, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                flags: torch.Tensor) -> torch.Tensor:
        """``fn`` over every rank's rows (gathered), this rank's rows back; ``fn(values, flags)`` in one process."""
        if self.dist.world_size == 1:
            return fn(values, flags)
        parts = all_gather_rows(values)
        start = sum(p.shape[0] for p in parts[: self.dist.rank])
        whole = fn(torch.cat(parts), torch.cat(all_gather_rows(flags)))
        return whole[start:start + values.shape[0]]

    @torch.no_grad()
    def frozen_passes(self, batch: RLBatch) -> None:
        """The forward passes the step's terms need, without gradients: the behaviour policy's log-probs when a
        rollout is used more than once (or the KL enters the reward), the reference's when a KL term is kept,
        the critic's values when there is one."""
        cfg = self.config
        reuse = cfg.num_iterations > 1 or cfg.mini_batches > 1
        if self.needs_reference():  # the frozen copy, or the base model with the LoRA adapter off
            batch.ref_logprobs = self.frozen_logprobs(batch.rollout, reference=True)
        behaviour = None
        if cfg.old_logprobs == "sampler":  # the engine's log-probs are the behaviour policy: no pass
            behaviour = batch.old_logprobs = sampler_as_old(batch.sampler_logprobs, batch.mask)
        elif reuse or (batch.ref_logprobs is not None and cfg.kl.in_reward):
            behaviour = self.frozen_logprobs(batch.rollout, reference=False)
            batch.mismatch.record(torch.arange(len(batch), device=behaviour.device), behaviour)
            batch.old_logprobs = behaviour if reuse else None
        if behaviour is not None and batch.ref_logprobs is not None:
            batch.kl = torch.where(batch.mask != 0, kl_penalty(behaviour, batch.ref_logprobs, cfg.kl.estimator), 0.0)
        if cfg.critic is not None:
            batch.values = self.frozen_values(batch.rollout)
        if batch.kl is not None and cfg.kl.in_reward:
            batch.token_rewards = -self.kl_controller.value * batch.kl
        if self.distillation is not None:
            self.distill_signal(batch, behaviour)

    def advantages(self, batch: RLBatch) -> AdvantageOutputs:
        """The configured estimator over every rank's rollouts (global batch statistics), this rank's rows
        back; the inputs its registry entry declares are prepared first. A subclass may add terms that
        need the rollout (the agent trainer's GiGPO step-level advantages)."""
        cfg = self.config
        needs = ADVANTAGE_ESTIMATORS.needs(cfg.advantage)
        steps = self.step_rewards(batch) if "step_rewards" in needs else (None, None)
        inputs = AdvantageInputs(
            rewards=batch.rewards, mask=batch.mask, group_size=cfg.rollout.group_size, token_rewards=batch.token_rewards,
            baseline_rewards=self.greedy_baseline(batch) if "baseline_rewards" in needs else None,
            values=batch.values if "values" in needs else None, running_baseline=self.running_baseline,
            step_rewards=steps[0], step_ends=steps[1])
        return self.with_distillation(batch, global_advantages(cfg.advantage, inputs, **cfg.advantage_hparams()))

    def step_rewards(self, batch: RLBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The process reward model's step rewards and step ends (:class:`ProcessRewards`), figures logged."""
        if self.process_rewards is None:
            self.process_rewards = ProcessRewards(self.config.process_reward, self.tokenizer)
        rewards, ends, figures = self.process_rewards(self.columns(batch.prompt_indices, batch.rollout)[0], batch.rollout)
        batch.metrics.update(figures)
        return rewards.to(self.device), ends.to(self.device)

    # ---- log-probs ---------------------------------------------------------------------------------
    def policy_logprobs(self, model: torch.nn.Module, rollout: Rollout, rows: torch.Tensor, *,
                        with_entropy: bool = False, entropy_grad: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropies) of the given samples' completion tokens under ``model``, padded to the
        rollout's longest completion."""
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

    def frozen_logprobs(self, rollout: Rollout, *, reference: bool) -> torch.Tensor:
        """Old-policy or reference log-probs for the whole rollout, in micro-batches."""
        context = nullcontext()
        model = self.model
        if reference:
            if self.ref_model is not None:
                model = self.ref_model
            else:
                context = self.model.disable_adapter()
        with self.frozen_pass(context, model=model):
            return torch.cat([self.policy_logprobs(model, rollout, rows)[0]
                              for rows in self.micro_batches(torch.arange(len(rollout)))])

    def micro_batches(self, rows: torch.Tensor) -> list[torch.Tensor]:
        size = self.config.micro_batch_size or len(rows)
        return list(rows.split(size))

    # ---- the step ---------------------------------------------------------------------------------
    def training_step(self) -> dict[str, Any]:
        cfg = self.config
        start = time.perf_counter()
        with full_parameters(self.model):  # FSDP2: whole weights while this rank decodes its share
            batch = self.collect()
        gen_time = time.perf_counter() - start
        self.prepare(batch)
        frozen_start = time.perf_counter()
        self.frozen_passes(batch)
        frozen_time = time.perf_counter() - frozen_start
        adv = self.advantages(batch)
        batch.advantages, batch.returns = adv.advantages, adv.returns
        if "running_baseline" in adv.state:
            self.running_baseline = adv.state["running_baseline"]
        warmup = in_critic_warmup(cfg.critic, self.step)  # the critic alone (critic.py)
        step_loss = self.value_loss if warmup else self.loss
        sync = (lambda: average_unsynced_gradients(self.model)) if warmup else None  # its loss skips DDP's forward
        update_metrics = self.minibatch_updates(batch.mask, cfg.num_iterations, lambda rows, d: step_loss(batch, rows, d),
                                                after_backward=sync)
        self.async_published()
        metrics = dict(batch.metrics)
        metrics.update({f"advantage/{k}": v for k, v in adv.metrics.items()})
        metrics.update(update_metrics)
        metrics.update(batch.mismatch.metrics())
        metrics.update(self.entropy.end_step(update_metrics.get("entropy"), self.step))
        metrics.update(self.rollout_metrics(batch))
        if batch.token_rewards is not None:
            metrics.update(self.adapt_kl(batch, update=not warmup))
        metrics.update(warmup_metrics(cfg.critic, warmup))
        metrics.update({"time/generation": gen_time, "time/frozen_passes": frozen_time,
                        "completions_per_s": len(batch) / (time.perf_counter() - start)})
        if self.step % cfg.sample_every == 0:
            self.logger.write_samples(self.step, self.samples(batch))
        self.logger.write_rewards(self.step + 1, torch.cat(all_gather_rows(batch.scores[batch.valid])).tolist())
        return metrics

    def adapt_kl(self, batch: RLBatch, *, update: bool = True) -> dict[str, float]:
        """The KL in the reward per completion over the whole job's batch, and the coefficient it was charged
        at; the controller then moves the coefficient (an adaptive one toward its target) when ``update``."""
        total, count = all_reduce_sum(batch.kl.sum(1)[batch.valid].sum()), all_reduce_sum(batch.valid.sum())
        sequence_kl = float(total / count) if count > 0 else 0.0
        figures = {"kl/sequence": sequence_kl, "kl_coef": self.kl_controller.value}
        if update:
            self.kl_controller.update(sequence_kl, int(count))
        return figures

    def minibatch_updates(self, mask: torch.Tensor, passes: int,
                          loss: Callable[[torch.Tensor, dict[str, float]], tuple[torch.Tensor, dict]],
                          after_backward: Callable[[], None] | None = None) -> dict[str, float]:
        """``passes`` passes over the rollout's rows (``mask`` is (N, C)), each in ``mini_batches``
        shuffled minibatches of one optimiser step; ``loss(rows, denominators)`` with the minibatch's
        global token and sequence counts, ``after_backward`` as :meth:`Trainer.optimizer_step` takes it.
        Returns the last step's metrics."""
        out: dict[str, float] = {}
        shuffle = torch.Generator().manual_seed(self.config.train.seed * 7919 + self.step)  # a pure function of the step
        for _ in range(passes):
            for minibatch in torch.randperm(mask.shape[0], generator=shuffle).chunk(self.config.mini_batches):
                denominators = {"global_tokens": self.global_count(num_tokens(mask[minibatch])),
                                "global_seqs": self.global_count(num_seqs(mask[minibatch]))}
                out = self.optimizer_step(self.micro_batches(minibatch), lambda rows, d=denominators: loss(rows, d),
                                          after_backward)
        if self.config.critic is not None:
            out["lr/critic"] = self.scheduler.get_last_lr()[-1]
        return out

    def loss(self, batch: RLBatch, rows: torch.Tensor, denominators: dict[str, float]
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The policy loss (registry), plus beta * KL when the KL is in the loss, plus ``critic.coef`` x the
        clipped value loss with a critic, minus ``entropy.coef`` x the entropy; every term through
        ``agg_loss`` with the minibatch's global counts."""
        cfg = self.config
        logps, entropy = self.policy_logprobs(self.model, batch.rollout, rows, with_entropy=True,
                                              entropy_grad=self.entropy.bonus_on)
        m = batch.mask[rows]
        agg = {"global_tokens": denominators["global_tokens"], "global_seqs": denominators["global_seqs"],
               "norm_constant": cfg.rollout.max_new_tokens}
        old = batch.old_logprobs[rows] if batch.old_logprobs is not None else logps.detach()
        batch.mismatch.record(rows, logps)
        advantages = batch.advantages[rows]
        weights = batch.mismatch.weights(rows, old)
        if weights is not None:  # every registered loss is positively homogeneous in A: this weights its term
            advantages = advantages * weights
        loss, pg_metrics = POLICY_LOSSES.get(cfg.policy_loss)(
            logps, old, advantages, self.entropy.policy_mask(entropy, m), clip_low=cfg.clip.low, clip_high=cfg.clip.high,
            dual_clip=cfg.clip.dual, loss_agg=cfg.loss_agg, **agg, **cfg.policy_loss_kwargs)
        metrics = {f"policy/{k}": v for k, v in pg_metrics.items()}
        metrics["policy/loss"] = loss.detach()
        if batch.ref_logprobs is not None:
            kl = kl_penalty(logps, batch.ref_logprobs[rows], cfg.kl.estimator)
            metrics["kl"] = (kl.detach() * m).sum() / m.sum().clamp(min=1)
            if not cfg.kl.in_reward:
                loss = loss + cfg.kl.coef * agg_loss(kl, m, cfg.loss_agg, **agg)
        if self.distillation is not None and self.distillation.whole:
            loss = self.distill_loss(batch, rows, loss, metrics, agg)
        if cfg.critic is not None:
            vf_loss, vf_metrics = self.value_loss(batch, rows, denominators)
            loss = loss + cfg.critic.coef * vf_loss
            metrics.update(vf_metrics)
        if entropy is not None:
            metrics["entropy"] = (entropy.detach() * m).sum() / m.sum().clamp(min=1)
            if self.entropy.bonus_on:
                loss = loss - self.entropy.coef * agg_loss(entropy, m, cfg.loss_agg, **agg)
        return loss, metrics
