"""A recipe over several seeds: one normal run directory per seed, every figure summarised across them.

``run_seeds(recipe, DIR, [0, 1, 2])`` runs the recipe with its top-level ``seed`` set to each value, each
in its own process, into ``DIR/seed-K/`` (``--parallel`` of them at once), then writes ``DIR/results.json``:
for every stage and every numeric figure ``{"mean", "std", "n", "ci95": [low, high], "values": [...]}``
(:func:`tether.core.statistics.seed_summary`; ``values`` in the order of ``DIR/seeds.json``). A seed
whose run was interrupted resumes where it stopped when the same command is run again; a finished one
is skipped.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from tether.config.base import ConfigError
from tether.core.statistics import seed_summary
from tether.data.files import write_json_atomic

log = logging.getLogger(__name__)

RECIPE_FILE = "recipe.yaml"  # the recipe every seed runs (overrides applied), beside the seed folders
RUN_LOG = "run.log"  # each seed's output, inside its seed folder


INTERRUPTED = (130, 143, -signal.SIGINT, -signal.SIGTERM)  # a seed stopped by SIGINT / SIGTERM


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def parse_seeds(spec: str | int | Sequence[int]) -> list[int]:
    """``"5"`` (or 5): seeds 0..4; ``"0,3,7"``: those seeds; a list of ints as given."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = str(spec)
    if isinstance(spec, str):
        parts = [p.strip() for p in spec.split(",") if p.strip()]
        if not parts or not all(p.isdigit() for p in parts):
            raise ConfigError(f"--seeds takes a count (5) or a comma-separated list of seeds (0,3,7), got {spec!r}")
        count = len(parts) == 1 and "," not in spec
        if count and int(parts[0]) == 0:
            raise ConfigError("--seeds 0 is a count of no seeds; for seed 0 alone give the one-item list '0,'")
        seeds = list(range(int(parts[0]))) if count else [int(p) for p in parts]
    else:
        seeds = list(spec)
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
        raise ConfigError(f"need at least one non-negative integer seed, got {spec!r}")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds must be distinct, got {seeds}")
    return seeds


def seed_dir(run_dir: str | Path, seed: int) -> Path:
    return Path(run_dir) / f"seed-{seed}"


def aggregate_results(per_seed: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per stage and numeric figure, :func:`seed_summary` of its values over the runs that report it."""
    stages: dict[str, dict[str, list[float]]] = {}
    for results in per_seed:
        for stage, figures in results.items():
            for name, value in figures.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    stages.setdefault(stage, {}).setdefault(name, []).append(float(value))
    return {stage: {name: seed_summary(values) for name, values in figures.items()}
            for stage, figures in stages.items()}


def _command(recipe_path: Path, seed: int, out: Path, *, resume: bool, deterministic: bool) -> list[str]:
    command = [sys.executable, "-m", "tether", "run", str(recipe_path), f"seed={seed}", "--out", str(out)]
    if not resume:
        command.append("--no-resume")
    if deterministic:
        command.append("--deterministic")
    return command


def _plot_over_seeds(recipe: dict[str, Any], aggregated: dict[str, dict[str, dict]], run_dir: Path) -> None:
    """Figures a stage draws from its own results, redrawn over the seeds by its type's ``plot_over_seeds``
    (the stage table), e.g. the over-optimisation figure with std error bars."""
    from tether.stages.registry import STAGES

    for stage in recipe.get("stages") or []:
        kind = STAGES.get(stage.get("type")) if isinstance(stage, dict) else None
        figures = aggregated.get(stage.get("name") or stage.get("type")) if kind else None
        if kind is not None and kind.plot_over_seeds is not None and figures:
            kind.plot_over_seeds(figures, run_dir)


def run_seeds(recipe: dict[str, Any], run_dir: str | Path, seeds: Sequence[int], *, parallel: int = 1,
              resume: bool = True, deterministic: bool = False,
              on_event: Callable[[str, int, dict[str, Any]], None] | None = None) -> dict[str, dict[str, dict]]:
    """Run ``recipe`` once per seed (``parallel`` processes at a time) and aggregate the figures; returns
    (and writes) ``DIR/results.json``. ``on_event(kind, seed, info)`` reports progress: ``start``
    (``command``), ``done`` (``results``, ``seconds``) and ``failed`` (``returncode``, ``log``).
    Raises ``RuntimeError`` naming the failed seeds and their logs after the others have finished.
    SIGINT / SIGTERM (to this process, or one seed stopped by either) stop every running seed at a
    checkpoint and raise ``KeyboardInterrupt``; calling again with the same arguments resumes them."""
    if parallel < 1:
        raise ConfigError(f"--parallel must be at least 1, got {parallel}")
    run_dir, seeds = Path(run_dir), list(seeds)
    run_dir.mkdir(parents=True, exist_ok=True)
    recipe_path = run_dir / RECIPE_FILE
    recipe_path.write_text(yaml.safe_dump({k: v for k, v in recipe.items() if k != "seed"}, sort_keys=False))
    write_json_atomic(run_dir / "seeds.json", {"seeds": seeds})
    notify = on_event or (lambda kind, seed, info: None)
    pending, running, failed = list(seeds), {}, {}
    main_thread = threading.current_thread() is threading.main_thread()
    # SIGTERM stops the seeds as Ctrl-C does (signal handlers can only be set from the main thread)
    previous_sigterm = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        while pending or running:
            while pending and len(running) < parallel:
                seed = pending.pop(0)
                out = seed_dir(run_dir, seed)
                out.mkdir(parents=True, exist_ok=True)
                command = _command(recipe_path, seed, out, resume=resume, deterministic=deterministic)
                with open(out / RUN_LOG, "a") as log_file:
                    process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                               env={**os.environ, "COLUMNS": "120"})
                running[seed] = (process, time.monotonic())
                notify("start", seed, {"command": command})
            time.sleep(0.2)
            for seed, (process, started) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[seed]
                if process.returncode in INTERRUPTED:  # stopped by a signal at a checkpoint: stop them all
                    raise KeyboardInterrupt(f"seed {seed} was interrupted")
                if process.returncode == 0:
                    results = json.loads((seed_dir(run_dir, seed) / "results.json").read_text())
                    notify("done", seed, {"results": results, "seconds": time.monotonic() - started})
                else:
                    failed[seed] = process.returncode
                    notify("failed", seed, {"returncode": process.returncode,
                                            "log": seed_dir(run_dir, seed) / RUN_LOG})
    except KeyboardInterrupt:
        for process, _ in running.values():  # each seed checkpoints and stops; re-running resumes it
            process.send_signal(signal.SIGINT)
        for process, _ in running.values():
            process.wait()
        raise
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous_sigterm)
    per_seed = [json.loads((seed_dir(run_dir, s) / "results.json").read_text()) for s in seeds if s not in failed]
    aggregated = aggregate_results(per_seed)
    write_json_atomic(run_dir / "results.json", aggregated)
    _plot_over_seeds(recipe, aggregated, run_dir)
    if failed:
        raise RuntimeError("seeds " + ", ".join(f"{s} (exit {rc}, log {seed_dir(run_dir, s) / RUN_LOG})"
                                                 for s, rc in failed.items()) + " failed; the others are in "
                           f"{run_dir / 'results.json'}; run the same command again to retry")
    return aggregated
