"""The one training loop every trainer shares.

A trainer subclasses :class:`Trainer` and supplies ``training_step`` (what one step
does: take a batch, or generate and score rollouts) and, through ``optimizer_step``,
a loss function per micro-batch. The loop owns everything else: optimiser and
schedule, gradient accumulation and clipping, non-finite guards, checkpoints with
exact resume, metrics, evaluation cadence, the progress bar and rank awareness.

Losses returned by a trainer's loss function are already divided by the *global*
denominator of the whole accumulated (and, under torchrun, all-rank) batch, so the
gradient sum over micro-batches is the gradient of the global mean.

Faults: SIGINT / SIGTERM during ``train`` finish the current step, write a checkpoint and raise
:class:`TrainingInterrupted` (a second signal stops at once); resume takes the newest checkpoint
that verifies against its manifest and falls back past corrupted ones; a non-finite loss or
gradient skips the update, and ``train.max_bad_steps`` in a row stop the run with a diagnostic
naming the parameters and micro-batches.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from rich import get_console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from tether.config.common import StageConfig
from tether.data.files import write_json_atomic
from tether.evaluation import evaluate_task, paired_gains
from tether.models.attention import training_autocast
from tether.models.linear import cpu_multiplies_bfloat16, onednn_linears
from tether.models.loading import disable_dropout, own_trainable_weights
from tether.trainers import checkpoint as ckpt
from tether.trainers import parallel
from tether.trainers.distributed import all_reduce_sum, barrier, init_distributed, reduce_metrics
from tether.trainers.metrics import MetricsLogger, PlainProgress, to_float
from tether.trainers.optimization import build_optimizer, build_scheduler, clip_gradients

log = logging.getLogger(__name__)
BEFORE_OUTCOMES = "eval_before.json"  # per-problem outcomes of the eval.before evaluation, in the stage directory

LossFn = Callable[[Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class NonFiniteError(RuntimeError):
    """Too many consecutive steps produced a non-finite loss or gradient."""


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT / SIGTERM stopped training after a whole step; ``checkpoint`` holds it (None off rank 0).
    A ``KeyboardInterrupt``, so code that catches ``Exception`` does not swallow the stop."""

    def __init__(self, message: str, *, signal_name: str, step: int, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


class _StopSignals:
    """While active (main thread only), SIGINT and SIGTERM set ``name`` instead of stopping the
    process; a second signal raises KeyboardInterrupt at once. The previous handlers come back on exit."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self) -> None:
        self.name: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.name is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without finishing the step")
        self.name = signal.Signals(signum).name
        log.warning("%s received: finishing the current step, then writing a checkpoint (send it again to "
                    "stop at once)", self.name)

    @contextlib.contextmanager
    def active(self) -> Iterator[_StopSignals]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        try:
            for name in self.SIGNALS:
                signum = getattr(signal, name)
                self._previous[signum] = signal.signal(signum, self._handle)
            yield self
        finally:
            for signum, previous in self._previous.items():
                signal.signal(signum, signal.SIG_DFL if previous is None else previous)
            self._previous.clear()


def checkpoint_bytes(model: torch.nn.Module) -> int:
    """About the size of one checkpoint: the weights and AdamW's two float32 moments per trainable value."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights + sum(8 * p.numel() for p in model.parameters() if p.requires_grad)


class Trainer:
    """Base class: owns the loop; subclasses implement :meth:`training_step`."""

    # whether the loss compares the policy's log-probs with a frozen (eval-mode) pass of the same weights, where
    # ``train.dropout: auto`` turns dropout off (as TRL's DPO does by default)
    compares_frozen_passes = False

    def __init__(self, config: StageConfig, model: torch.nn.Module, tokenizer: Any, run_dir: str | Path,
                 *, stage: str | None = None, evaluator: Callable[[torch.nn.Module, Any], dict[str, float]] | None = None
                 ) -> None:
        self.config = config
        self.evaluator = evaluator
        self.model = model
        self.tokenizer = tokenizer
        self.run_dir = Path(run_dir)
        self.stage = stage or config.name or config.type or "train"
        self.stage_dir = self.run_dir / self.stage
        self.dist = init_distributed()  # joins torchrun's process group; a no-op in one process
        self.sharded = config.train.strategy == "fsdp2"  # checkpoints in DCP shards (parallel.py)
        self._parallel = False
        self.step = 0
        self.skipped_steps = 0
        self._bad_in_a_row = 0
        self._first_bad: str | None = None
        self.max_bad_steps = config.train.max_bad_steps
        torch.set_num_threads(config.train.threads)
        dropout = config.train.dropout
        off = dropout == "off" or (dropout == "auto" and self.compares_frozen_passes)
        if off and (disabled := disable_dropout(model)):
            log.info("%s: %d dropout rates set to 0 (train.dropout: %s)", self.stage, disabled, dropout)
        if config.train.precision == "bf16-mixed" and self.device.type == "cpu" and not cpu_multiplies_bfloat16():
            log.warning("%s: train.precision bf16-mixed on a CPU without bfloat16 matrix instructions (AVX-512 BF16, "
                        "AMX or Arm BF16): its bfloat16 products are emulated, several times slower than float32; "
                        "use train.precision fp32 here", self.stage)
        if self.dist.is_main:  # a read-only or full output directory fails here, not at the first checkpoint
            ckpt.check_output_dir(self.run_dir, need_bytes=checkpoint_bytes(model))
        self.optimizer = build_optimizer(model, config.optim, parts=self.optimizer_parts())
        self.scheduler = build_scheduler(self.optimizer, config.optim, self.total_updates())
        self.logger = MetricsLogger(self.run_dir, self.stage, report_to=config.report_to,
                                    enabled=self.dist.is_main, config=config.model_dump(mode="json"))
        self.results: dict[str, float] = {}

    @property
    def device(self) -> torch.device:
        """Where the model's weights are: batches are built on CPU and moved here."""
        return next(self.model.parameters()).device

    # ---- what subclasses implement ------------------------------------------------------------
    def total_updates(self) -> int:
        """Optimiser updates in the whole run (the schedule's length); one per step by default."""
        return self.config.train.max_steps

    def training_step(self) -> dict[str, Any]:
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        """Held-out figures: ``evaluator(model, tokenizer)`` when the trainer was given one, else the task
        evaluation named in ``config.eval``."""
        if self.config.eval is None:
            return {}
        if self.evaluator is not None:
            return self.evaluator(parallel.unwrap(self.model), self.tokenizer)
        return evaluate_task(parallel.unwrap(self.model), self.tokenizer, self.config.eval,
                             progress=self.config.train.progress and self.dist.is_main, label=f"{self.stage} eval")

    def optimizer_parts(self) -> list[tuple[Iterable[torch.nn.Parameter], float]] | None:
        """(parameters, learning rate) per part of ``self.model`` with its own rate; None: one rate."""
        return None

    def load_model_weights(self, checkpoint: Path) -> None:
        """Restore ``self.model``'s weights from a checkpoint; a model of several parts overrides this."""
        ckpt.load_weights(self.model, checkpoint)

    def extra_state(self) -> dict[str, Any]:
        """Trainer-specific state to checkpoint (e.g. a running baseline)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    # ---- shared machinery ---------------------------------------------------------------------
    def parallelize(self) -> None:
        """Under torchrun, wrap the model as ``train.strategy`` says (once, when training starts, so
        that copies a trainer made in ``__init__`` stay whole); FSDP2 replaces the parameters, so the
        still unused optimiser and schedule are rebuilt over the sharded ones. First, trainable CPU
        weights leave a loader's file mapping (:func:`~tether.models.loading.own_trainable_weights`)."""
        if self._parallel:
            return
        self._parallel = True
        own_trainable_weights(self.model)
        wrapped = parallel.wrap_model(self.model, self.config.train.strategy)
        if wrapped is self.model and not parallel.is_sharded(wrapped):
            return
        self.model = wrapped
        if parallel.is_sharded(wrapped):
            self.optimizer = build_optimizer(wrapped, self.config.optim, parts=self.optimizer_parts())
            self.scheduler = build_scheduler(self.optimizer, self.config.optim, self.total_updates())
            # evaluation generates a different number of tokens per rank: whole weights, no per-call gathers
            self.evaluate = parallel.gathered(wrapped, self.evaluate)

    def training_forward(self, model: torch.nn.Module | None = None) -> contextlib.AbstractContextManager:
        """The training forward's precision and kernels for ``model`` (default the trained one): bfloat16
        autocast under ``train.precision: bf16-mixed`` (weights and gradients stay float32; matmuls run in
        bfloat16; its attention kernel as :func:`~tether.models.attention.training_autocast` picks it), else
        float32 with the linear layers on the faster CPU kernel (:func:`~tether.models.linear.onednn_linears`;
        a no-op on GPUs and where PyTorch's own kernel is the faster)."""
        model = self.model if model is None else model
        if self.config.train.precision != "bf16-mixed":
            return onednn_linears(model)
        return training_autocast(model, self.device)

    @contextlib.contextmanager
    def frozen_pass(self, *switches: contextlib.AbstractContextManager,
                    model: torch.nn.Module | None = None) -> Iterator[None]:
        """A forward pass that trains nothing (reference, old-policy, critic-value or teacher scores): the policy
        in eval mode, no gradients, ``switches`` entered (an adapter turned off), and the training forward's
        precision and kernels (:meth:`training_forward`) for ``model``, the one that runs (default the policy; a separate
        reference model must be named), so that a policy equal to its reference scores 0 under ``bf16-mixed``
        too. The policy's train / eval mode is restored afterwards."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), contextlib.ExitStack() as stack:
                for switch in switches:
                    stack.enter_context(switch)
                stack.enter_context(self.training_forward(model))
                yield
        finally:
            self.model.train(was_training)

    def global_count(self, local: float | torch.Tensor) -> float:
        """A count summed over ranks, scaled for DDP's gradient averaging, for use as a loss denominator."""
        total = float(all_reduce_sum(local))
        return max(total, 1.0) / self.dist.world_size

    def optimizer_step(self, micro_batches: Iterable[Any], loss_fn: LossFn,
                       after_backward: Callable[[], None] | None = None) -> dict[str, float]:
        """Forward/backward over the micro-batches, ``after_backward()`` (when given), clip, step the optimiser
        and schedule."""
        self.model.train()
        totals: dict[str, float] = {}
        loss_sum, n = 0.0, 0
        bad_batches = []
        for batch in micro_batches:
            with self.training_forward():
                loss, metrics = loss_fn(batch)
            loss.backward()
            value = to_float(loss)
            if not math.isfinite(value):
                bad_batches.append(n)
            loss_sum += value
            n += 1
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + to_float(value)
        if after_backward is not None:
            after_backward()
        out = {k: v / max(n, 1) for k, v in totals.items()}
        out["loss"] = loss_sum
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = clip_gradients(params, self.config.optim.max_grad_norm or float("inf"))
        out["grad_norm"] = grad_norm
        out["lr"] = self.scheduler.get_last_lr()[0]
        if not (math.isfinite(grad_norm) and math.isfinite(loss_sum)):
            self.skipped_steps += 1
            self._bad_in_a_row += 1
            diagnostic = self.nonfinite_diagnostic(bad_batches, n, loss_sum, grad_norm)
            self._first_bad = self._first_bad or diagnostic
            self.optimizer.zero_grad(set_to_none=True)
            log.warning("%s: update skipped (%d in a row, %d allowed)", diagnostic, self._bad_in_a_row,
                        self.max_bad_steps - 1)
            if self._bad_in_a_row >= self.max_bad_steps:
                first = "" if self._bad_in_a_row == 1 else f"; the first of them: {self._first_bad}"
                raise NonFiniteError(f"{self._bad_in_a_row} consecutive non-finite steps (train.max_bad_steps="
                                     f"{self.max_bad_steps}); the last: {diagnostic}{first}")
        else:
            self._bad_in_a_row = 0
            self._first_bad = None
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        out["skipped_steps"] = self.skipped_steps
        return out

    def nonfinite_diagnostic(self, bad_batches: list[int], n_batches: int, loss: float, grad_norm: float) -> str:
        """Which step, which micro-batches had a non-finite loss, which parameters a non-finite gradient."""
        names, total = [], 0
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            total += 1
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # a DTensor shard under FSDP
            if grad is not None and not bool(torch.isfinite(grad).all()):
                names.append(name)
        shown = ", ".join(names[:8]) + (f", ... ({len(names) - 8} more)" if len(names) > 8 else "")
        grads = f"non-finite gradient in {len(names)} of {total} parameters ({shown})" if names else \
            "every gradient finite"
        batches = (f"non-finite loss in micro-batch(es) {', '.join(map(str, bad_batches))} of {n_batches}"
                   if bad_batches else f"finite loss in all {n_batches} micro-batch(es)")
        return f"step {self.step + 1}: loss={loss}, grad_norm={grad_norm}; {batches}; {grads}"

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            **({} if self.sharded else {"optimizer": self.optimizer.state_dict()}),  # sharded: in the DCP shards
            "scheduler": self.scheduler.state_dict(),
            "rng": ckpt.rng_state(),
            "skipped_steps": self.skipped_steps,
            "extra": self.extra_state(),
        }

    def save_checkpoint(self) -> Path | None:
        if self.sharded:  # every rank writes its shards
            return parallel.save_sharded_checkpoint(self.stage_dir, self.step, self.model, self.optimizer,
                                                    self.tokenizer, self.state_dict(),
                                                    keep=self.config.train.keep_checkpoints)
        if not self.dist.is_main:
            return None
        return ckpt.save_checkpoint(self.stage_dir, self.step, self.model, self.tokenizer, self.state_dict(),
                                    keep=self.config.train.keep_checkpoints)

    def resume(self) -> bool:
        """Restore the newest checkpoint of this stage that verifies against its manifest; False if there
        is none. A corrupted one is skipped with a warning (and set aside as ``step-N.corrupt`` once an
        older one loads); :class:`~tether.trainers.checkpoint.CheckpointError` if none is usable."""
        checkpoints = ckpt.list_checkpoints(self.stage_dir)
        if not checkpoints:
            if self.dist.is_main:  # a start killed before its first checkpoint logged steps that will rerun
                self.logger.rewind(0)
            return False
        failed: list[tuple[Path, str]] = []
        for path in reversed(checkpoints):
            try:
                ckpt.verify_checkpoint(path)
                self.load_checkpoint(path)
            except ckpt.CheckpointError as err:
                log.warning("%s; falling back to the previous checkpoint", err)
                failed.append((path, str(err)))
                continue
            if self.dist.is_main:
                for bad, _ in failed:
                    log.warning("set aside corrupted checkpoint %s as %s", bad, ckpt.set_aside(bad).name)
                self.logger.rewind(self.step)
            log.warning("resumed %s from %s (step %d)", self.stage, path, self.step)
            return True
        raise ckpt.CheckpointError(f"no usable checkpoint in {ckpt.checkpoint_dir(self.stage_dir)}: "
                                   + "; ".join(reason for _, reason in failed)
                                   + ". Delete that folder to start the stage over.")

    def load_checkpoint(self, path: Path) -> None:
        """Restore weights, optimiser, schedule, RNG, step and trainer extras from one checkpoint."""
        state = ckpt.load_trainer_state(path)
        if parallel.is_sharded_checkpoint(path):  # resharded to this job's ranks, whatever wrote it
            parallel.load_sharded(path, self.model, self.optimizer)
        elif parallel.is_sharded(self.model):
            raise ckpt.CheckpointError(f"checkpoint {path} was written without train.strategy fsdp2; resume it "
                                       "with train.strategy ddp")
        else:
            self.load_model_weights(path)
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        ckpt.set_rng_state(state["rng"])
        self.step = state["step"]
        self.skipped_steps = state.get("skipped_steps", 0)
        self.load_extra_state(state.get("extra", {}))

    def _progress(self) -> Progress:
        """The progress bar on a terminal (:class:`PlainProgress` writes lines when output goes to a file)."""
        return Progress(
            TextColumn(f"[bold]{self.stage}[/]"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
            disable=not (self.config.train.progress and self.dist.is_main), transient=False,
        )

    def _stop_requested(self, signals: _StopSignals) -> bool:
        """A signal seen by any rank stops every rank at the same step."""
        if self.dist.world_size == 1:
            return signals.name is not None
        return float(all_reduce_sum(float(signals.name is not None))) > 0

    def _checkpoint_due(self, last_save: float) -> bool:
        """Whether this step ends with a checkpoint: every ``save_every`` steps, or once ``save_every_minutes``
        have passed since the last (decided together under torchrun: a checkpoint is collective)."""
        cfg = self.config.train
        if cfg.save_every and self.step % cfg.save_every == 0:
            return True
        due = cfg.save_every_minutes is not None and time.monotonic() - last_save >= 60 * cfg.save_every_minutes
        if self.dist.world_size > 1:
            due = bool(all_reduce_sum(float(due)) > 0)
        return due

    def _stop(self, signals: _StopSignals, saved_step: int | None) -> TrainingInterrupted:
        if saved_step != self.step:
            path = self.save_checkpoint()
        else:  # the step's own checkpoint was just written
            path = ckpt.list_checkpoints(self.stage_dir)[-1] if self.dist.is_main else None
        name = signals.name or "a signal on another rank"
        message = (f"{name}: stopped {self.stage} after step {self.step} of {self.config.train.max_steps}; "
                   f"checkpoint {path}. Resume with --resume and the same --out (tether run resumes by "
                   "default; Python: resume=True)")
        return TrainingInterrupted(message, signal_name=name, step=self.step, checkpoint=path)

    def train(self, *, resume: bool = False) -> dict[str, float]:
        """Run to ``max_steps``; returns the final evaluation figures. SIGINT / SIGTERM stop it after the
        current step with a checkpoint (:class:`TrainingInterrupted`)."""
        cfg = self.config.train
        self.parallelize()
        signals = _StopSignals()
        with signals.active():
            if resume:
                self.resume()
            if self.config.eval is not None and self.config.eval.before and self.step == 0:
                before = self.evaluate()
                self.results.update({f"before/{k}": v for k, v in before.items()})
                self.logger.log(0, {f"eval/{k}": v for k, v in before.items()})
                if self.dist.is_main:  # kept on disk: a resumed run still reports its paired gain
                    self.stage_dir.mkdir(parents=True, exist_ok=True)
                    write_json_atomic(self.stage_dir / BEFORE_OUTCOMES, getattr(before, "outcomes", {}))
            saved_step: int | None = self.step if self.step > 0 else None  # a resumed step has its checkpoint
            plain_progress = PlainProgress(self.stage, cfg.max_steps, self.step,
                                           enabled=cfg.progress and self.dist.is_main and not get_console().is_terminal)
            last_save = time.monotonic()
            mid_step = False
            try:
                with self._progress() as progress:
                    task = progress.add_task("train", total=cfg.max_steps, completed=self.step, info="")
                    while self.step < cfg.max_steps and not self._stop_requested(signals):
                        start = time.perf_counter()
                        mid_step = True
                        metrics = self.training_step()
                        self.step += 1
                        mid_step = False
                        metrics["step_time"] = time.perf_counter() - start
                        if "loss" in metrics:
                            self.results["train/loss"] = float(to_float(metrics["loss"]))
                        progress.update(task, advance=1, info=f"loss {metrics.get('loss', float('nan')):.4f}")
                        plain_progress.step(self.step, metrics.get("loss"))
                        if self.step % cfg.log_every == 0 or self.step == cfg.max_steps:
                            self.logger.log(self.step, reduce_metrics(metrics))
                        if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.max_steps:
                            self.logger.log(self.step, {f"eval/{k}": v for k, v in self.evaluate().items()})
                        if self._checkpoint_due(last_save):
                            self.save_checkpoint()
                            saved_step, last_save = self.step, time.monotonic()
            except KeyboardInterrupt:
                if mid_step:  # the weights may hold part of a step: a checkpoint now would not resume exactly
                    last = ckpt.list_checkpoints(self.stage_dir)
                    log.warning("interrupted during step %d; no checkpoint written (the last is %s); resume "
                                "with --resume", self.step + 1, last[-1] if last else "none")
                else:
                    path = self.save_checkpoint()
                    log.warning("interrupted at step %d; checkpoint %s; resume with --resume", self.step, path)
                raise
            if signals.name is not None or (self.dist.world_size > 1 and self.step < cfg.max_steps):
                raise self._stop(signals, saved_step)
            if cfg.save_every_minutes is not None and saved_step != self.step:
                self.save_checkpoint()  # the trained model is safe before the final evaluation: a stop there resumes here
        self.results["train/steps"] = self.step
        final = self.evaluate()
        self.results.update(final)
        before_path = self.stage_dir / BEFORE_OUTCOMES
        if self.dist.is_main and before_path.exists():
            self.results.update(paired_gains(json.loads(before_path.read_text()), getattr(final, "outcomes", {})))
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
        full = parallel.full_state_dict(self.model)  # FSDP2: gathered to rank 0 (collective)
        if self.dist.is_main:
            self.stage_dir.mkdir(parents=True, exist_ok=True)
            ckpt.export_final(self.stage_dir, parallel.unwrap(self.model), self.tokenizer, state_dict=full,
                              checkpoint=ckpt.newest_at(self.stage_dir, self.step))
            ckpt.mark_done(self.stage_dir, {"stage": self.stage, "type": self.config.type, "step": self.step,
                                            "results": self.results})
        self.logger.close()
        barrier()  # under torchrun no rank moves on (to a next stage reading this one) before the export
