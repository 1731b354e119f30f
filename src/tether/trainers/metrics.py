"""Metric sinks: ``metrics.jsonl`` (always), TensorBoard, Weights & Biases (when installed and asked).

Only rank 0 writes. Each record carries ``stage`` and ``step``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from tether.data.files import write_json_atomic
from tether.runtime.progress import format_duration

log = logging.getLogger(__name__)

# The only figures in metrics.jsonl that depend on the clock rather than on the configuration and seed: a
# reproducible run repeats every other field exactly (also under a prefix such as ``iter2/``).
WALL_CLOCK_FIELDS = frozenset({"time", "step_time", "time/generation", "time/frozen_passes", "completions_per_s", "tokens_per_s",
                               "loss_tokens_per_s", "round/generation_time", "round/score_time"})


REWARDS_FILE = "rewards.json"  # in the stage directory: per-sample rewards of the first and latest steps


def is_wall_clock(key: str) -> bool:
    """Whether a metric name is one of :data:`WALL_CLOCK_FIELDS`, bare or under a prefix."""
    return key in WALL_CLOCK_FIELDS or any(key.endswith("/" + field) for field in WALL_CLOCK_FIELDS)


def to_float(value: Any) -> float:
    if hasattr(value, "item"):
        value = value.detach().float().item() if hasattr(value, "detach") else value.item()
    return float(value)


class MetricsLogger:
    def __init__(self, run_dir: Path, stage: str, *, report_to: list[str] = (), enabled: bool = True,
                 config: dict | None = None) -> None:
        self.run_dir, self.stage, self.enabled = Path(run_dir), stage, enabled
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()
        if "tensorboard" in report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard" / stage))
            except ImportError:
                log.warning("tensorboard is not installed; skipping TensorBoard logging")
        if "wandb" in report_to:
            try:
                import wandb

                self._wandb = wandb.init(project="tether", name=f"{self.run_dir.name}/{stage}", config=config,
                                         reinit=True)
            except ImportError:
                log.warning("wandb is not installed; skipping Weights & Biases logging")

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        values = {k: to_float(v) for k, v in metrics.items()}
        if not self.enabled:
            return values
        record = {"stage": self.stage, "step": step, "time": round(time.time(), 3)}
        record.update({k: (v if math.isfinite(v) else None) for k, v in values.items()})
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in values.items():
                if math.isfinite(value):
                    self._tb.add_scalar(f"{self.stage}/{key}", value, step)
        if self._wandb is not None:
            self._wandb.log({f"{self.stage}/{k}": v for k, v in values.items()}, step=step)
        return values

    def rewind(self, step: int) -> None:
        """Drop this stage's records after ``step`` (a resumed run logs them again) and any line a kill
        cut short, so ``metrics.jsonl`` and the stage's ``samples.jsonl`` hold each step once (and
        ``rewards.json`` no step after it)."""
        if not self.enabled:
            return
        self._file.close()
        _drop_after(self.run_dir / "metrics.jsonl", step, stage=self.stage)
        _drop_after(self.run_dir / self.stage / "samples.jsonl", step)
        _rewind_rewards(self.run_dir / self.stage / REWARDS_FILE, step)
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()

    def write_samples(self, step: int, samples: list[dict]) -> None:
        """Sample generations (with their rewards) for inspection: ``<stage>/samples.jsonl``."""
        if not self.enabled:
            return
        path = self.run_dir / self.stage / "samples.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            for sample in samples:
                f.write(json.dumps({"step": step, **sample}) + "\n")

    def write_rewards(self, step: int, rewards: list[float]) -> None:
        """Every sample's reward at the stage's first and latest training steps (``step`` numbered as in
        ``metrics.jsonl``), for the report's reward histograms: ``<stage>/rewards.json``,
        ``{"first": {"step", "rewards"}, "last": {"step", "rewards"}}``, rewritten whole (atomically) at
        every step, so it stays two steps long however long the run."""
        if not self.enabled:
            return
        path = self.run_dir / self.stage / REWARDS_FILE
        entry = {"step": step, "rewards": [float(r) for r in rewards]}
        first = _read_json(path).get("first")
        if not (isinstance(first, dict) and isinstance(first.get("step"), int) and first["step"] <= step):
            first = entry
        write_json_atomic(path, {"first": first, "last": entry}, indent=None)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _rewind_rewards(path: Path, step: int) -> None:
    """``rewards.json`` without the steps after ``step``: the latest falls back to the first, or the file goes."""
    data = _read_json(path)
    if not data:
        return
    steps = {k: v.get("step") for k, v in data.items() if isinstance(v, dict)}
    if not isinstance(steps.get("first"), int) or steps["first"] > step:
        path.unlink()
    elif not isinstance(steps.get("last"), int) or steps["last"] > step:
        write_json_atomic(path, {"first": data["first"], "last": data["first"]}, indent=None)


def _drop_after(path: Path, step: int, *, stage: str | None = None) -> None:
    """Remove the records of ``stage`` (any, when None) after ``step``, and torn lines, from a jsonl file.

    Rewritten in place, so other loggers holding the file open in append mode (a stage that runs trainers
    inside it) keep writing to it; the kept text is first saved to ``<file>.rewind``, from which a rewind
    killed half-way is completed on the next one.
    """
    backup = path.with_name(path.name + ".rewind")
    source = backup if backup.exists() else path
    if not source.exists():
        return
    lines = source.read_text(encoding="utf-8", errors="replace").splitlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not (isinstance(record, dict) and (stage is None or record.get("stage") == stage)
                and isinstance(record.get("step"), int) and record["step"] > step):
            kept.append(line)
    if source is path and len(kept) == len(lines):
        return  # nothing to drop: leave the file alone
    text = "".join(line + "\n" for line in kept)
    with open(backup, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    with open(path, "r+" if path.exists() else "w", encoding="utf-8") as f:
        f.write(text)
        f.truncate()
    backup.unlink()


def read_metrics(run_dir: str | Path, stage: str | None = None) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if stage is None or r.get("stage") == stage]


class PlainProgress:
    """Progress as plain lines when output is not a terminal (a log file, a job's stdout), where the bar draws
    nothing until the end: every ``every`` seconds and at the last step, ``stage: step i/N (p%), loss, steps/s,
    time left``."""

    def __init__(self, stage: str, total: int, start: int, *, enabled: bool, every: float = 30.0) -> None:
        self.stage, self.total, self.start, self.enabled, self.every = stage, total, start, enabled, every
        self.began = self.last = time.monotonic()

    def step(self, step: int, loss: Any = None) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < self.every and step < self.total):
            return
        self.last = now
        rate = (step - self.start) / max(now - self.began, 1e-9)
        left = (self.total - step) / rate if rate > 0 else float("inf")
        loss_text = f", loss {to_float(loss):.4f}" if loss is not None else ""
        print(f"{self.stage}: step {step}/{self.total} ({step / self.total:.0%}){loss_text}, {rate:.2f} steps/s, "
              f"{format_duration(left)} left", flush=True)
