"""Reward models: an outcome RM trained on preference pairs, a process RM on labelled steps.

Outcome (``process: false``): a scalar head read at the last token of prompt + completion + eos;
the Bradley-Terry loss ``-log σ(r_c - r_r - m)`` (InstructGPT, Ouyang et al. 2022, Eq. 1; the
per-pair margin m of Llama 2 when records carry a ``margin`` column) with optional reward
centring. Chosen and rejected of a micro-batch go through the model in one packed forward pass.
Pair records: each record is one pair and the loss is the mean over the pairs of the global batch.
Ranking records (``data.format: ranking``, ``{prompt, completions, ranks}``) are batched as
InstructGPT (Sec. 3.5): a record is one batch element holding all K(K-1)/2 comparisons of its
prompt (tied answers make none), each of its K answers goes through the model once, and the loss
is ``-1/C(K,2) Σ_pairs log σ(r_w - r_l)`` per prompt (``ranking_loss``), averaged over the prompts
of the global batch; ``train.batch_size`` then counts prompts, not pairs.

Process (``process: true``): stepwise records ``{prompt, steps, labels}`` are laid out as
``prompt + step_1 + sep + step_2 + sep + ...``; the head's logit at the last token of each
separator scores the step so far, trained with binary cross-entropy on the step labels (as
Math-Shepherd, Wang et al. 2024, with its tag token; Lightman et al. 2023 predict at the
step's last token). Step scores sigmoid(logit) are aggregated into a trajectory score with a
``STEP_AGGREGATIONS`` entry (``aggregation``, default ``min``) by the scorer.

Held-out figures: pairwise accuracy (over all pairs of a ranking), mean margin and reward mean / std,
and for rankings ``best_accuracy``, the share of prompts whose top-scored answer is a best one
(outcome); step accuracy, step BCE and trajectory accuracy (aggregated score > 0.5 against "every
step good"), with the share of good steps and trajectories as their majority-class baselines (process).

Pair data (lenient loading, synthetic pairs, tokenisation) is :mod:`tether.data.pairs`; the step ->
micro-batches schedule is :mod:`tether.data.schedule`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tether.config.preference import RewardModelConfig
from tether.core.reward import STEP_AGGREGATIONS, bradley_terry_loss, ranking_loss, ranking_pairs, top_is_best
from tether.data.pairs import (
    PairExample,
    RankingExample,
    StepExample,
    pair_data,
    pair_data_stats,
    tokenize_pairs,
    tokenize_rankings,
    tokenize_stepwise,
)
from tether.data.schedule import BatchSchedule, chunks
from tether.evaluation import with_intervals
from tether.models.reward_model import score_positions, set_reward_info
from tether.trainers.loop import Trainer

log = logging.getLogger(__name__)


class RewardModelTrainer(Trainer):
    """Bradley-Terry (outcome) or step-level BCE (process) on the shared loop."""

    def __init__(self, config: RewardModelConfig, model: torch.nn.Module, tokenizer: Any, run_dir: str | Path,
                 *, records: list[dict] | None = None, eval_records: list[dict] | None = None,
                 dropped: dict[str, int] | None = None, stage: str | None = None) -> None:
        super().__init__(config, model, tokenizer, run_dir, stage=stage)
        cfg = self.config
        set_reward_info(model, process=cfg.process, step_separator=cfg.step_separator, aggregation=cfg.aggregation)
        fmt = cfg.record_format()
        self.ranking = fmt == "ranking"
        counts: dict[str, int] = dict(dropped or {})
        if records is None:
            records, default_eval, counts = pair_data(cfg.data, kind=fmt if fmt != "preference" else "correctness",
                                                      format=fmt)
            eval_records = default_eval if eval_records is None else eval_records
        self.examples, stats = self._tokenize(records)
        self.eval_examples, _ = self._tokenize(eval_records or [])
        self.data_stats = pair_data_stats(self.stage, counts, stats, len(self.examples))
        self.schedule = BatchSchedule(len(self.examples), batch_size=cfg.train.batch_size,
                                      grad_accum=cfg.train.grad_accum, seed=cfg.train.seed, rank=self.dist.rank,
                                      world_size=self.dist.world_size)
        dropped = {k: v for k, v in self.data_stats.items() if v}
        if dropped:
            log.warning("%s: dropped %s", self.stage, dropped)
        self.results.update({f"data/{k}": float(v) for k, v in dropped.items()})
        self.logger.log(0, {f"data/{k}": v for k, v in self.data_stats.items()})
        log.info("%s: %d training and %d held-out %s examples (%s)", self.stage, len(self.examples),
                 len(self.eval_examples), fmt, self.data_stats)

    def _tokenize(self, records: list[dict]) -> tuple[list, dict[str, int]]:
        cfg = self.config
        if cfg.process:
            return tokenize_stepwise(records, self.tokenizer, separator=cfg.step_separator,
                                     max_length=cfg.data.max_length)
        tokenize = tokenize_rankings if self.ranking else tokenize_pairs
        return tokenize(records, self.tokenizer, max_length=cfg.data.max_length, overflow=cfg.data.overflow)

    # ---- scores -----------------------------------------------------------------------------------
    def pair_rewards(self, pairs: Sequence[PairExample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rewards of chosen and rejected, shape (B,) each, from one packed forward pass."""
        sequences = [p.chosen.input_ids for p in pairs] + [p.rejected.input_ids for p in pairs]
        scores = score_positions(self.model, sequences, [[len(s) - 1] for s in sequences],
                                 row_tokens=self.config.data.pack_length, pad_token_id=self.tokenizer.pad_token_id,
                                 packing=self.config.data.packing)
        return scores[: len(pairs)], scores[len(pairs):]

    def ranking_rewards(self, examples: Sequence[RankingExample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rewards of every answer, their ranks and the valid-answer mask, shape (B, K_max) each: the
        answers of all prompts go through the model in one packed forward pass, each answer once."""
        sequences = [c.input_ids for e in examples for c in e.completions]
        flat = score_positions(self.model, sequences, [[len(s) - 1] for s in sequences],
                               row_tokens=self.config.data.pack_length, pad_token_id=self.tokenizer.pad_token_id,
                               packing=self.config.data.packing)
        sizes = torch.tensor([len(e.ranks) for e in examples])
        mask = (torch.arange(int(sizes.max()))[None, :] < sizes[:, None]).to(flat.device)
        ranks = torch.zeros(mask.shape, dtype=torch.long)
        ranks[mask.cpu()] = torch.tensor([r for e in examples for r in e.ranks])
        return flat.new_zeros(mask.shape).masked_scatter(mask, flat), ranks.to(flat.device), mask

    def step_logits(self, examples: Sequence[StepExample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step logits and labels, flat (P,), and the step count of each example (B,)."""
        logits = score_positions(self.model, [e.input_ids for e in examples], [e.positions for e in examples],
                                 row_tokens=self.config.data.pack_length, pad_token_id=self.tokenizer.pad_token_id,
                                 packing=self.config.data.packing)
        labels = torch.tensor([y for e in examples for y in e.labels], device=logits.device)
        return logits, labels, torch.tensor([len(e.positions) for e in examples])

    # ---- losses -----------------------------------------------------------------------------------
    def outcome_loss(self, pairs: Sequence[PairExample], global_pairs: float) -> tuple[torch.Tensor, dict]:
        chosen, rejected = self.pair_rewards(pairs)
        margin = None
        if any(p.margin is not None for p in pairs):
            margin = chosen.new_tensor([p.margin or 0.0 for p in pairs])
        loss, metrics = bradley_terry_loss(chosen, rejected, margin=margin, center_coef=self.config.center_coef)
        return loss * len(pairs) / global_pairs, metrics

    def ranked_loss(self, examples: Sequence[RankingExample], global_prompts: float) -> tuple[torch.Tensor, dict]:
        loss, metrics = ranking_loss(*self.ranking_rewards(examples), center_coef=self.config.center_coef)
        return loss * len(examples) / global_prompts, metrics

    def process_loss(self, examples: Sequence[StepExample], global_steps: float) -> tuple[torch.Tensor, dict]:
        logits, labels, _ = self.step_logits(examples)
        loss = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum") / global_steps
        metrics = {"step_accuracy": ((logits > 0).float() == labels).float().mean(),
                   "step_score/mean": torch.sigmoid(logits.detach()).mean()}
        return loss, metrics

    def training_step(self) -> dict[str, Any]:
        groups = [[self.examples[i] for i in g] for g in self.schedule.for_step(self.step)]
        if self.config.process:
            denominator = self.global_count(sum(len(e.positions) for g in groups for e in g))
            return self.optimizer_step(groups, lambda g: self.process_loss(g, denominator))
        denominator = self.global_count(sum(len(g) for g in groups))  # pairs, or prompts of rankings
        loss_fn = self.ranked_loss if self.ranking else self.outcome_loss
        return self.optimizer_step(groups, lambda g: loss_fn(g, denominator))

    # ---- evaluation -------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out pairwise accuracy, margin and reward statistics, or step / trajectory accuracy."""
        if not self.eval_examples:
            return {}
        self.model.eval()
        size = self.config.train.batch_size
        if self.ranking:
            return self._evaluate_rankings(size)
        if not self.config.process:
            scores = [self.pair_rewards(c) for c in chunks(self.eval_examples, size)]
            chosen, rejected = torch.cat([s[0] for s in scores]), torch.cat([s[1] for s in scores])
            loss, m = bradley_terry_loss(chosen, rejected)
            return with_intervals({"pairwise_accuracy": float(m["accuracy"]), "margin": float(m["margin"]),
                                   "rewards/chosen": float(m["rewards/chosen"]),
                                   "rewards/rejected": float(m["rewards/rejected"]),
                                   "rewards/mean": float(m["rewards/mean"]), "rewards/std": float(m["rewards/std"]),
                                   "loss": float(loss)},
                                  {"pairwise_accuracy": (chosen > rejected).float().tolist()}, count=None)
        logits, labels, counts = zip(*(self.step_logits(c) for c in chunks(self.eval_examples, size)), strict=True)
        logits, labels, counts = torch.cat(logits), torch.cat(labels), torch.cat(counts)
        aggregate = STEP_AGGREGATIONS.get(self.config.aggregation)
        padded = torch.zeros(len(counts), int(counts.max()))
        mask = torch.arange(padded.shape[1])[None, :] < counts[:, None]
        padded[mask] = torch.sigmoid(logits).cpu()
        good = torch.zeros_like(padded)
        good[mask] = labels.cpu()
        trajectory_good = torch.where(mask, good, 1.0).amin(-1) > 0.5
        trajectory = aggregate(padded, mask) > 0.5
        step_hits, trajectory_hits = ((logits > 0).float() == labels).float(), (trajectory == trajectory_good).float()
        return with_intervals({"step_accuracy": float(step_hits.mean()),
                               "step_bce": float(F.binary_cross_entropy_with_logits(logits, labels)),
                               "trajectory_accuracy": float(trajectory_hits.mean()),
                               # the majority-class baselines these accuracies are to be read against
                               "step_good_fraction": float(labels.mean()),
                               "trajectory_good_fraction": float(trajectory_good.float().mean())},
                              {"step_accuracy": step_hits.tolist(), "trajectory_accuracy": trajectory_hits.tolist()},
                              count=None)

    def _evaluate_rankings(self, size: int) -> dict[str, float]:
        """Held-out figures of ranking records: over all untied pairs (accuracy, margin, rewards of winners and
        losers), over prompts (``best_accuracy``) and answers (reward mean / std); the ranking loss. The
        pairwise interval treats a prompt's pairs as independent, so it is narrower than it should be."""
        parts = [self.ranking_rewards(c) for c in chunks(self.eval_examples, size)]
        width = max(p[0].shape[1] for p in parts)
        scores, ranks, mask = (torch.cat([F.pad(p[i], (0, width - p[i].shape[1])) for p in parts]) for i in range(3))
        loss, m = ranking_loss(scores, ranks, mask)
        better = ranking_pairs(ranks, mask)
        pair_hits = ((scores[:, :, None] - scores[:, None, :])[better] > 0).float()
        best_hits = top_is_best(scores, ranks, mask).float()
        figures = {"pairwise_accuracy": float(m["accuracy"]), "best_accuracy": float(m["best_accuracy"]),
                   "margin": float(m["margin"]), "loss": float(loss), "pairs": float(better.sum())}
        figures.update({k: float(m[k]) for k in ("rewards/chosen", "rewards/rejected", "rewards/mean", "rewards/std")})
        return with_intervals(figures, {"pairwise_accuracy": pair_hits.tolist(), "best_accuracy": best_hits.tolist()},
                              count=None)
