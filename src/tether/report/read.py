"""Reading a run directory for its report: metrics, results, samples, how each stage ended, run facts."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)

NOT_METRICS = frozenset({"stage", "step", "time"})
SAMPLES_PER_STEP = 8

Series = dict[float, float]  # step -> value
StageMetrics = dict[str, Series]  # metric name -> series


def read_jsonl(path: Path) -> tuple[list[dict], int]:
    """The JSON objects of a jsonl file and the count of lines that were not one (a run killed
    mid-write can leave a torn last line; the report shows the rest)."""
    if not path.exists():
        return [], 0
    rows, bad = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


def as_number(value: Any) -> float | None:
    """``value`` as a finite float, or None for NaN / inf / null / strings / booleans."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def stage_metrics(rows: Iterable[dict]) -> dict[str, StageMetrics]:
    """Numeric series per stage and metric, stages in the order they first logged. A step logged
    twice (a stage resumed from a checkpoint re-logs the steps after it) keeps its last value."""
    out: dict[str, StageMetrics] = {}
    for row in rows:
        step = as_number(row.get("step"))
        if step is None:
            continue
        metrics = out.setdefault(str(row.get("stage", "?")), {})
        for key, value in row.items():
            number = as_number(value)
            if key not in NOT_METRICS and number is not None:
                metrics.setdefault(key, {})[step] = number
    return out


def read_results(run_dir: Path) -> dict[str, dict]:
    """``results.json`` (figures keyed by stage), or ``{}`` when missing or unreadable."""
    path = run_dir / "results.json"
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError:
        log.warning("%s is not valid JSON; the report has no results table", path.name)
        return {}
    return {str(k): v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


def read_samples(stage_dir: Path) -> list[dict]:
    """Samples of a stage's first and last sampled steps (``write_samples``), to compare the two."""
    rows, _ = read_jsonl(stage_dir / "samples.jsonl")
    steps = sorted({r.get("step") for r in rows if as_number(r.get("step")) is not None})
    keep = {steps[0], steps[-1]} if steps else set()
    picked: list[dict] = []
    for step in sorted(keep):
        picked += [r for r in rows if r.get("step") == step][:SAMPLES_PER_STEP]
    return picked


REWARDS_FILE = "rewards.json"  # written by tether.trainers.metrics.MetricsLogger.write_rewards


def read_rewards(stage_dir: Path) -> dict[int, list[float]]:
    """Per-sample rewards of a stage's first and latest training steps (``STAGE/rewards.json``), step -> rewards
    (finite ones only), or ``{}`` when the stage wrote none or the file is unreadable."""
    try:
        data = json.loads((stage_dir / REWARDS_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    out: dict[int, list[float]] = {}
    for key in ("first", "last"):
        entry = data.get(key) if isinstance(data, dict) else None
        if isinstance(entry, dict) and isinstance(entry.get("step"), int) and isinstance(entry.get("rewards"), list):
            rewards = [r for r in map(as_number, entry["rewards"]) if r is not None]
            if rewards:
                out[entry["step"]] = rewards
    return dict(sorted(out.items()))


def run_title(run_dir: Path, config_file: str = "config.yaml") -> tuple[str, str]:
    """Name and description of the recipe from ``config.yaml``, else the folder's name."""
    try:
        config = yaml.safe_load((run_dir / config_file).read_text())
    except (OSError, yaml.YAMLError):
        config = None
    config = config if isinstance(config, dict) else {}
    return str(config.get("name") or run_dir.resolve().name), str(config.get("description") or "")


RUN_FACTS = "run.json"  # written by tether.stages.run_facts


def read_run_facts(run_dir: Path) -> dict[str, Any]:
    """``run.json`` (commands, versions, commit, seconds per stage), or ``{}`` when missing or unreadable."""
    try:
        facts = json.loads((Path(run_dir) / RUN_FACTS).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return facts if isinstance(facts, dict) else {}


def is_flat(series: Series) -> bool:
    """Whether a series never moves (all its values equal): folded away in the report, listed by value."""
    values = set(series.values())
    return len(values) <= 1


def stage_status(stage_dir: Path) -> str:
    """``finished``, ``interrupted at step N`` (a checkpoint, no stage.json) or ``not finished``."""
    if (stage_dir / "stage.json").exists():
        return "finished"
    steps = sorted(int(p.name.split("-")[1]) for p in (stage_dir / "checkpoints").glob("step-*")
                   if p.name.split("-")[1].isdigit()) if (stage_dir / "checkpoints").is_dir() else []
    return f"interrupted at step {steps[-1]}" if steps else "not finished"


def stage_seconds(facts: dict[str, Any], rows: list[dict]) -> dict[str, float]:
    """Wall-clock seconds per stage: from ``run.json``'s ``facts`` (summed over invocations), else the span
    of the stage's ``time`` stamps in ``metrics.jsonl`` (older runs)."""
    recorded = facts.get("stage_seconds")
    if isinstance(recorded, dict) and recorded:
        return {str(k): float(v) for k, v in recorded.items() if as_number(v) is not None}
    spans: dict[str, list[float]] = {}
    for row in rows:
        stamp = as_number(row.get("time"))
        if stamp is not None:
            spans.setdefault(str(row.get("stage", "?")), []).append(stamp)
    return {stage: max(s) - min(s) for stage, s in spans.items()}


def read_config_text(run_dir: Path) -> str:
    """The run's resolved recipe as written (``config.yaml``, or ``recipe.yaml`` for a run over seeds)."""
    for name in ("config.yaml", "recipe.yaml"):
        path = run_dir / name
        if path.exists():
            return path.read_text(errors="replace")
    return ""
