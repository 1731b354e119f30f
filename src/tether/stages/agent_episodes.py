"""Agent stages with no training: sample episodes into preference pairs, and evaluate a model's episodes.

- ``agent_episodes``: K sampled episodes of each of n training tasks from a model (the multi-turn loop
  of :mod:`tether.rollout.agent`, tools run for real), written as episode records
  (:func:`tether.rollout.agent.episode_record`) to ``STAGE/episodes.jsonl``, and each task's successes
  paired with its failures (:func:`tether.data.episode_pairs.episode_pairs`) in ``STAGE/pairs.jsonl``:
  the data of DMPO (Shi et al. 2024), which a ``dpo`` stage with ``loss: dmpo`` (or any other loss, on
  the whole trajectory) trains on. The stage is redone whole after a crash (its files are written
  atomically at the end).
- ``agent_eval``: :func:`tether.evaluation.evaluate_agent` on held-out tasks, for a model another stage
  type trained (a ``dpo`` stage evaluates single-turn tasks only).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from rich import get_console

from tether.config.agent import AgentEpisodesConfig, AgentEvalStageConfig
from tether.config.base import ConfigError
from tether.data.episode_pairs import episode_pairs
from tether.data.files import write_jsonl_atomic
from tether.evaluation import evaluate_agent
from tether.models.loading import resolve_model
from tether.rollout import HFEngine, SamplingParams
from tether.rollout.agent import AgentLoop, environment_renderer, episode_record, trajectory_metrics
from tether.rollout.base import GenerationEngine
from tether.rollout.environment import environment_records
from tether.runtime.progress import ProgressLines
from tether.trainers import checkpoint as ckpt

log = logging.getLogger(__name__)


def sample_episodes(config: AgentEpisodesConfig | dict, *, out: str | Path, model: Any = None,
                    tokenizer: Any = None, engine: GenerationEngine | None = None) -> dict[str, float]:
    """Sample ``episodes.samples`` episodes of each of ``episodes.n`` training tasks into ``out/episodes.jsonl``
    and pair them into ``out/pairs.jsonl``; returns the sampled episodes' figures (``sampled/success``, tool
    calls, ...) and the pairing counts. ``engine`` (with ``tokenizer``) replaces the local model's ``generate``
    (an engine of :mod:`tether.rollout`, e.g. vLLM)."""
    cfg = config if isinstance(config, AgentEpisodesConfig) else AgentEpisodesConfig.model_validate(config)
    torch.set_num_threads(cfg.train.threads)
    if engine is None:
        model, tokenizer = resolve_model(model, tokenizer, cfg.model)
        engine = HFEngine(model.eval(), tokenizer, batch_size=cfg.episodes.batch_size)
    elif tokenizer is None:
        raise ValueError("pass the tokenizer together with an engine")
    make_env, renderer = environment_renderer(cfg.environment, tokenizer)
    sampling = cfg.episodes
    tasks = environment_records(cfg.environment, split="train", n=sampling.n)
    loop = AgentLoop(engine, tokenizer, make_env, renderer, cfg.agent)
    lines = ProgressLines(f"{cfg.name or 'agent_episodes'} sampling", len(tasks) * sampling.samples, "episodes",
                          enabled=cfg.train.progress, console=get_console())
    trajectories = loop.run(tasks, SamplingParams(n=sampling.samples, temperature=sampling.temperature,
                                                  seed=sampling.seed), on_progress=lines.update)
    records = [episode_record(t, renderer) for t in trajectories]
    pairs, stats = episode_pairs(records, success_threshold=cfg.agent.success_threshold, seed=sampling.seed)
    if not pairs:
        raise ConfigError(f"no pairs: of {len(tasks)} tasks, {stats['no_success']} had no successful episode and "
                         f"{stats['no_failure']} no failed one in {sampling.samples} samples; sample more episodes "
                         "(episodes.samples, episodes.n) or start from a model that succeeds sometimes")
    out = Path(out)
    write_jsonl_atomic(out / "episodes.jsonl", records)
    write_jsonl_atomic(out / "pairs.jsonl", pairs)
    log.info("%d episodes of %d tasks -> %d pairs in %s", len(records), len(tasks), len(pairs), out / "pairs.jsonl")
    figures = {f"sampled/{k}": v for k, v in trajectory_metrics(trajectories, cfg.agent.success_threshold).items()}
    return {**figures, **{f"pairs/{k}": float(v) for k, v in stats.items()}}


def run_agent_episodes(cfg: AgentEpisodesConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    stage_dir = run_dir / cfg.name
    results = sample_episodes(cfg, out=stage_dir)
    ckpt.mark_done(stage_dir, {"stage": cfg.name, "type": cfg.type, "results": results})
    return results


def run_agent_eval(cfg: AgentEvalStageConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    """Evaluate ``cfg.model``'s episodes on ``cfg.eval``; the figures are the stage's results."""
    torch.set_num_threads(cfg.train.threads)
    model, tokenizer = resolve_model(None, None, cfg.model)
    results = evaluate_agent(model.eval(), tokenizer, cfg.environment, cfg.agent, cfg.eval,
                             progress=cfg.train.progress, label=f"{cfg.name or 'agent_eval'} eval")
    stage_dir = run_dir / cfg.name
    stage_dir.mkdir(parents=True, exist_ok=True)
    ckpt.mark_done(stage_dir, {"stage": cfg.name, "type": cfg.type, "results": results})
    return results
