"""Supervised fine-tuning (prompt tokens masked) and pretraining (next token on raw text).

Both are next-token prediction; they differ only in which tokens carry loss, which the
data layer decides. Batches are padding-free packed rows by default. With ``data.mix`` each epoch's
examples come from several sources by weight (``tether.data.mixing``), and every step logs how many
of its examples each source gave (``data/source/<name>/examples``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tether.config.sft import SFTConfig
from tether.core.language_modeling import next_token_loss, predicted_labels
from tether.data import TokenizedExample, make_batches, model_inputs, tokenize_dataset
from tether.data.mixing import Mixture
from tether.data.schemas import DataError
from tether.data.sources import mix_records, training_records
from tether.models.output_head import head_at, output_head
from tether.trainers.distributed import all_reduce_sum
from tether.trainers.loop import Trainer

log = logging.getLogger(__name__)


class SFTTrainer(Trainer):
    """Next-token loss over labelled tokens, normalised by the global count of loss tokens."""

    def __init__(self, config: SFTConfig, model: torch.nn.Module, tokenizer: Any, run_dir: str | Path,
                 *, records: list[dict] | None = None, stage: str | None = None,
                 evaluator: Callable[[torch.nn.Module, Any], dict[str, float]] | None = None) -> None:
        super().__init__(config, model, tokenizer, run_dir, stage=stage, evaluator=evaluator)
        self.kind = "text" if config.type == "pretrain" else "sft"
        self.mixture: Mixture[TokenizedExample] | None = None
        if records is None and config.data.mix is not None:
            self.examples = self._load_mixture()
        else:
            self.examples = self._load(records)
        self._epoch_cache: tuple[int, list[dict]] | None = None
        self._steps_per_epoch: int | None = None

    def _tokenize(self, records: list[dict], what: str) -> list[TokenizedExample]:
        data = self.config.data
        examples, stats = tokenize_dataset(records, self.tokenizer, kind=self.kind, max_length=data.max_length,
                                           overflow=data.overflow)
        for key in ("truncated", "dropped"):
            if stats.get(key):
                self.results[f"data/{key}"] = self.results.get(f"data/{key}", 0.0) + float(stats[key])
        if not examples:
            why = (f"all {stats['dropped']} were longer than data.max_length={data.max_length} and "
                   "data.overflow is 'drop' (raise max_length, or overflow: truncate)" if stats.get("dropped")
                   else f"{stats.get('records', 0)} records gave none")
            raise DataError(f"stage {self.stage!r}: no training examples left {what}after tokenisation: {why}")
        self.data_stats = stats
        return examples

    def _load(self, records: list[dict] | None) -> list[TokenizedExample]:
        skipped: dict[str, int] = {}
        records = records if records is not None else training_records(self.config.data, self.kind, skipped)
        if skipped:
            self._count_skipped(skipped, self.config.data.path)
        return self._tokenize(records, "")

    def _load_mixture(self) -> list[TokenizedExample]:
        names, sources, weights = [], [], []
        for source, records, skipped in mix_records(self.config.data, self.kind):
            if skipped:
                self._count_skipped(skipped, f"data.mix source {source.label!r}")
            names.append(source.label)
            sources.append(self._tokenize(records, f"in data.mix source {source.label!r} "))
            weights.append(source.weight)
        self.mixture = Mixture.build(names, sources, weights, size=self.config.data.mix_size,
                                     seed=self.config.train.seed)
        self.source_examples = dict.fromkeys(names, 0)
        parts = []
        for name, items, count in zip(names, sources, self.mixture.counts, strict=True):
            self.results[f"data/source/{name}/records"] = float(len(items))
            self.results[f"data/source/{name}/per_epoch"] = float(count)
            self.results[f"data/source/{name}/examples"] = 0.0
            parts.append(f"{count} of {name} ({len(items)} distinct)")
        log.info("stage %s: each epoch mixes %s", self.stage, ", ".join(parts))
        self.logger.log(0, {k: v for k, v in self.results.items() if k.endswith(("/records", "/per_epoch"))})
        return [example for items in sources for example in items]

    def _count_skipped(self, skipped: dict[str, int], where: str | None) -> None:
        total = sum(skipped.values())
        log.warning("stage %s: skipped %d bad rows of %s (data.on_error: skip): %s", self.stage, total, where,
                    "; ".join(f"{n} x {k}" for k, n in skipped.items()))
        self.results["data/skipped"] = self.results.get("data/skipped", 0) + total

    def _epoch_batches(self, epoch: int) -> list[dict]:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            cfg = self.config
            examples, source_of = (self.examples, None) if self.mixture is None else self.mixture.epoch(epoch)
            batches = make_batches(
                examples, batch_size=cfg.train.batch_size, packing=cfg.data.packing,
                batch_tokens=cfg.data.pack_length if cfg.data.packing else None,
                pad_token_id=self.tokenizer.pad_token_id,
                seed=cfg.train.seed, epoch=epoch, rank=self.dist.rank, world_size=self.dist.world_size,
                drop_last=True, indices=source_of is not None,
            )
            if source_of is not None:  # each micro-batch: how many of its examples each source gave
                for batch in batches:
                    counts = [0] * len(self.mixture.names)
                    for i in batch.pop("indices"):
                        counts[source_of[i]] += 1
                    batch["source_counts"] = counts
            if len(batches) < cfg.train.grad_accum:
                rows = f" (packed rows of data.pack_length={cfg.data.pack_length} tokens)" if cfg.data.packing else ""
                raise DataError(
                    f"stage {self.stage!r}: {len(examples)} training example(s) fill {len(batches)} full "
                    f"batch(es) of train.batch_size={cfg.train.batch_size}{rows}, and one optimiser step needs "
                    f"train.grad_accum={cfg.train.grad_accum}: give more data or lower train.batch_size")
            self._epoch_cache = (epoch, batches)
        return self._epoch_cache[1]

    def micro_batches_for_step(self, step: int) -> list[dict]:
        """The micro-batches of optimiser step ``step``: a pure function of the step, for exact resume."""
        accum = self.config.train.grad_accum
        if self._steps_per_epoch is None:
            self._steps_per_epoch = len(self._epoch_batches(0)) // accum
        per_epoch = self._steps_per_epoch
        epoch, offset = divmod(step, per_epoch)
        batches = self._epoch_batches(epoch)
        return batches[offset * accum:(offset + 1) * accum]

    def loss_fn(self, batch: dict, denominator: float) -> tuple[torch.Tensor, dict]:
        device = self.device  # batches are built on CPU
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        head = output_head(self.model)
        if head is None:
            logits = self.model(**model_inputs(batch)).logits
            return next_token_loss(logits, batch["labels"], denominator=denominator)
        # a large vocabulary: the head at the loss positions only (tether.models.output_head)
        predicted = predicted_labels(batch["labels"]).reshape(-1)
        positions = (predicted != -100).nonzero().squeeze(-1)
        with head_at(head, positions):
            logits = self.model(**model_inputs(batch)).logits  # (1, K, V)
        return next_token_loss(logits, predicted[positions][None], denominator=denominator, aligned=True)

    def training_step(self) -> dict[str, Any]:
        batches = self.micro_batches_for_step(self.step)
        loss_tokens = sum(int(b["num_loss_tokens"]) for b in batches)
        tokens = sum(int(b["num_tokens"]) for b in batches)
        denominator = self.global_count(loss_tokens)
        start = time.perf_counter()
        metrics = self.optimizer_step(batches, lambda b: self.loss_fn(b, denominator))
        elapsed = time.perf_counter() - start
        metrics.pop("nll_sum", None)
        metrics["loss_tokens"] = loss_tokens
        metrics["tokens_per_s"] = tokens / elapsed
        metrics["loss_tokens_per_s"] = loss_tokens / elapsed
        if self.mixture is not None:
            metrics.update(self._source_metrics(batches))
        return metrics

    def _source_metrics(self, batches: list[dict]) -> dict[str, float]:
        """This step's examples per source, over all ranks; their running totals go into the results."""
        local = torch.tensor([sum(b["source_counts"][i] for b in batches) for i in range(len(self.mixture.names))])
        counts = all_reduce_sum(local).tolist()
        metrics = {}
        for name, count in zip(self.mixture.names, counts, strict=True):
            self.source_examples[name] += int(count)
            self.results[f"data/source/{name}/examples"] = float(self.source_examples[name])
            metrics[f"data/source/{name}/examples"] = count
        return metrics

    def extra_state(self) -> dict[str, Any]:
        return {"source_examples": dict(self.source_examples)} if self.mixture is not None else {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if self.mixture is not None and "source_examples" in state:
            self.source_examples = {name: int(state["source_examples"].get(name, 0)) for name in self.mixture.names}
            self.results.update({f"data/source/{name}/examples": float(n) for name, n in self.source_examples.items()})
