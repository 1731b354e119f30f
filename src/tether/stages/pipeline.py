"""Recipes: an ordered list of stages, each naming its inputs by the stage that made them.

A recipe is YAML::

    name: sft-arithmetic
    description: one line
    seed: 0                                  # shifts every stage's seeds (tether run --seeds N)
    defaults: {train: {threads: 1}}          # deep-merged into every stage
    stages:
      - {name: pretrain, type: pretrain, model: {name_or_path: tether/tiny}, ...}
      - {name: sft, type: sft, model: {name_or_path: "@pretrain"}, ...}

``@stage`` (in ``model.name_or_path`` or any ``path``) means the output folder of that
earlier stage. A finished stage (its ``stage.json`` exists) is skipped on re-run; an
interrupted one resumes from its last checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import ValidationError

from tether.config.base import ConfigError, deep_merge, describe_validation_error
from tether.config.common import EvalConfig, StageConfig, TaskSpec, nested_models
from tether.config.rewards import RewardSpec
from tether.core.determinism import check_deterministic_threads
from tether.data.files import write_json_atomic
from tether.report import write_report
from tether.rewards.combine import resolve_reward_function
from tether.stages.recipes import apply_recipe_overrides, builtin_recipes, load_recipe
from tether.stages.registry import STAGE_TYPES
from tether.stages.run_facts import recorded_invocation
from tether.stages.run_guard import (
    RunLock,
    check_stage_settings,
    link_upstream,
    record_stage_settings,
    stage_settings,
)
from tether.tasks import get_task
from tether.trainers import checkpoint as ckpt
from tether.trainers.distributed import DistInfo, init_distributed

log = logging.getLogger(__name__)

__all__ = ["apply_recipe_overrides", "builtin_recipes", "load_recipe", "run_recipe", "validate_recipe"]


def resolve_references(data: Any, run_dir: Path, done: set[str]) -> Any:
    """Replace ``@stage`` (and ``@stage/sub/path``) strings with paths inside the run directory."""
    if isinstance(data, dict):
        return {k: resolve_references(v, run_dir, done) for k, v in data.items()}
    if isinstance(data, list):
        return [resolve_references(v, run_dir, done) for v in data]
    if isinstance(data, str) and data.startswith("@"):
        stage, _, sub = data[1:].partition("/")
        if stage not in done:
            raise ConfigError(f"{data!r} refers to stage {stage!r}, which does not come earlier in the recipe")
        return str(run_dir / stage / sub) if sub else str(run_dir / stage)
    return data


def stage_config(raw: dict[str, Any]) -> StageConfig:
    stage_type = raw.get("type")
    if not stage_type:
        raise ConfigError(f"stage {raw.get('name', '?')!r} has no 'type'; valid: {', '.join(STAGE_TYPES)}")
    if not isinstance(stage_type, str):
        raise ConfigError(f"stage {raw.get('name', '?')!r}: 'type' must be a string, got {stage_type!r}; "
                          f"valid: {', '.join(STAGE_TYPES)}")
    try:
        spec = STAGE_TYPES.get(stage_type)
    except KeyError as err:
        raise ConfigError(str(err.args[0])) from None
    try:
        return spec.config_class.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"stage {raw.get('name', stage_type)!r}: {describe_validation_error(err)}") from None
    except (TypeError, AttributeError, KeyError) as err:  # a validator that met a value of the wrong type
        raise ConfigError(f"stage {raw.get('name', stage_type)!r}: a key has a value of the wrong type "
                          f"({type(err).__name__}: {err}); check that every block is a mapping") from None


def recipe_seed(recipe: dict[str, Any]) -> int:
    """The recipe's ``seed`` (default 0), from which every stage's seeds are shifted
    (:meth:`~tether.config.common.StageConfig.with_seed`)."""
    seed = recipe.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"recipe 'seed' must be a non-negative integer, got {seed!r:.80}")
    return seed


def check_names(cfg: StageConfig) -> None:
    """Every task (built-in, or a user's ``package.module:factory``, built with its options) and reward
    function (registered or importable) a stage names, resolved now: a typo fails before anything trains."""
    for block in (cfg, *nested_models(cfg)):
        try:
            if isinstance(block, TaskSpec):
                get_task(block.name, **block.options)
            elif isinstance(block, EvalConfig):
                get_task(block.task, **block.options)
            elif isinstance(block, RewardSpec) and isinstance(block.name, str):
                resolve_reward_function(block.name)
        except (KeyError, ValueError, TypeError) as err:
            message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
            raise ConfigError(f"stage {cfg.name!r}: {message}") from None


def validate_recipe(recipe: dict[str, Any], run_dir: Path = Path(".")) -> list[StageConfig]:
    """Every stage's config, with defaults merged and ``@stage`` references resolved inside
    ``run_dir``; validating all of them up front makes a typo in the last stage fail before
    hours of training."""
    defaults = recipe.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ConfigError(f"recipe 'defaults' must be a mapping, got {defaults!r:.80}")
    seed = recipe_seed(recipe)
    seen: list[str] = []
    configs = []
    for i, raw in enumerate(recipe["stages"]):
        if not isinstance(raw, dict):
            raise ConfigError(f"recipe stage {i + 1} must be a mapping with 'name' and 'type', got {raw!r:.80}")
        raw = deep_merge(defaults, raw)
        raw.setdefault("name", raw.get("type", f"stage{i}"))
        name = raw["name"]
        if not isinstance(name, str) or not name.strip() or name in (".", "..") or any(c in name for c in "/\\\0"):
            raise ConfigError(f"stage name {name!r} must be a plain folder name (no '/', '\\', '.' or '..'): "
                              "it names the stage's directory inside the run")
        if raw["name"] in seen:
            raise ConfigError(f"two stages are named {raw['name']!r}")
        resolved = resolve_references(raw, run_dir, set(seen))
        configs.append(stage_config(resolved).with_seed(seed))
        check_names(configs[-1])
        seen.append(raw["name"])
    return configs


def write_report_safely(run_dir: Path) -> Path | None:
    """``report.html`` for the run (rank 0 only). The report is a view of the run: a failure to draw
    it is logged as a warning and never fails the run or touches its results."""
    if not DistInfo.current().is_main:
        return None
    try:
        return write_report(run_dir)
    except Exception as err:
        log.warning("could not write the report for %s: %s: %s", run_dir, type(err).__name__, err)
        return None


def checked_settings(configs: list[StageConfig], run_dir: Path) -> dict[str, dict[str, Any]]:
    """Each stage's settings (``stage_settings``), after checking every stage already in ``run_dir`` was
    trained under them: a changed one is refused before any stage trains."""
    settings = {cfg.name: stage_settings(cfg, run_dir) for cfg in configs}
    link_upstream(settings)
    accepted: list[str] = []  # in recipe order, so a stage's inputs are checked before it
    for cfg in configs:
        check_stage_settings(run_dir / cfg.name, settings[cfg.name], type(cfg), accepted)
        accepted.append(cfg.name)
    return settings


def plan_recipe(recipe: dict[str, Any], run_dir: str | Path) -> list[dict[str, Any]]:
    """What ``run_recipe`` would do, changing nothing: every check it makes first (configs, names, the
    settings of stages already in ``run_dir``), then per stage its type, model, steps and whether it would
    be skipped (finished), resumed (from its newest checkpoint) or trained."""
    run_dir = Path(run_dir)
    configs = validate_recipe(recipe, run_dir)
    checked_settings(configs, run_dir)
    plan = []
    for cfg in configs:
        stage_dir = run_dir / cfg.name
        checkpoints = ckpt.list_checkpoints(stage_dir) if stage_dir.exists() else []
        if ckpt.read_done(stage_dir) is not None:
            action = "skip (finished)"
        elif checkpoints:
            action = f"resume from {checkpoints[-1].name}"
        else:
            action = "train"
        steps = cfg.train.max_steps if STAGE_TYPES.get(cfg.type).trains_model else None
        plan.append({"stage": cfg.name, "type": cfg.type, "model": cfg.model.name_or_path.replace(str(run_dir), "@run"),
                     "steps": steps, "action": action})
    return plan


def run_recipe(recipe: dict[str, Any], run_dir: str | Path, *, resume: bool = True,
               report: bool = True) -> dict[str, dict]:
    """Run every stage in order; returns (and writes ``results.json``) figures keyed by stage.
    With ``report`` (the default) it then writes ``report.html`` (see ``tether.report``)."""
    run_dir = Path(run_dir)
    configs = validate_recipe(recipe, run_dir)
    main = init_distributed().is_main  # under torchrun every rank runs the stages, rank 0 writes the run's files
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--out {run_dir} is a file, not a directory: choose another --out")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create the run directory {run_dir}: {err.strerror or err}; choose another "
                          "--out") from None
    with RunLock(run_dir) if main else nullcontext():
        settings = checked_settings(configs, run_dir)
        if main:
            (run_dir / "config.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
        with recorded_invocation(run_dir, enabled=main) as add_seconds:
            results = _run_stages(configs, settings, run_dir, resume, main, add_seconds)
    if report:
        write_report_safely(run_dir)
    return results


def _run_stages(configs: list[StageConfig], settings: dict[str, dict], run_dir: Path, resume: bool, main: bool,
                add_seconds: Callable[[str, float], None]) -> dict[str, dict]:
    results_path = run_dir / "results.json"
    results: dict[str, dict] = json.loads(results_path.read_text()) if results_path.exists() else {}
    for cfg in configs:
        name = cfg.name
        finished = ckpt.read_done(run_dir / name)
        if finished is not None:
            log.warning("stage %s already finished in %s; skipping it", name, run_dir)
            results[name] = finished.get("results", {})
        else:
            try:
                check_deterministic_threads(cfg.train.threads, cfg.model.device)
            except ValueError as err:
                raise ConfigError(f"stage {name!r}: {err}") from None
            torch.set_num_threads(cfg.train.threads)  # from the configuration, never from the caller's process
            if main:
                record_stage_settings(run_dir / name, settings[name])
            start = time.monotonic()
            try:
                results[name] = STAGE_TYPES.get(cfg.type).run(cfg, run_dir, resume)
            finally:
                add_seconds(name, time.monotonic() - start)
            if main:
                write_json_atomic(results_path, results)
    if main:
        write_json_atomic(results_path, results)
    return results
