"""Scoring and filtering generated corpora: rejection sampling's "keep the good ones".

A corpus record is one sample (see :mod:`tether.generation`). :func:`filter_corpus` applies the
checks of a :class:`FilterConfig` in a fixed order, cheapest first, and drops a record at the
first check it fails, counting it under that reason::

    empty -> truncated -> too_short / too_long -> format -> duplicate -> verifier
          -> reward_threshold -> reward_top_k -> max_per_prompt

so the summary's ``dropped/<reason>`` counts add up to ``records - kept``. Scores are computed only
for the records still in the running, and written into the kept records (``score/verifier``,
``score/reward_model``) for inspection.

Scores come from scorers (:func:`tether.scoring.build_scorer` of a :class:`~tether.config.ScorerConfig`):
reward functions (by default the task's own checker), a trained reward model, or a pointwise LLM judge.
The same scorers pick the best of n samples in :mod:`tether.best_of_n`.
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from tether.config.rewards import FilterConfig, RewardFilter, RSOConfig, VerifierFilter
from tether.core.pairing import make_pairs, rso_scores
from tether.scoring import RecordScorer, build_scorer


def _length_reason(record: dict, cfg: FilterConfig) -> str | None:
    tokens = record.get("tokens")
    if tokens is None:
        return None
    if cfg.min_tokens is not None and tokens < cfg.min_tokens:
        return "too_short"
    if cfg.max_tokens is not None and tokens > cfg.max_tokens:
        return "too_long"
    return None


def _cheap_reason(record: dict, cfg: FilterConfig, seen: set[tuple[str, str]]) -> str | None:
    """The first structural check ``record`` fails (None: it passes all), in the documented order."""
    from tether.rewards.verifiers import format_reward

    completion = record.get("completion")
    if not isinstance(completion, str) or not completion.strip():
        return "empty"
    if cfg.drop_truncated and record.get("finish_reason") == "length":
        return "truncated"
    reason = _length_reason(record, cfg)
    if reason:
        return reason
    if cfg.format == "r1" and format_reward([record["prompt"]], [completion])[0] != 1.0:
        return "format"
    if cfg.format_pattern is not None and re.fullmatch(cfg.format_pattern, completion, re.DOTALL) is None:
        return "format"
    if cfg.dedup:
        key = (str(record["prompt"]), " ".join(completion.split()))
        if key in seen:
            return "duplicate"
        seen.add(key)
    return None


def prompt_key(record: dict) -> Any:
    """What groups the samples of one prompt: ``prompt_id``, else the prompt itself."""
    return record["prompt_id"] if "prompt_id" in record else str(record["prompt"])


def top_k_per_prompt(records: Sequence[dict], scores: Sequence[float], k: int) -> list[bool]:
    """Which records are among the ``k`` highest-scored of their prompt (ties: the earlier record wins)."""
    groups: dict[Any, list[int]] = defaultdict(list)
    for i, record in enumerate(records):
        groups[prompt_key(record)].append(i)
    keep = [False] * len(records)
    for members in groups.values():
        for i in sorted(members, key=lambda j: -scores[j])[:k]:  # sorted() is stable: earlier wins ties
            keep[i] = True
    return keep


def filter_corpus(records: Sequence[dict], cfg: FilterConfig | dict | None = None,
                  scorers: dict[str, RecordScorer] | None = None, *, defaults: dict[str, Any] | None = None
                  ) -> tuple[list[dict], dict[str, float]]:
    """Apply ``cfg`` to ``records``; returns the kept records (with their scores) and a summary.

    ``scorers`` (``{"verifier": fn, "reward_model": fn}``) replace the ones ``cfg`` would build, so a
    caller can pass a loaded reward model or any Python function of records; ``defaults``: options for
    the task-aware reward functions of the scorers it builds (a stage's task).
    Summary: ``records``, ``kept``, ``kept_fraction``, ``prompts``, ``prompts_kept`` and one
    ``dropped/<reason>`` count per reason that dropped anything.
    """
    cfg = cfg if isinstance(cfg, FilterConfig) else FilterConfig.model_validate(cfg or {})
    scorers = dict(scorers or {})
    dropped: dict[str, int] = defaultdict(int)
    seen: set[tuple[str, str]] = set()
    alive: list[dict] = []
    for record in records:
        reason = _cheap_reason(record, cfg, seen)
        if reason:
            dropped[reason] += 1
        else:
            alive.append(dict(record))
    for label, spec in (("verifier", cfg.verifier), ("reward_model", cfg.reward_model)):
        if spec is not None:
            scorer = scorers.get(label) or build_scorer(spec, defaults=defaults)
            alive = _score_and_drop(alive, label, spec, scorer, dropped)
    if cfg.max_per_prompt is not None:
        alive = _keep(alive, top_k_per_prompt(alive, _ranking(alive), cfg.max_per_prompt), "max_per_prompt",
                      dropped)
    summary: dict[str, float] = {"records": len(records), "kept": len(alive),
                                 "kept_fraction": len(alive) / max(len(records), 1),
                                 "prompts": len({prompt_key(r) for r in records}),
                                 "prompts_kept": len({prompt_key(r) for r in alive})}
    summary.update({f"dropped/{k}": v for k, v in dropped.items()})
    return alive, summary


def _keep(records: list[dict], keep: Sequence[bool], reason: str, dropped: dict[str, int]) -> list[dict]:
    dropped[reason] += sum(not k for k in keep)
    return [r for r, k in zip(records, keep, strict=True) if k]


def _ranking(records: Sequence[dict]) -> list[float]:
    """Best first for ``max_per_prompt``: by reward-model score, else verifier score, else file order."""
    for key in ("score/reward_model", "score/verifier"):
        if records and all(r.get(key) is not None for r in records):
            return [r[key] for r in records]
    return [0.0] * len(records)


def _score_and_drop(records: list[dict], label: str, spec: VerifierFilter | RewardFilter, scorer: RecordScorer,
                    dropped: dict[str, int]) -> list[dict]:
    scores = scorer(records) if records else []
    for record, score in zip(records, scores, strict=True):
        record[f"score/{label}"] = score
    if isinstance(spec, VerifierFilter):
        return _keep(records, [s is not None and s >= spec.min_score for s in scores], "verifier", dropped)
    if spec.threshold is not None:
        records = _keep(records, [r[f"score/{label}"] is not None and r[f"score/{label}"] >= spec.threshold
                                  for r in records], "reward_threshold", dropped)
    if spec.top_k is not None:
        values = [float("-inf") if r[f"score/{label}"] is None else r[f"score/{label}"] for r in records]
        records = _keep(records, top_k_per_prompt(records, values, spec.top_k), "reward_top_k", dropped)
    return records


# ---- corpora for the next stage ----------------------------------------------------------------------
def sft_records(records: Sequence[dict], *, chat: bool = False) -> list[dict]:
    """Prompt / completion records for SFT (the prompt masked, the whole completion, ``<think>``
    block included, in the loss); ``chat`` wraps them as a user and an assistant message."""
    out = []
    for r in records:
        prompt, completion = r["prompt"], r["completion"]
        if chat and isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
            completion = [{"role": "assistant", "content": completion}]
        out.append({**r, "prompt": prompt, "completion": completion})
    return out


def preference_pairs(records: Sequence[dict], scores: Sequence[float | None], *, rule: str = "all_pairs",
                     max_per_prompt: int = 4, margin: float = 0.0, threshold: float | None = None,
                     rso: RSOConfig | None = None) -> list[dict]:
    """Chosen / rejected pairs among the samples of each prompt, by a ``tether.core.pairing`` rule
    (largest score gaps first, at most ``max_per_prompt`` a prompt): for training an outcome reward
    model on a policy's own samples labelled by a checker (Cobbe et al. 2021, "Training Verifiers
    to Solve Math Word Problems"). With ``rso``, each prompt's samples are first thinned by RSO's
    rejection sampling (:func:`~tether.core.pairing.rso_sample`; prompts in order of first appearance,
    the g-th drawing from ``Random(f"rso:{seed}:{g}")``)."""
    groups: dict[Any, list[int]] = defaultdict(list)
    for i, record in enumerate(records):
        groups[prompt_key(record)].append(i)
    pairs = []
    for g, members in enumerate(groups.values()):
        group_scores = [scores[i] for i in members]
        if rso is not None:
            group_scores = rso_scores(group_scores, beta=rso.beta, num_samples=rso.samples,
                                      rng=random.Random(f"rso:{rso.seed}:{g}"))
        for chosen, rejected in make_pairs(group_scores, rule, margin=margin, threshold=threshold,
                                           max_pairs=max_per_prompt):
            best, worst = records[members[chosen]], records[members[rejected]]
            pairs.append({"prompt": best["prompt"], "chosen": best["completion"], "rejected": worst["completion"]})
    return pairs
