"""The one training loop every trainer shares.

A trainer subclasses :class:`Trainer` and supplies ``training_step`` (what one step
does: take a batch, or generate and score rollouts) and, through ``optimizer_step``,
a loss function per micro-batch. The loop owns everything else: optimiser and
schedule, gradient accumulation and clipping, non-finite guards, checkpoints with
exact resume, metrics, evaluation cadence, the progress bar and rank awareness.

Losses returned by a trainer's loss function are already divided by the *global*
denominator of the whole accumulated (and, under torchrun, all-rank) batch, so the
gradient sum over micro-batches is the gradient of the global mean.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from tether.config import OptimConfig, StageConfig
from tether.trainers import checkpoint as ckpt
from tether.trainers.distributed import DistInfo, all_reduce_sum
from tether.trainers.metrics import MetricsLogger, to_float

log = logging.getLogger(__name__)

LossFn = Callable[[Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class NonFiniteError(RuntimeError):
    """Too many consecutive steps produced a non-finite loss or gradient."""


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=True)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    warmup = cfg.warmup_steps or int(cfg.warmup_ratio * total_steps)
    if cfg.schedule == "cosine":
        return get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, total_steps,
                                                           min_lr_rate=cfg.min_lr_ratio)
    if cfg.schedule == "linear":
        return get_linear_schedule_with_warmup(optimizer, warmup, total_steps)
    return get_constant_schedule_with_warmup(optimizer, warmup)


class Trainer:
    """Base class: owns the loop; subclasses implement :meth:`training_step`."""

    def __init__(self, config: StageConfig, model: torch.nn.Module, tokenizer: Any, run_dir: str | Path,
                 *, stage: str | None = None) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.run_dir = Path(run_dir)
        self.stage = stage or config.name or config.type or "train"
        self.stage_dir = self.run_dir / self.stage
        self.dist = DistInfo.current()
        self.step = 0
        self.skipped_steps = 0
        self._bad_in_a_row = 0
        self.max_bad_steps = 5
        if config.train.threads:
            torch.set_num_threads(config.train.threads)
        self.optimizer = build_optimizer(model, config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.optim, self.total_updates())
        self.logger = MetricsLogger(self.run_dir, self.stage, report_to=config.report_to,
                                    enabled=self.dist.is_main, config=config.model_dump(mode="json"))
        self.results: dict[str, float] = {}

    # ---- what subclasses implement ------------------------------------------------------------
    def total_updates(self) -> int:
        """Optimiser updates in the whole run (the schedule's length); one per step by default."""
        return self.config.train.max_steps

    def training_step(self) -> dict[str, Any]:
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        """Held-out figures; the default runs the task evaluation named in ``config.eval``."""
        if self.config.eval is None:
            return {}
        from tether.evaluation import evaluate_task

        return evaluate_task(self.model, self.tokenizer, self.config.eval)

    def extra_state(self) -> dict[str, Any]:
        """Trainer-specific state to checkpoint (e.g. a running baseline)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    # ---- shared machinery ---------------------------------------------------------------------
    def global_count(self, local: float | torch.Tensor) -> float:
        """A count summed over ranks, scaled for DDP's gradient averaging, for use as a loss denominator."""
        total = float(all_reduce_sum(local))
        return max(total, 1.0) / self.dist.world_size

    def optimizer_step(self, micro_batches: Iterable[Any], loss_fn: LossFn) -> dict[str, float]:
        """Forward/backward over the micro-batches, clip, step the optimiser and schedule."""
        self.model.train()
        totals: dict[str, float] = {}
        loss_sum, n = 0.0, 0
        for batch in micro_batches:
            loss, metrics = loss_fn(batch)
            loss.backward()
            loss_sum += to_float(loss)
            n += 1
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + to_float(value)
        out = {k: v / max(n, 1) for k, v in totals.items()}
        out["loss"] = loss_sum
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.config.optim.max_grad_norm or float("inf")
        grad_norm = to_float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        out["grad_norm"] = grad_norm
        out["lr"] = self.scheduler.get_last_lr()[0]
        if not (math.isfinite(grad_norm) and math.isfinite(loss_sum)):
            self.skipped_steps += 1
            self._bad_in_a_row += 1
            self.optimizer.zero_grad(set_to_none=True)
            log.warning("non-finite loss or gradient at step %d: update skipped", self.step)
            if self._bad_in_a_row >= self.max_bad_steps:
                raise NonFiniteError(f"{self._bad_in_a_row} consecutive non-finite steps (last at step "
                                     f"{self.step}, loss={loss_sum}, grad_norm={grad_norm})")
        else:
            self._bad_in_a_row = 0
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        out["skipped_steps"] = self.skipped_steps
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": ckpt.rng_state(),
            "skipped_steps": self.skipped_steps,
            "extra": self.extra_state(),
        }

    def save_checkpoint(self) -> Path | None:
        if not self.dist.is_main:
            return None
        return ckpt.save_checkpoint(self.stage_dir, self.step, self.model, self.tokenizer, self.state_dict(),
                                    keep=self.config.train.keep_checkpoints)

    def resume(self) -> bool:
        """Restore the latest complete checkpoint of this stage; False if there is none."""
        checkpoints = ckpt.list_checkpoints(self.stage_dir)
        if not checkpoints:
            return False
        path = checkpoints[-1]
        ckpt.load_weights(self.model, path)
        state = ckpt.load_trainer_state(path)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        ckpt.set_rng_state(state["rng"])
        self.step = state["step"]
        self.skipped_steps = state.get("skipped_steps", 0)
        self.load_extra_state(state.get("extra", {}))
        log.info("resumed %s from %s (step %d)", self.stage, path, self.step)
        return True

    def _progress(self) -> Progress:
        return Progress(
            TextColumn(f"[bold]{self.stage}[/]"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
            disable=not (self.config.train.progress and self.dist.is_main), transient=False,
        )

    def train(self, *, resume: bool = False) -> dict[str, float]:
        """Run to ``max_steps``; returns the final evaluation figures."""
        cfg = self.config.train
        if resume:
            self.resume()
        if self.config.eval is not None and self.config.eval.before and self.step == 0:
            before = self.evaluate()
            self.results.update({f"before/{k}": v for k, v in before.items()})
            self.logger.log(0, {f"eval/{k}": v for k, v in before.items()})
        try:
            with self._progress() as progress:
                task = progress.add_task("train", total=cfg.max_steps, completed=self.step, info="")
                while self.step < cfg.max_steps:
                    start = time.perf_counter()
                    metrics = self.training_step()
                    self.step += 1
                    metrics["step_time"] = time.perf_counter() - start
                    progress.update(task, advance=1, info=f"loss {metrics.get('loss', float('nan')):.4f}")
                    if self.step % cfg.log_every == 0 or self.step == cfg.max_steps:
                        self.logger.log(self.step, metrics)
                    if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.max_steps:
                        self.logger.log(self.step, {f"eval/{k}": v for k, v in self.evaluate().items()})
                    if cfg.save_every and self.step % cfg.save_every == 0:
                        self.save_checkpoint()
        except KeyboardInterrupt:
            path = self.save_checkpoint()
            log.warning("interrupted at step %d; checkpoint %s; resume with --resume", self.step, path)
            raise
        final = self.evaluate()
        self.results.update(final)
        if final:
            self.logger.log(self.step, {f"eval/{k}": v for k, v in final.items()})
        return self.results

    def fit(self, *, resume: bool = False) -> dict[str, float]:
        """Train, export the final model, mark the stage finished; returns the evaluation figures."""
        results = self.train(resume=resume)
        self.finish()
        return results

    def finish(self) -> None:
        """Export the final model into the stage directory and mark the stage finished."""
        if self.dist.is_main:
            self.stage_dir.mkdir(parents=True, exist_ok=True)
            ckpt.export_final(self.stage_dir, self.model, self.tokenizer)
            ckpt.mark_done(self.stage_dir, {"stage": self.stage, "type": self.config.type, "step": self.step,
                                            "results": self.results})
        self.logger.close()
