"""Supervised fine-tuning (prompt tokens masked) and pretraining (next token on raw text).

Both are next-token prediction; they differ only in which tokens carry loss, which the
data layer decides. Batches are padding-free packed rows by default.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tether.config.sft import SFTConfig
from tether.core.language_modeling import next_token_loss
from tether.data import make_batches, model_inputs, tokenize_dataset
from tether.data.schemas import DataError
from tether.data.sources import training_records
from tether.trainers.loop import Trainer

log = logging.getLogger(__name__)


class SFTTrainer(Trainer):
    """Next-token loss over labelled tokens, normalised by the global count of loss tokens."""

    def __init__(self, config: SFTConfig, model: torch.nn.Module, tokenizer: Any, run_dir: str | Path,
                 *, records: list[dict] | None = None, stage: str | None = None,
                 evaluator: Callable[[torch.nn.Module, Any], dict[str, float]] | None = None) -> None:
        super().__init__(config, model, tokenizer, run_dir, stage=stage, evaluator=evaluator)
        self.kind = "text" if config.type == "pretrain" else "sft"
        skipped: dict[str, int] = {}
        records = records if records is not None else training_records(config.data, self.kind, skipped)
        if skipped:
            total = sum(skipped.values())
            log.warning("stage %s: skipped %d bad rows of %s (data.on_error: skip): %s", self.stage, total,
                        config.data.path, "; ".join(f"{n} x {k}" for k, n in skipped.items()))
            self.results["data/skipped"] = total
        self.examples, stats = tokenize_dataset(records, tokenizer, kind=self.kind,
                                                max_length=config.data.max_length, overflow=config.data.overflow)
        self.results.update({f"data/{k}": float(stats[k]) for k in ("truncated", "dropped") if stats.get(k)})
        if not self.examples:
            why = (f"all {stats['dropped']} were longer than data.max_length={config.data.max_length} and "
                   "data.overflow is 'drop' (raise max_length, or overflow: truncate)" if stats.get("dropped")
                   else f"{stats.get('records', 0)} records gave none")
            raise DataError(f"stage {self.stage!r}: no training examples left after tokenisation: {why}")
        self.data_stats = stats
        self._epoch_cache: tuple[int, list[dict]] | None = None
        self._steps_per_epoch: int | None = None

    def _epoch_batches(self, epoch: int) -> list[dict]:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            cfg = self.config
            batches = make_batches(
                self.examples, batch_size=cfg.train.batch_size, packing=cfg.data.packing,
                batch_tokens=cfg.data.pack_length if cfg.data.packing else None,
                pad_token_id=self.tokenizer.pad_token_id,
                seed=cfg.train.seed, epoch=epoch, rank=self.dist.rank, world_size=self.dist.world_size,
                drop_last=True,
            )
            if len(batches) < cfg.train.grad_accum:
                rows = f" (packed rows of data.pack_length={cfg.data.pack_length} tokens)" if cfg.data.packing else ""
                raise DataError(
                    f"stage {self.stage!r}: {len(self.examples)} training example(s) fill {len(batches)} full "
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
        logits = self.model(**model_inputs(batch)).logits
        return next_token_loss(logits, batch["labels"], denominator=denominator)

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
        return metrics
