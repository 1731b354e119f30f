"""Distillation and rejection-sampling fine-tuning: generate -> filter -> SFT, once or in rounds.

Stage types (each a thin wrapper over a public function):

- ``generate``: a model (local, or an OpenAI-compatible endpoint) writes K samples per prompt to
  ``STAGE/corpus.jsonl``, resumably (:func:`tether.generation.generate_corpus`).
- ``filter``: a corpus -> ``STAGE/corpus.jsonl`` of the samples worth learning from, by verifier,
  reward model, length, format and deduplication, with a count per reason for the rest
  (:func:`tether.filtering.filter_corpus`); optionally ``STAGE/pairs.jsonl``, chosen / rejected
  pairs for a reward model trained on the policy's own samples.
- the existing ``sft`` stage trains the student on ``@filter/corpus.jsonl`` with the prompt
  masked and the whole completion (``<think>`` block and answer, and EOS) in the loss. That is
  R1-distill (DeepSeek-AI 2025, "DeepSeek-R1", sec. 2.4: a strong model's verified reasoning
  traces, ~800k of them, SFT into smaller dense models, no RL on the student).
- ``self_distill``: the model is its own teacher for ``iterations`` rounds of generate ->
  filter -> SFT, with held-out figures after each round. ``algorithm`` picks the defaults:

  ========  =========================================================================  =====================
  preset    paper and what the preset sets                                              each round trains
  ========  =========================================================================  =====================
  ``star``  STaR, Zelikman et al. 2022: keep samples whose answer checks out;           from the base model,
            steps grow 20% a round. No rationalisation (re-asking failed problems       steps x 1.2 per round
            with the answer as a hint) here.
  ``rest``  ReST, Gulcehre et al. 2023: Grow (sample from the current policy), then     from the last round's
            Improve (fine-tune on samples with reward >= threshold). One Improve        model
            step per Grow step; with a 0/1 verifier the threshold schedule collapses
            to "correct". (ReST-EM, Singh et al. 2023, is the ``star`` restart.)
  ``raft``  RAFT, Dong et al. 2023: the best sample of each prompt by reward           from the last round's
            (``filter.max_per_prompt: 1``), then SFT.                                    model
  ========  =========================================================================  =====================

- ``step_labels``: a corpus's traces labelled step by step against the task's reference traces
  (:mod:`tether.data.step_labels`), ``STAGE/stepwise.jsonl``: a process reward model trained on the
  policy's own samples (Math-Shepherd's data) instead of synthetic mistakes.
- ``best_of_n``: held-out accuracy of best-of-n against n for each scorer, and of each step-level
  ``search`` (PRM-guided beam search) at the same n, with tokens per problem, in the results, in
  ``STAGE/best_of_n.md`` and ``STAGE/best_of_n.png``.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from tether.best_of_n import run_best_of_n
from tether.config.base import ConfigError
from tether.config.data import DataConfig
from tether.config.distill import (
    BestOfNConfig,
    EngineConfig,
    FilterStageConfig,
    GenerateConfig,
    SelfDistillConfig,
    StepLabelsConfig,
)
from tether.config.rewards import ScorerConfig
from tether.config.sft import SFTConfig
from tether.data.files import write_json_atomic, write_jsonl_atomic
from tether.data.sources import prompt_records
from tether.data.step_labels import step_label_records
from tether.filtering import filter_corpus, preference_pairs, sft_records
from tether.generation import generate_corpus, make_engine, read_corpus, write_records
from tether.models.loading import resolve_model
from tether.scoring import build_scorer
from tether.stages.api import train_sft
from tether.tasks import get_task
from tether.tasks.base import draw_problems, format_completion
from tether.trainers import checkpoint as ckpt
from tether.trainers.loop import BEFORE_OUTCOMES
from tether.trainers.metrics import MetricsLogger

log = logging.getLogger(__name__)


# ---- generate ----------------------------------------------------------------------------------------
def _engine(cfg: GenerateConfig | SelfDistillConfig, model: Any, tokenizer: Any) -> tuple[Any, Any]:
    engine = getattr(cfg, "engine", EngineConfig())
    if engine.kind == "local":
        model, tokenizer = resolve_model(model, tokenizer, cfg.model)
        return make_engine("local", model, tokenizer=tokenizer, batch_size=cfg.sampling.engine_batch_size)
    return make_engine("openai", engine.served_model or cfg.model.name_or_path,
                       tokenizer=tokenizer or cfg.model.name_or_path, base_url=engine.base_url,
                       api_key_env=engine.api_key_env, timeout=engine.timeout, max_retries=engine.max_retries,
                       concurrency=engine.concurrency, cache_dir=engine.cache_dir)


def generate(config: GenerateConfig | dict, *, out: str | Path, model: Any = None, tokenizer: Any = None,
             prompts: Any = None, resume: bool = True, sampling_seed_offset: int = 0,
             verifier: ScorerConfig | None = None) -> dict[str, float]:
    """Sample ``config.sampling.n`` completions per prompt into ``out`` (``.jsonl`` / ``.parquet``).

    ``model``: a path or a loaded model (with ``tokenizer``) replacing ``config.model``; ``prompts``:
    records or strings replacing ``config.prompts``. Returns the corpus counts, and with a
    ``verifier`` (default ``config.verifier``) the share of samples it scores >= 1 (``sample_accuracy``).
    """
    cfg = config if isinstance(config, GenerateConfig | SelfDistillConfig) else GenerateConfig.model_validate(config)
    torch.set_num_threads(cfg.train.threads)
    engine, tokenizer = _engine(cfg, model, tokenizer)
    records = prompt_records(cfg.prompts) if prompts is None else prompts
    meta = {"model": str(model if isinstance(model, str | Path) else cfg.model.name_or_path)}
    stats = generate_corpus(engine, tokenizer, records, out, cfg.sampling.corpus_params(sampling_seed_offset),
                            chat=cfg.prompts.chat, prompt_template=cfg.prompts.prompt_template,
                            batch_size=cfg.sampling.engine_batch_size, resume=resume, meta=meta,
                            progress=cfg.train.progress)
    verifier = verifier or getattr(cfg, "verifier", None)
    if verifier is not None:
        scores = build_scorer(verifier, defaults=cfg.reward_defaults())(read_corpus(out))
        stats["sample_accuracy"] = sum(s is not None and s >= 1.0 for s in scores) / max(len(scores), 1)
    return stats


def run_generate(cfg: GenerateConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    stage_dir = run_dir / cfg.name
    results = generate(cfg, out=stage_dir / f"corpus.{cfg.output}", resume=resume)
    ckpt.mark_done(stage_dir, {"stage": cfg.name, "type": cfg.type, "results": results})
    return results


# ---- step labels -------------------------------------------------------------------------------------
def label_steps(cfg: StepLabelsConfig | dict, out_dir: str | Path) -> dict[str, float]:
    """``cfg.corpus`` -> ``out_dir/stepwise.jsonl`` labelled against the reference problems; returns the counts."""
    cfg = cfg if isinstance(cfg, StepLabelsConfig) else StepLabelsConfig.model_validate(cfg)
    source = cfg.references
    task = get_task(source.name, **source.options)
    references = {p.prompt: format_completion(p, think=True)
                  for p in draw_problems(task, source.n, seed=source.seed, split="train")}
    records, stats = step_label_records(read_corpus(cfg.corpus), references, separator=cfg.separator,
                                        dedupe=cfg.dedupe, cut_fraction=cfg.cut_fraction, seed=cfg.seed)
    if not records:
        raise ConfigError(f"no stepwise records from {cfg.corpus}: {stats}")
    write_jsonl_atomic(Path(out_dir) / "stepwise.jsonl", records)
    log.info("labelled %d traces: %d correct, %d wrong, %d stopped early -> %s", stats["records"], stats["correct"],
             stats["wrong"], stats["stopped"], Path(out_dir) / "stepwise.jsonl")
    good = sum(sum(r["labels"]) for r in records) / max(sum(len(r["labels"]) for r in records), 1)
    return {**{k: float(v) for k, v in stats.items()}, "step_good_fraction": good}


def run_step_labels(cfg: StepLabelsConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    stage_dir = run_dir / cfg.name
    results = label_steps(cfg, stage_dir)
    ckpt.mark_done(stage_dir, {"stage": cfg.name, "type": cfg.type, "results": results})
    return results


# ---- filter ------------------------------------------------------------------------------------------
def filter_file(cfg: FilterStageConfig | dict, out_dir: str | Path) -> dict[str, float]:
    """Filter the corpus ``cfg.input`` into ``out_dir/corpus.jsonl`` (and ``pairs.jsonl``); returns the summary."""
    cfg = cfg if isinstance(cfg, FilterStageConfig) else FilterStageConfig.model_validate(cfg)
    out_dir = Path(out_dir)
    records = read_corpus(cfg.input)
    kept, summary = filter_corpus(records, cfg.filter, defaults=cfg.reward_defaults())
    write_records(out_dir / "corpus.jsonl", sft_records(kept, chat=cfg.chat))
    if cfg.pairs is not None:
        usable = [r for r in records if isinstance(r.get("completion"), str) and r["completion"].strip()]
        score = build_scorer(cfg.pairs.scorer, defaults=cfg.reward_defaults())
        pairs = preference_pairs(usable, score(usable), rule=cfg.pairs.rule,
                                 max_per_prompt=cfg.pairs.max_per_prompt, margin=cfg.pairs.margin,
                                 threshold=cfg.pairs.threshold, rso=cfg.pairs.rso)
        write_records(out_dir / "pairs.jsonl", pairs)
        summary["pairs"] = len(pairs)
    write_json_atomic(out_dir / "summary.json", summary)
    return summary


def run_filter(cfg: FilterStageConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    stage_dir = run_dir / cfg.name
    results = filter_file(cfg, stage_dir)
    log.info("filter %s: kept %d of %d", cfg.name, results["kept"], results["records"])
    ckpt.mark_done(stage_dir, {"stage": cfg.name, "type": cfg.type, "results": results})
    return results


# ---- self-distillation -------------------------------------------------------------------------------
def _round_sft_config(cfg: SelfDistillConfig, round_: int, start_model: str, corpus: Path) -> SFTConfig:
    steps = max(1, round(cfg.train.max_steps * cfg.step_growth ** (round_ - 1)))
    eval_ = cfg.eval if cfg.eval is None or round_ == 1 else cfg.eval.model_copy(update={"before": False})
    return SFTConfig(name=f"{cfg.name}/iter-{round_}", type="sft",
                     model=cfg.model.model_copy(update={"name_or_path": start_model}),
                     optim=cfg.optim, train=cfg.train.model_copy(update={"max_steps": steps}), eval=eval_,
                     report_to=cfg.report_to, data=DataConfig(path=str(corpus), **cfg.data.model_dump()))


def _distill_round(cfg: SelfDistillConfig, run_dir: Path, round_: int, teacher: str, resume: bool
                   ) -> dict[str, float]:
    """One round: the model at ``teacher`` samples, the filter keeps, SFT trains ``STAGE/iter-N``."""
    round_dir = run_dir / cfg.name / f"iter-{round_}"
    done = ckpt.read_done(round_dir)
    if done is not None:
        return done["results"]
    stats = generate(cfg, out=round_dir / "samples.jsonl", model=teacher, resume=resume,
                     sampling_seed_offset=1000 * round_, verifier=cfg.filter.verifier)
    kept, summary = filter_corpus(read_corpus(round_dir / "samples.jsonl"), cfg.filter, defaults=cfg.reward_defaults())
    if not kept:
        raise ConfigError(f"{cfg.name} round {round_}: the filter kept none of {summary['records']} samples "
                         f"({summary}); sample more (sampling.n) or loosen the filter")
    write_records(round_dir / "filtered.jsonl", sft_records(kept, chat=cfg.prompts.chat))
    start = cfg.model.name_or_path if cfg.restart == "base" else teacher
    first_before = run_dir / cfg.name / "iter-1" / BEFORE_OUTCOMES  # the stage's starting model, round 1 evaluated it
    if round_ > 1 and first_before.exists():  # so this round's gain/* is paired against the start too
        shutil.copy2(first_before, round_dir / BEFORE_OUTCOMES)
    figures = train_sft(_round_sft_config(cfg, round_, start, round_dir / "filtered.jsonl"), out=run_dir,
                        resume=resume)
    names = {"records": "sample/records", "mean_tokens": "sample/mean_tokens", "sample_accuracy": "sample/accuracy"}
    results = {**{names[k]: v for k, v in stats.items() if k in names},
               **{f"filter/{k}": v for k, v in summary.items()}, **figures}
    ckpt.mark_done(round_dir, {**(ckpt.read_done(round_dir) or {}), "results": results})  # the SFT's + filter's
    return results


def self_distill(config: SelfDistillConfig | dict, *, out: str | Path, resume: bool = True) -> dict[str, float]:
    """STaR / ReST / RAFT rounds (see the module docstring). Each round's model is ``out/STAGE/iter-N``;
    the last one is also exported to ``out/STAGE``. Returns ``iterN/<figure>`` for every round, the
    kept fraction ``iterN/filter/kept_fraction``, and the last round's figures unprefixed. With
    ``eval.before`` the starting model is evaluated once (``before/*``) and every round's ``gain/<rate>``
    is paired against it on the same problems, so the unprefixed ``gain/accuracy`` is the whole stage's."""
    cfg = config if isinstance(config, SelfDistillConfig) else SelfDistillConfig.model_validate(config)
    run_dir, stage_dir = Path(out), Path(out) / cfg.name
    logger = MetricsLogger(run_dir, cfg.name, report_to=[])
    teacher, results = cfg.model.name_or_path, {}
    if cfg.model.config_overrides:
        raise ConfigError("self_distill starts from a trained model; config_overrides do not apply")
    for round_ in range(1, cfg.iterations + 1):
        figures = _distill_round(cfg, run_dir, round_, teacher, resume)
        logger.log(round_, {k: v for k, v in figures.items() if isinstance(v, int | float)})
        results.update({f"iter{round_}/{k}": v for k, v in figures.items()})
        teacher = str(stage_dir / f"iter-{round_}")
        log.info("%s round %d: %s", cfg.name, round_, {k: v for k, v in figures.items() if "accuracy" in k})
    logger.close()
    for file in Path(teacher).iterdir():
        if file.is_file() and file.name != ckpt.DONE_FILE:
            shutil.copy2(file, stage_dir / file.name)
    results.update({k: v for k, v in figures.items() if "/" not in k or k.startswith("gain/")})
    results.update({k.removeprefix("iter1/"): v for k, v in results.items() if k.startswith("iter1/before/")})
    return results


def run_self_distill(cfg: SelfDistillConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    results = self_distill(cfg, out=run_dir, resume=resume)
    ckpt.mark_done(run_dir / cfg.name, {"stage": cfg.name, "type": cfg.type, "results": results})
    return results


# ---- best-of-n ---------------------------------------------------------------------------------------
def run_best_of_n_stage(cfg: BestOfNConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    torch.set_num_threads(cfg.train.threads)
    stage_dir = run_dir / cfg.name
    model, tokenizer = resolve_model(None, None, cfg.model)
    results = run_best_of_n(model, cfg.eval, cfg.ns, dict(cfg.scorers), tokenizer=tokenizer,
                            corpus=stage_dir / "samples.jsonl", plot=stage_dir / "best_of_n.png",
                            progress=cfg.train.progress, defaults=cfg.reward_defaults(), searches=dict(cfg.search),
                            table=stage_dir / "best_of_n.md")
    ckpt.mark_done(stage_dir, {"stage": cfg.name, "type": cfg.type, "results": results})
    return results
