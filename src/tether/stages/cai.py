"""Constitutional AI and RLAIF (loop 6): SL-CAI, AI preference labels, and RL against the preference model.

Bai et al. 2022, "Constitutional AI: Harmlessness from AI Feedback"; Lee et al. 2023, "RLAIF vs. RLHF:
Scaling Reinforcement Learning from Human Feedback with AI Feedback". Stage types:

- ``sl_cai`` (SL-CAI, Bai et al. Sec. 3): the model answers each prompt (red-team and helpfulness
  prompts alike); a judge critiques the answer against a sampled principle and revises it, ``rounds``
  times (:func:`tether.rewards.cai.critique_and_revise`); the corpus of (prompt, final revision) is
  written to ``STAGE/corpus.jsonl`` with the whole chain kept for inspection, then the model is
  fine-tuned on it (``train_sft``; ``train`` / ``optim`` are that SFT's). Bai et al. fine-tune the
  *pretrained* model on revisions of a helpful model's answers; here the stage fine-tunes ``model``,
  the model that answered, unless ``sft_from`` names another.
- ``ai_labels`` (RL-CAI's feedback model, Bai et al. Sec. 4; RLAIF, Lee et al.): two on-policy samples
  per prompt, a pairwise judge compares them against a sampled principle in both orders
  (:func:`tether.rewards.cai.preference_labels`); decided pairs go to ``STAGE/pairs.jsonl`` (and a
  held-out share to ``STAGE/eval.jsonl``) for the ``rm`` stage, which trains the preference model
  ("CAPM"); every judged pair, ties included, with both orders' verdicts is in ``STAGE/labels.jsonl``.
  The judge's biases are in the results (``bias/*``, :func:`tether.rewards.cai.judge_bias`).
- ``rlaif``: RL against the preference model, ``algorithm: ppo`` (the ``ppo`` trainer with the CAPM
  as reward model and critic initialisation, as RL-CAI does) or ``algorithm: dpo`` (online DPO whose
  pairs the CAPM ranks: best vs worst of K samples). The ``ppo`` / ``dpo`` blocks hold the chosen
  trainer's own settings.

Direct RLAIF needs no stage: the ``judge`` reward (:mod:`tether.rewards.cai`) goes in a ``grpo`` or
``ppo`` stage's reward list. SPIN is :class:`tether.trainers.online_preference.SPINTrainer`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from tether.config.base import ConfigError
from tether.config.cai import AILabelsConfig, RLAIFConfig, SLCAIConfig
from tether.config.data import DataConfig
from tether.config.rewards import JudgeConfig
from tether.config.sampling import SamplingConfig
from tether.config.sft import SFTConfig
from tether.data import load_records, tokenize_prompts
from tether.data.files import write_json_atomic, write_jsonl_atomic
from tether.data.sources import prompt_texts
from tether.models.loading import resolve_model
from tether.rewards.cai import critique_and_revise, judge_bias, preference_labels
from tether.rewards.constitution import load_constitution
from tether.rewards.judge import PairwiseJudge, as_backend
from tether.rollout import HFEngine
from tether.scoring import build_judge, reward_composer
from tether.stages.api import train_online_dpo, train_ppo, train_sft
from tether.trainers import checkpoint as ckpt
from tether.trainers.metrics import MetricsLogger

log = logging.getLogger(__name__)


# ---- shared pieces -----------------------------------------------------------------------------------
def _prompts(cfg: SLCAIConfig | AILabelsConfig, records: list[dict] | None) -> tuple[list[dict], list[str]]:
    return prompt_texts(cfg.data, records, cfg.name)


@torch.no_grad()
def sample_responses(model: Any, tokenizer: Any, prompts: list[str], sampling: SamplingConfig, *, n: int,
                     seed: int, chat: bool = False, engine: Any = None) -> list[list[str]]:
    """``n`` responses per prompt from the model, or from ``engine`` (any generation engine), prompt-major."""
    if engine is None:
        model.eval()
        engine = HFEngine(model, tokenizer, batch_size=sampling.engine_batch_size)
    rollout = engine.generate(tokenize_prompts(prompts, tokenizer, chat=chat), sampling.params(n, seed))
    out: list[list[str]] = [[] for _ in prompts]
    for text, i in zip(rollout.texts, rollout.prompt_index, strict=True):
        out[i].append(text)
    return out


def _judge(cfg: JudgeConfig, judge: Any, model: Any, tokenizer: Any, stage_dir: Path) -> tuple[Any, bool]:
    """The judge given, or one built from ``cfg`` (then True: the stage closes it when done)."""
    if judge is not None:
        return judge, False
    return build_judge(cfg, policy=model, tokenizer=tokenizer, cache_dir=stage_dir / "judge_cache",
                       log_dir=stage_dir), True


# ---- SL-CAI ------------------------------------------------------------------------------------------
def build_sl_cai_corpus(cfg: SLCAIConfig, model: Any, tokenizer: Any, out_dir: Path, *,
                        records: list[dict] | None = None, judge: Any = None, engine: Any = None) -> dict[str, float]:
    """Answer (with ``model``, or ``engine``), critique and revise every prompt; write ``corpus.jsonl``
    (with the chains) and ``train.jsonl`` (prompt, completion) under ``out_dir``; returns the chain figures."""
    records, prompts = _prompts(cfg, records)
    answers = [group[0] for group in sample_responses(model, tokenizer, prompts, cfg.sampling, n=1,
                                                      seed=cfg.train.seed, chat=cfg.data.chat, engine=engine)]
    judge_obj, built = _judge(cfg.judge, judge, model, tokenizer, out_dir)
    backend = judge_obj.backend if hasattr(judge_obj, "backend") else as_backend(judge_obj)
    try:
        chains, figures = critique_and_revise(backend, load_constitution(cfg.constitution), prompts, answers,
                                              rounds=cfg.rounds, seed=cfg.train.seed,
                                              critique_template=cfg.critique_template,
                                              revision_template=cfg.revision_template)
    finally:
        if built:
            judge_obj.close()
    corpus = [{**{k: v for k, v in rec.items() if k != "prompt"}, **chain}
              for rec, chain in zip(records, chains, strict=True)]
    kept = [c for c in corpus if c["revision"].strip() and (cfg.corpus.keep == "all" or c["revision"] != c["initial"])]
    if not kept:
        raise ConfigError(f"stage {cfg.name!r}: the SL-CAI corpus is empty ({figures})")
    figures["corpus/records"] = float(len(kept))
    write_jsonl_atomic(out_dir / "corpus.jsonl", corpus)
    write_json_atomic(out_dir / "corpus.json", figures)
    # written last: a corpus that exists is complete (a resumed stage goes straight to its SFT)
    write_jsonl_atomic(out_dir / "train.jsonl", [_sft_row(c["prompt"], c["revision"], cfg.data.chat) for c in kept])
    return figures


def _sft_row(prompt: str, completion: str, chat: bool) -> dict:
    if chat:
        return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]}
    return {"prompt": prompt, "completion": completion}


def train_sl_cai(config: SLCAIConfig | dict, *, out: str | Path, model: Any = None, tokenizer: Any = None,
                 prompts: Any = None, judge: Any = None, engine: Any = None, resume: bool = False) -> dict[str, float]:
    """SL-CAI: the corpus (kept in ``out/<stage>/corpus.jsonl``; reused when it exists) and SFT on it.

    ``prompts``: prompt records (a file, list of dicts or ``datasets.Dataset``) replacing ``config.data``;
    ``judge``: a judge object or a function ``fn(judge_prompts) -> replies`` replacing ``config.judge``;
    ``engine``: a generation engine that writes the initial answers instead of ``model``.
    Writes the fine-tuned model to ``out/<stage>``; returns the SFT's figures and the chain's.
    """
    cfg = config if isinstance(config, SLCAIConfig) else SLCAIConfig.model_validate(config)
    name = cfg.name or cfg.type
    stage_dir = Path(out) / name
    torch.set_num_threads(cfg.train.threads)
    if not (stage_dir / "train.jsonl").exists():
        records = None
        if prompts is not None:
            records = load_records(prompts)
        answerer, tok = resolve_model(model, tokenizer, cfg.model)
        build_sl_cai_corpus(cfg, answerer, tok, stage_dir, records=records, judge=judge, engine=engine)
        model, tokenizer = (answerer, tok) if cfg.sft_from is None else (None, None)
    figures = json.loads((stage_dir / "corpus.json").read_text())
    start = cfg.model if cfg.sft_from is None else cfg.model.model_copy(update={"name_or_path": cfg.sft_from})
    sft = SFTConfig(name=name, type="sft", model=start, optim=cfg.optim, train=cfg.train, eval=cfg.eval,
                    report_to=cfg.report_to,
                    data=DataConfig(path=str(stage_dir / "train.jsonl"), format="chat" if cfg.data.chat else
                                    "prompt_completion", **cfg.corpus.model_dump(exclude={"keep"})))
    results = {**train_sft(sft, out=out, model=model, tokenizer=tokenizer, resume=resume), **figures}
    ckpt.mark_done(stage_dir, {**(ckpt.read_done(stage_dir) or {}), "type": cfg.type, "results": results})
    return results


def run_sl_cai(cfg: SLCAIConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    return train_sl_cai(cfg, out=run_dir, resume=resume)


# ---- AI preference labels ----------------------------------------------------------------------------
def _held_out(prompt: str, fraction: float) -> bool:
    # salted: the tasks split train / eval by the unsalted hash, so every training prompt would land on one side
    digest = hashlib.sha256(f"ai-labels:{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def _audit(cfg: AILabelsConfig, rows: list[dict], prompts: list[str]) -> dict[str, float]:
    """Of the decided pairs the audit rewards tell apart, the share whose chosen the audit prefers."""
    composer = reward_composer(cfg.audit, defaults=cfg.reward_defaults())
    decided = [r for r in rows if r["p_a"] in (0.0, 1.0)]
    if not decided:
        return {}
    columns = {k: [r["columns"].get(k) for r in decided] * 2 for k in decided[0]["columns"]}
    scores = composer.score([prompts[r["index"]] for r in decided] * 2,
                            [r["response_a"] for r in decided] + [r["response_b"] for r in decided], columns).total
    a, b = scores[: len(decided)].tolist(), scores[len(decided):].tolist()
    told = [(r["p_a"] == 1.0) == (x > y) for r, x, y in zip(decided, a, b, strict=True) if x != y]
    return {"audit/pairs_decided": float(len(told)), **({"audit/label_agreement": sum(told) / len(told)} if told else {})}


def label_pairs(cfg: AILabelsConfig, model: Any, tokenizer: Any, out_dir: Path, *, records: list[dict] | None = None,
                judge: Any = None, engine: Any = None) -> dict[str, float]:
    """Sample two responses per prompt, label them, write ``labels.jsonl``, ``pairs.jsonl`` and ``eval.jsonl``."""
    records, prompts = _prompts(cfg, records)
    samples = sample_responses(model, tokenizer, prompts, cfg.sampling, n=2, seed=cfg.train.seed, chat=cfg.data.chat,
                               engine=engine)
    usable = [i for i, (a, b) in enumerate(samples) if a.strip() and b.strip() and a.strip() != b.strip()]
    judge, built = _judge(cfg.judge, judge, model, tokenizer, out_dir)
    if not isinstance(judge, PairwiseJudge):
        judge = PairwiseJudge(judge)  # a bare function of judge prompts, or a backend
    try:
        labels = preference_labels(judge, cfg.constitution, [prompts[i] for i in usable],
                                   [samples[i][0] for i in usable], [samples[i][1] for i in usable], seed=cfg.train.seed)
        figures = {**judge_bias(labels, [samples[i][0] for i in usable], [samples[i][1] for i in usable]),
                   **judge.take_metrics()}
    finally:
        if built:
            judge.close()
    rows = [{"index": i, "prompt": prompts[i], "response_a": samples[i][0], "response_b": samples[i][1], **label,
             "columns": {k: v for k, v in records[i].items() if k != "prompt"}} for i, label in zip(usable, labels,
                                                                                                strict=True)]
    pairs = [{"prompt": r["prompt"], "chosen": r["response_a"] if r["p_a"] == 1.0 else r["response_b"],
              "rejected": r["response_b"] if r["p_a"] == 1.0 else r["response_a"], "principle": r["principle"]}
             for r in rows if r["p_a"] in (0.0, 1.0)]
    held = [p for p in pairs if _held_out(p["prompt"], cfg.eval_fraction)]
    train = [p for p in pairs if not _held_out(p["prompt"], cfg.eval_fraction)]
    if not train:
        raise ConfigError(f"stage {cfg.name!r}: no decided pairs to train on ({figures})")
    write_jsonl_atomic(out_dir / "labels.jsonl", rows)
    write_jsonl_atomic(out_dir / "pairs.jsonl", train)
    write_jsonl_atomic(out_dir / "eval.jsonl", held or train[:1])  # an rm stage needs a non-empty eval file
    figures.update({"labels/prompts": float(len(prompts)), "labels/identical_samples": float(len(prompts) - len(usable)),
                    "labels/train_pairs": float(len(train)), "labels/eval_pairs": float(len(held))})
    if cfg.audit:
        figures.update(_audit(cfg, rows, prompts))
    return figures


def ai_labels(config: AILabelsConfig | dict, *, out: str | Path, model: Any = None, tokenizer: Any = None,
              prompts: Any = None, judge: Any = None, engine: Any = None) -> dict[str, float]:
    """RLAIF labels into ``out/<stage>/`` (see :func:`label_pairs`); returns the counts and the judge's biases.

    ``prompts`` replaces ``config.data``; ``judge`` (a :class:`PairwiseJudge` or a function ``fn(judge_prompts)
    -> replies``) replaces ``config.judge``; ``engine`` (any generation engine, e.g. an endpoint's) samples
    the responses instead of ``model``, whose tokenizer it uses."""
    cfg = config if isinstance(config, AILabelsConfig) else AILabelsConfig.model_validate(config)
    torch.set_num_threads(cfg.train.threads)
    name = cfg.name or cfg.type
    stage_dir = Path(out) / name
    records = load_records(prompts) if prompts is not None else None
    model, tokenizer = resolve_model(model, tokenizer, cfg.model)
    figures = label_pairs(cfg, model, tokenizer, stage_dir, records=records, judge=judge, engine=engine)
    logger = MetricsLogger(Path(out), name, report_to=[])
    logger.log(0, figures)
    logger.close()
    ckpt.mark_done(stage_dir, {"stage": name, "type": cfg.type, "results": figures})
    return figures


def run_ai_labels(cfg: AILabelsConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    return ai_labels(cfg, out=run_dir)


# ---- RL against the preference model ------------------------------------------------------------------
def train_rlaif(config: RLAIFConfig | dict, *, out: str | Path, model: Any = None, tokenizer: Any = None,
                resume: bool = False) -> dict[str, float]:
    """PPO or online DPO against the preference model (``config.algorithm``); returns that trainer's figures."""
    cfg = config if isinstance(config, RLAIFConfig) else RLAIFConfig.model_validate(config)
    inner = cfg.inner()
    if cfg.algorithm == "ppo":
        return train_ppo(inner, out=out, model=model, tokenizer=tokenizer, resume=resume)
    return train_online_dpo(inner, out=out, model=model, tokenizer=tokenizer, resume=resume)


def run_rlaif(cfg: RLAIFConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    return train_rlaif(cfg, out=run_dir, resume=resume)


# ---- another constitution for a whole recipe ----------------------------------------------------------
CONSTITUTION_STAGES = ("sl_cai", "ai_labels")


def with_constitution(recipe: dict[str, Any], constitution: str) -> dict[str, Any]:
    """``recipe`` with ``constitution`` (a built-in name or a file, checked here) in every stage that samples
    principles: the ``sl_cai`` and ``ai_labels`` stages, and ``judge`` rewards of RL stages
    (``tether run cai --constitution FILE``)."""
    import copy

    load_constitution(constitution)  # a bad file fails now, naming its line and field
    recipe = copy.deepcopy(recipe)
    for stage in recipe["stages"]:
        if stage.get("type") in CONSTITUTION_STAGES:
            stage["constitution"] = constitution
        for reward in stage.get("rewards") or []:
            if isinstance(reward, dict) and reward.get("name") == "judge":
                reward.setdefault("kwargs", {})["constitution"] = constitution
    return recipe
