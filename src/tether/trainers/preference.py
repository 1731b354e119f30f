"""Offline preference optimisation: the DPO family on static pairs, and KTO on unpaired data.

One step reads: micro-batches of pairs -> chosen and rejected through the policy in one
padding-free packed forward pass -> summed completion log-probs -> a ``PREFERENCE_LOSSES`` entry
(``loss: sigmoid | cdpo | robust | ipo | hinge | rpo | simpo | orpo | slic | sppo_hard | sppo | tdpo | dmpo | ...``,
or a dict of weights for ``mixed_preference_loss``) against cached reference log-probs -> one update.
``loss: kto`` uses ``UNPAIRED_LOSSES["kto"]`` on ``{prompt, completion, label}`` records.

How it departs from a textbook DPO loop:

- Reference log-probs are computed once, before the first update, by the policy itself (its
  initial weights, in eval mode, without gradients) and cached with the dataset (and in
  ``<stage>/reference_logps.pt`` for resume); no reference model is held during training.
  SimPO and ORPO are reference-free and compute none. TDPO's sequential KL needs the reference's full
  distributions, which are not cached: a frozen copy of the initial weights runs on each micro-batch.
  DMPO's per-turn reference sums are cached like the summed ones (:mod:`tether.trainers.turn_reference`).
- KTO's KL baseline uses mismatched pairs inside each micro-batch (completion j with the prompt
  of example j+1, as TRL). To cache their reference log-probs, KTO micro-batches keep a fixed
  composition across epochs (only their order is reshuffled); paired losses reshuffle freely.
- The loss of a micro-batch is its pair mean scaled by (pairs in it) / (pairs in the global
  batch), so accumulation and ranks add up to the global mean. With WPO the weighted mean is per
  micro-batch (``wpo_weights`` normalises within the batch it sees).
- Held-out figures: implicit-reward preference accuracy (fraction of held-out pairs where
  β(log π - log π_ref) of chosen beats rejected; for SimPO / ORPO the loss's own reward) and
  margin, merged with the task evaluation of ``config.eval`` when set.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tether.config.base import ConfigError
from tether.config.preference import DPOConfig
from tether.core.logprobs import sequence_logprobs
from tether.core.preference import UNPAIRED_LOSSES, PreferenceInputs
from tether.data import DataError, TokenizedExample, tokenize_sft
from tether.data.pairs import (
    PairExample,
    UnpairedExample,
    is_paired,
    pair_data,
    pair_data_stats,
    tokenize_pairs,
    tokenize_unpaired,
)
from tether.data.schedule import BatchSchedule, chunks
from tether.data.step_pairs import step_pairs
from tether.evaluation import Figures, with_intervals
from tether.models.loading import frozen_copy
from tether.models.logprobs import example_logprobs, preference_inputs
from tether.rewards.scorer import RewardModelScorer
from tether.tasks.preferences import split_pairs
from tether.trainers.loop import Trainer
from tether.trainers.turn_reference import held_out_inputs, pair_reference_logprobs, with_reference_turns

log = logging.getLogger(__name__)

REFERENCE_CACHE = "reference_logps.pt"


class PreferenceTrainer(Trainer):
    """Offline DPO-family / KTO updates against reference log-probs cached before training."""

    compares_frozen_passes = True

    def __init__(self, config: DPOConfig, model: torch.nn.Module, tokenizer: Any, run_dir: str | Path, *,
                 records: list[dict] | None = None, eval_records: list[dict] | None = None,
                 dropped: dict[str, int] | None = None, stage: str | None = None) -> None:
        super().__init__(config, model, tokenizer, run_dir, stage=stage)
        cfg = self.config
        counts = dict(dropped or {})
        if records is None:
            records, default_eval, counts = pair_data(cfg.data, kind="correctness", format=cfg.record_format(),
                                                      unpaired=cfg.unpaired)
            eval_records = default_eval if eval_records is None else eval_records
        records = self._fit_to_loss(records, "training")
        if "step_pairs" in cfg.loss_needs:  # Step-DPO: each pair cut to its first wrong step
            first_wrong = self._first_wrong_step()
            records, step_stats = step_pairs(records, separator=cfg.steps.separator, first_wrong=first_wrong)
            counts.update({f"step_{k}": v for k, v in step_stats.items()})
            if eval_records:
                eval_records = step_pairs(eval_records, separator=cfg.steps.separator, first_wrong=first_wrong)[0]
        stats: dict[str, int]
        if cfg.unpaired:
            self.examples, stats = tokenize_unpaired(records, tokenizer, max_length=cfg.data.max_length,
                                                     overflow=cfg.data.overflow)
        else:
            self.examples, stats = tokenize_pairs(records, tokenizer, max_length=cfg.data.max_length,
                                                  overflow=cfg.data.overflow)
        if "win_probabilities" in cfg.loss_needs and any(p.win_probs is None for p in self.examples):
            raise DataError(f"stage {self.stage!r}: loss {cfg.loss!r} needs each pair's chosen_win_prob and "
                            "rejected_win_prob (SPPO's win probabilities over K samples); add them to the records, "
                            "or train it online (online_dpo), which estimates them")
        self.eval_pairs: list[PairExample] = []
        self.eval_unpaired: list[UnpairedExample] = []
        if eval_records:
            if is_paired(eval_records):
                self.eval_pairs = tokenize_pairs(eval_records, tokenizer, max_length=cfg.data.max_length,
                                                 overflow=cfg.data.overflow)[0]
            elif cfg.unpaired:
                self.eval_unpaired = tokenize_unpaired(eval_records, tokenizer, max_length=cfg.data.max_length,
                                                       overflow=cfg.data.overflow)[0]
            else:
                raise DataError(f"stage {self.stage!r}: held-out records are unpaired but loss {cfg.loss!r} "
                                "is evaluated on preference pairs")
        self.data_stats = pair_data_stats(self.stage, counts, stats, len(self.examples))
        self.schedule = BatchSchedule(len(self.examples), batch_size=cfg.train.batch_size,
                                      grad_accum=cfg.train.grad_accum, seed=cfg.train.seed, rank=self.dist.rank,
                                      world_size=self.dist.world_size, reshuffle=not cfg.unpaired)
        self.kl_examples = self._kl_examples() if cfg.unpaired else {}
        self.loss = cfg.paired_loss() if not cfg.unpaired else None
        self.beta = cfg.implicit_beta
        self.ref: dict[str, torch.Tensor] | None = None
        # TDPO's sequential KL needs the reference's whole distributions: a frozen copy of the initial
        # weights, taken before a resume loads later ones
        self.reference_model = frozen_copy(model) if "sequential_kl" in cfg.loss_needs else None
        if cfg.ignored_hparams():
            log.warning("%s: %s not used by loss %r; ignored", self.stage, ", ".join(cfg.ignored_hparams()), cfg.loss)
        dropped_now = {k: v for k, v in self.data_stats.items() if v}
        if dropped_now:
            log.warning("%s: dropped %s", self.stage, dropped_now)
        self.results.update({f"data/{k}": float(v) for k, v in dropped_now.items()})
        self.logger.log(0, {f"data/{k}": v for k, v in self.data_stats.items()})

    def _fit_to_loss(self, records: list[dict], what: str) -> list[dict]:
        cfg = self.config
        if cfg.unpaired and is_paired(records):
            if not cfg.data.split_pairs:
                raise DataError(f"stage {self.stage!r}: loss 'kto' takes unpaired records (prompt, completion, "
                                f"label) but the {what} records are preference pairs; set data.split_pairs: true "
                                "to use each pair as one desirable and one undesirable example")
            return split_pairs(records)
        if not cfg.unpaired and records and not is_paired(records):
            raise DataError(f"stage {self.stage!r}: loss {cfg.loss!r} takes preference pairs (prompt, chosen, "
                            f"rejected) but the {what} records are not pairs")
        return records

    def _first_wrong_step(self) -> Callable[[str, list[str]], int | None] | None:
        """With ``steps.prm``: the first step the process reward model scores below ``steps.threshold``."""
        steps = self.config.steps
        if steps.prm is None:
            return None
        scorer = RewardModelScorer(steps.prm, process=True, step_separator=steps.separator)

        def first_wrong(prompt: str, trace: list[str]) -> int | None:
            scores = scorer.step_scores([prompt], ["".join(trace)])[0]
            # the scorer drops blank pieces; map its steps back onto the trace's
            kept = [k for k, step in enumerate(trace) if step.replace(steps.separator, "").strip()]
            return next((kept[i] for i, x in enumerate(scores) if x < steps.threshold and i < len(kept)), None)

        return first_wrong

    def _kl_examples(self) -> dict[int, TokenizedExample]:
        """KTO's mismatched pairs: in each fixed micro-batch, completion j with the prompt of example j+1."""
        cfg = self.config
        if cfg.train.batch_size < 2:
            raise ConfigError("kto needs train.batch_size >= 2 for its mismatched KL pairs")
        out = {}
        for group in self.schedule.fixed_batches():
            for j, i in enumerate(group):
                own, partner = self.examples[i], self.examples[group[(j + 1) % len(group)]]
                row = {"prompt": partner.prompt, "completion": own.completion}
                if own.tools is not None:
                    row["tools"] = own.tools
                kl = tokenize_sft(row, self.tokenizer, max_length=cfg.data.max_length, overflow="truncate")
                out[i] = kl if kl is not None else own.example  # a prompt too long for any completion token
        return out

    # ---- reference log-probs, once -------------------------------------------------------------------
    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(f"{self.config.model.name_or_path}:{self.config.model.seed}".encode())
        for name, examples in self._reference_sets().items():
            h.update(name.encode())
            for e in examples:
                h.update(repr((e.input_ids, e.labels)).encode())
        return h.hexdigest()

    def _reference_sets(self) -> dict[str, list[TokenizedExample]]:
        """Every sequence whose reference log-prob a loss or the evaluation needs, by cache key."""
        if self.config.unpaired:
            order = [i for g in self.schedule.fixed_batches() for i in g]
            return {"train": [self.examples[i].example for i in order],
                    "train_kl": [self.kl_examples[i] for i in order],
                    "eval_chosen": [p.chosen for p in self.eval_pairs],
                    "eval_rejected": [p.rejected for p in self.eval_pairs],
                    "eval_unpaired": [u.example for u in self.eval_unpaired]}
        return {"train_chosen": [p.chosen for p in self.examples],
                "train_rejected": [p.rejected for p in self.examples],
                "eval_chosen": [p.chosen for p in self.eval_pairs],
                "eval_rejected": [p.rejected for p in self.eval_pairs]}

    def example_logprobs(self, examples: Sequence[TokenizedExample]) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~tether.models.logprobs.example_logprobs` under the current model, laid out as ``config.data`` says."""
        data = self.config.data
        return example_logprobs(self.model, examples, row_tokens=data.pack_length,
                                    pad_token_id=self.tokenizer.pad_token_id, packing=data.packing)

    def summed_logprobs(self, examples: Sequence[TokenizedExample]) -> torch.Tensor:
        """Summed completion log-probs under the current weights, without gradients, in chunks."""
        size = 2 * self.config.train.batch_size
        with self.frozen_pass():
            out = [sequence_logprobs(*self.example_logprobs(chunk), average=False)
                   for chunk in chunks(list(examples), size)]
        return torch.cat(out).cpu() if out else torch.zeros(0)

    @property
    def turns(self) -> bool:
        """Whether the loss reads per-turn log-probs (DMPO)."""
        return "turn_logprobs" in self.config.loss_needs

    def pair_reference(self, pairs: Sequence[PairExample]) -> dict[str, torch.Tensor]:
        """Summed completion log-probs of chosen and of rejected under the current weights (and, for turn-level
        losses, per assistant turn), in chunks laid out as in training (a pair's common prefix shared)."""
        data = self.config.data
        with self.frozen_pass():
            return pair_reference_logprobs(self.model, pairs, batch_size=self.config.train.batch_size,
                                           turns=self.turns, row_tokens=data.pack_length,
                                           pad_token_id=self.tokenizer.pad_token_id, packing=data.packing,
                                           prefix_sharing=data.prefix_sharing)

    def prepare_reference(self, *, use_cache: bool) -> None:
        """Reference log-probs of every training and held-out sequence, from the initial weights.

        With ``use_cache`` (resuming) a cache written by an earlier start on the same data is
        reused, since the weights will be those of a checkpoint, not the reference.
        """
        if not self.config.needs_reference:
            return
        path = self.stage_dir / REFERENCE_CACHE
        fingerprint = self._fingerprint()
        if use_cache and path.exists():
            cached = torch.load(path, map_location="cpu", weights_only=True)
            turn_keys = {"train_chosen_turns"} if self.turns else set()
            if cached.get("fingerprint") == fingerprint and turn_keys <= set(cached["logps"]):
                self.ref = cached["logps"]
                log.info("%s: reference log-probs from %s", self.stage, path)
                return
        sets = self._reference_sets()
        if self.config.unpaired:
            # per fixed micro-batch: the same packing as the training forward
            logps = torch.full((len(self.examples), 2), float("nan"))
            for group in self.schedule.fixed_batches():
                both = self.summed_logprobs([self.examples[i].example for i in group]
                                           + [self.kl_examples[i] for i in group])
                logps[group] = torch.stack([both[: len(group)], both[len(group):]], -1)
            ref = {"train": logps, **{k: self.summed_logprobs(v) for k, v in sets.items() if k.startswith("eval")}}
        else:
            ref = {}
            for split, pairs in (("train", self.examples), ("eval", self.eval_pairs)):
                ref.update({f"{split}_{k}": v for k, v in self.pair_reference(pairs).items()})
        self.ref = ref
        if self.dist.is_main:
            self.stage_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            torch.save({"fingerprint": fingerprint, "logps": ref}, tmp)
            os.replace(tmp, path)

    def train(self, *, resume: bool = False) -> dict[str, float]:
        self.prepare_reference(use_cache=resume)
        return super().train(resume=resume)

    # ---- losses ----------------------------------------------------------------------------------------
    def _ref(self, key: str, idx: Sequence[int], device: torch.device) -> torch.Tensor | None:
        if self.ref is None:
            return None
        return self.ref[key][list(idx)].to(device)

    def pair_inputs(self, pairs: Sequence[PairExample], ref_chosen: torch.Tensor | None,
                    ref_rejected: torch.Tensor | None) -> PreferenceInputs:
        """Policy statistics of chosen and rejected (one forward pass) with the given reference log-probs."""
        data = self.config.data
        return preference_inputs(self.model, pairs, ref_chosen, ref_rejected, wpo=self.config.wpo,
                           row_tokens=data.pack_length, pad_token_id=self.tokenizer.pad_token_id,
                           packing=data.packing, prefix_sharing=data.prefix_sharing,
                           reference_model=self.reference_model, turns=self.turns)

    def paired_loss(self, idx: list[int], global_pairs: float) -> tuple[torch.Tensor, dict]:
        device = self.device
        inputs = self.pair_inputs([self.examples[i] for i in idx], self._ref("train_chosen", idx, device),
                                  self._ref("train_rejected", idx, device))
        if self.turns:
            inputs = with_reference_turns(inputs, self.ref["train_chosen_turns"][idx], self.ref["train_rejected_turns"][idx])
        loss, metrics = self.loss(inputs)
        return loss * len(idx) / global_pairs, metrics

    def unpaired_loss(self, idx: list[int], global_examples: float) -> tuple[torch.Tensor, dict]:
        cfg = self.config
        b = len(idx)
        tok, mask = self.example_logprobs([self.examples[i].example for i in idx] + [self.kl_examples[i] for i in idx])
        logps = sequence_logprobs(tok, mask, average=False)
        ref = self.ref["train"][idx].to(logps.device)
        desirable = torch.tensor([self.examples[i].desirable for i in idx], device=logps.device)
        loss, metrics = UNPAIRED_LOSSES.get("kto")(logps[:b], ref[:, 0], desirable, logps[b:], ref[:, 1],
                                                   **cfg.hparams())
        metrics["rewards/margin"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        return loss * b / global_examples, metrics

    def training_step(self) -> dict[str, Any]:
        groups = self.schedule.for_step(self.step)
        denominator = self.global_count(sum(len(g) for g in groups))
        fn = self.unpaired_loss if self.config.unpaired else self.paired_loss
        return self.optimizer_step(groups, lambda g: fn(g, denominator))

    # ---- evaluation -------------------------------------------------------------------------------------
    @torch.no_grad()
    def preference_figures(self) -> dict[str, float]:
        """Held-out implicit-reward accuracy and margin."""
        if self.eval_pairs and self.turns:  # the loss's own reward over turns (DMPO)
            _, metrics = self.loss(held_out_inputs(self.pair_reference(self.eval_pairs), self.ref))
            return self._own_reward_figures(metrics)
        if self.eval_pairs:
            chosen = self.summed_logprobs([p.chosen for p in self.eval_pairs])
            rejected = self.summed_logprobs([p.rejected for p in self.eval_pairs])
            if self.config.needs_reference:
                r_c = self.beta * (chosen - self.ref["eval_chosen"])
                r_r = self.beta * (rejected - self.ref["eval_rejected"])
            else:  # the loss's own reward: SimPO's β·mean log π, ORPO's log odds
                lengths = torch.tensor([[p.chosen.num_loss_tokens, p.rejected.num_loss_tokens]
                                        for p in self.eval_pairs], dtype=torch.float)
                _, metrics = self.loss(PreferenceInputs(chosen, rejected, chosen_lengths=lengths[:, 0],
                                                        rejected_lengths=lengths[:, 1]))
                return self._own_reward_figures(metrics)
            return with_intervals({"implicit_accuracy": float((r_c > r_r).float().mean()),
                                   "implicit_margin": float((r_c - r_r).mean()),
                                   "rewards/chosen": float(r_c.mean()), "rewards/rejected": float(r_r.mean())},
                                  {"implicit_accuracy": (r_c > r_r).float().tolist()}, count=None)
        if self.eval_unpaired:
            rewards = self.beta * (self.summed_logprobs([u.example for u in self.eval_unpaired])
                                   - self.ref["eval_unpaired"])
            desirable = torch.tensor([u.desirable for u in self.eval_unpaired])
            good, bad = rewards[desirable].mean(), rewards[~desirable].mean()
            return {"rewards/desirable": float(good), "rewards/undesirable": float(bad),
                    "implicit_margin": float(good - bad)}
        return {}

    def _own_reward_figures(self, metrics: dict) -> dict[str, float]:
        prefix = f"{self.config.loss_names[0]}/" if isinstance(self.config.loss, dict) else ""
        return {"implicit_accuracy": float(metrics[f"{prefix}rewards/accuracy"]),
                "implicit_margin": float(metrics[f"{prefix}rewards/margin"])}

    def evaluate(self) -> dict[str, float]:
        preference = self.preference_figures()
        task = super().evaluate()
        figures = Figures(preference, outcomes={**getattr(preference, "outcomes", {}), **getattr(task, "outcomes", {})})
        figures.update(task)
        return figures
