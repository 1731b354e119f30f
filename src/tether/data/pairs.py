"""Preference data: loading pairs leniently, synthetic pairs from a task, and tokenising pairs, rankings,
unpaired records and stepwise traces for the reward-model and preference trainers.

Loading drops (and counts) pairs whose chosen equals their rejected and records with an empty
completion, which are common in scraped data and carry no signal; any other bad row is an error
naming its source, row and field.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tether.config.data import PairDataConfig
from tether.data.loading import read_rows
from tether.data.schemas import DataError, validate_records
from tether.data.tokenize import TokenizedExample, step_sequence, tokenize_sft
from tether.tasks import get_task
from tether.tasks import preferences as synthetic

log = logging.getLogger(__name__)


def _is_empty(value: Any) -> bool:
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, list):
        return all(isinstance(m, dict) and not str(m.get("content") or "").strip() and not m.get("tool_calls")
                   for m in value)
    return False


def _drop_reason(row: Any) -> str | None:
    """"identical" / "empty" for a pair or unpaired record to drop; None to keep (and validate)."""
    if not isinstance(row, dict):
        return None
    if row.get("chosen") is not None and row.get("rejected") is not None:
        chosen, rejected = row["chosen"], row["rejected"]
        if _is_empty(chosen) or _is_empty(rejected):
            return "empty"
        return "identical" if chosen == rejected else None
    if row.get("completion") is not None and _is_empty(row["completion"]):
        return "empty"
    return None


def load_pair_records(source: Any, format: str | None = None, *, split: str = "train",
                      skipped: dict[str, int] | None = None) -> tuple[list[dict], dict[str, int]]:
    """Load and validate records like ``load_records``, first dropping pairs whose chosen equals
    their rejected and records with an empty completion, which are counted, not fatal.

    Returns ``(records, {"identical": n, "empty": n})``. Any other bad row raises ``DataError``
    naming the source, row (or jsonl line) and field, with the numbering of the original file; with
    ``skipped`` (a dict, ``data.on_error: skip``) bad rows are left out and counted there by kind.
    """
    rows, lines, name = read_rows(source, split=split)
    counts = {"identical": 0, "empty": 0}
    keep = []
    for i, row in enumerate(rows):
        reason = _drop_reason(row)
        if reason is None:
            keep.append(i)
        else:
            counts[reason] += 1
    if rows and not keep:
        raise DataError(f"{name}: every record was dropped ({counts['identical']} with chosen equal to "
                        f"rejected, {counts['empty']} with an empty completion)", source=name)
    kept = [rows[i] for i in keep]
    if lines is not None:
        records = validate_records(kept, format, name, line_numbers=[lines[i] for i in keep], skipped=skipped)
    else:
        try:
            records = validate_records(kept, format, name, skipped=skipped)
        except DataError as err:
            if err.row is None or len(keep) == len(rows):
                raise
            original = keep[err.row - 1] + 1  # renumber past the dropped rows
            raise DataError(str(err).replace(f", row {err.row}", f", row {original}", 1), source=name,
                            row=original, field=err.field) from None
    if counts["identical"] or counts["empty"]:
        log.warning("%s: dropped %d records with chosen equal to rejected and %d with an empty completion",
                    name, counts["identical"], counts["empty"])
    return records, counts


def pair_data_stats(stage: str, counts: dict[str, int], stats: dict[str, int], examples: int) -> dict[str, int]:
    """A pair-data stage's ``dropped_*`` counts (loading's ``counts`` plus tokenisation's ``stats``: identical,
    empty, overflow and per-step drops) and its ``skipped`` bad rows (``data.on_error: skip``); a
    :class:`DataError` when no training example (of ``examples``) is left."""
    keys = ("identical", "empty", "overflow", *(k for k in counts if k.startswith("step_")))
    data_stats = {f"dropped_{k}": counts.get(k, 0) + stats.get(k, 0) for k in keys}
    if counts.get("skipped"):
        data_stats["skipped"] = counts["skipped"]
    if not examples:
        raise DataError(f"stage {stage!r}: no training examples left ({data_stats}); check data.max_length and "
                        "data.overflow")
    return data_stats


def _held_out(records: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    if not fraction:
        return records, []
    order = list(range(len(records)))
    random.Random(f"held-out:{seed}").shuffle(order)
    k = max(1, round(fraction * len(records)))
    held = set(order[:k])
    return [r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(held)]


def pair_data(data: PairDataConfig, *, kind: str, format: str | None, unpaired: bool = False
              ) -> tuple[list[dict], list[dict], dict[str, int]]:
    """Training and held-out records of a pair-data config, and the drop counts (``skipped``: bad rows left
    out under ``data.on_error: skip``).

    ``kind``: the synthetic kind used when ``data.task.kind`` is unset. ``unpaired``: synthetic
    training records as unpaired ``{prompt, completion, label}`` (KTO); held-out ones stay pairs.
    """
    if data.path is not None:
        skipped: dict[str, int] | None = {} if data.on_error == "skip" else None
        records, counts = load_pair_records(data.path, format, skipped=skipped)
        if data.eval_path is not None:
            held, eval_counts = load_pair_records(data.eval_path, None if unpaired else format, skipped=skipped)
            counts = {k: counts[k] + eval_counts[k] for k in counts}
        else:
            records, held = _held_out(records, data.eval_fraction, seed=0)
        if skipped:
            counts["skipped"] = sum(skipped.values())
            log.warning("skipped %d bad rows of %s (data.on_error: skip): %s", counts["skipped"], data.path,
                        "; ".join(f"{n} x {k}" for k, n in skipped.items()))
        return records, held, counts
    source = data.task
    task = get_task(source.name, **source.options)
    kind = source.kind or kind
    common = {"seed": source.seed, "errors": source.errors}
    if kind in ("stepwise", "ranking"):
        def make(n: int, split: str) -> list[dict]:
            if kind == "ranking":
                return synthetic.ranking_records(task, n, split=split, completions=source.completions,
                                                 chat=source.chat, **common)
            return synthetic.stepwise_records(task, n, split=split, wrong_fraction=source.wrong_fraction, **common)
        return make(source.n, "train"), (make(source.eval_n, "eval") if source.eval_n else []), {}
    train_fn = synthetic.unpaired_records if unpaired else synthetic.preference_records
    train = train_fn(task, source.n, split="train", kind=kind, chat=source.chat, **common)
    held = (synthetic.preference_records(task, source.eval_n, split="eval", kind=kind, chat=source.chat, **common)
            if source.eval_n else [])
    return train, held, {}


@dataclass
class PairExample:
    """A tokenised preference pair; ``margin`` is the record's optional required reward gap, ``win_probs``
    its optional ``(chosen_win_prob, rejected_win_prob)``: each completion's probability of beating the
    policy that sampled it (SPPO)."""

    chosen: TokenizedExample
    rejected: TokenizedExample
    margin: float | None = None
    win_probs: tuple[float, float] | None = None


def _number(record: dict, field: str, row: int, low: float | None = None, high: float | None = None) -> float | None:
    value = record.get(field)
    if value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise DataError(f"record {row}, field {field!r}: expected a number, got {value!r}", row=row,
                        field=field) from None
    if (low is not None and value < low) or (high is not None and value > high):
        raise DataError(f"record {row}, field {field!r}: {value} is outside [{low}, {high}]", row=row, field=field)
    return value


def _completion_example(prompt: Any, completion: Any, record: dict, tokenizer: Any, max_length: int,
                        overflow: str, partial: bool = False) -> TokenizedExample | None:
    row = {"prompt": prompt, "completion": completion, "partial": partial}
    if record.get("tools") is not None:
        row["tools"] = record["tools"]
    return tokenize_sft(row, tokenizer, max_length=max_length, overflow=overflow)


def tokenize_pairs(records: Sequence[dict], tokenizer: Any, *, max_length: int, overflow: str = "truncate"
                   ) -> tuple[list[PairExample], dict[str, int]]:
    """Each pair as two SFT-style examples (prompt masked, completion + eos as loss tokens; no eos after a
    completion whose record says ``chosen_partial`` / ``rejected_partial``: a step-level pair's middle step).

    Pairs that lose every completion token to ``max_length`` (or any, with ``overflow="drop"``)
    are dropped as ``overflow``; pairs whose two token sequences are equal as ``identical``.
    """
    pairs, stats = [], {"overflow": 0, "identical": 0}
    for i, record in enumerate(records):
        chosen = _completion_example(record["prompt"], record["chosen"], record, tokenizer, max_length, overflow,
                                     bool(record.get("chosen_partial")))
        rejected = _completion_example(record["prompt"], record["rejected"], record, tokenizer, max_length, overflow,
                                       bool(record.get("rejected_partial")))
        if chosen is None or rejected is None:
            stats["overflow"] += 1
            continue
        if chosen.input_ids == rejected.input_ids:
            stats["identical"] += 1
            continue
        margin = _number(record, "margin", i + 1)
        wins = [_number(record, f"{side}_win_prob", i + 1, 0.0, 1.0) for side in ("chosen", "rejected")]
        if (wins[0] is None) != (wins[1] is None):
            raise DataError(f"record {i + 1}: chosen_win_prob and rejected_win_prob come together; one is missing",
                            row=i + 1)
        pairs.append(PairExample(chosen, rejected, margin, None if wins[0] is None else (wins[0], wins[1])))
    return pairs, stats


@dataclass
class RankingExample:
    """A prompt's tokenised answers, best first, and their ranks (0 the best; equal ranks tie)."""

    completions: list[TokenizedExample]
    ranks: list[int]


def tokenize_rankings(records: Sequence[dict], tokenizer: Any, *, max_length: int, overflow: str = "truncate"
                      ) -> tuple[list[RankingExample], dict[str, int]]:
    """Each answer of a ranking record as an SFT-style example (prompt masked, completion + eos).

    Ranks default to the listed order (best first). An answer that loses every completion token to
    ``max_length`` (or any, with ``overflow="drop"``) is left out, as is one whose tokens equal a better
    ranked answer's; a record left without two ranks (no pair) is dropped as ``overflow`` or ``identical``.
    """
    examples, stats = [], {"overflow": 0, "identical": 0}
    for record in records:
        ranks = record.get("ranks") or list(range(len(record["completions"])))
        kept: list[tuple[TokenizedExample, int]] = []
        seen, overflowed = set(), False
        for i in sorted(range(len(ranks)), key=ranks.__getitem__):
            example = _completion_example(record["prompt"], record["completions"][i], record, tokenizer,
                                          max_length, overflow)
            if example is None or tuple(example.input_ids) in seen:
                overflowed |= example is None
                continue
            seen.add(tuple(example.input_ids))
            kept.append((example, ranks[i]))
        if len({rank for _, rank in kept}) < 2:
            stats["overflow" if overflowed else "identical"] += 1
            continue
        examples.append(RankingExample([e for e, _ in kept], [rank for _, rank in kept]))
    return examples, stats


@dataclass
class StepExample:
    """A stepwise trace: token ids, the separator positions whose scores judge each step, labels."""

    input_ids: list[int]
    positions: list[int]
    labels: list[float]


def tokenize_stepwise(records: Sequence[dict], tokenizer: Any, *, separator: str, max_length: int
                      ) -> tuple[list[StepExample], dict[str, int]]:
    """Stepwise records -> examples; steps past ``max_length`` are cut, a record with none left dropped."""
    examples, stats = [], {"overflow": 0, "truncated": 0}
    for record in records:
        ids, positions = step_sequence(record["prompt"], record["steps"], tokenizer, separator)
        labels = [float(bool(x)) for x in record["labels"]]
        if len(ids) > max_length:
            keep = sum(p < max_length for p in positions)
            if keep == 0:
                stats["overflow"] += 1
                continue
            stats["truncated"] += 1
            ids, positions, labels = ids[: positions[keep - 1] + 1], positions[:keep], labels[:keep]
        examples.append(StepExample(ids, positions, labels))
    return examples, stats


@dataclass
class UnpairedExample:
    prompt: Any
    completion: Any
    example: TokenizedExample
    desirable: bool
    tools: Any = None


def tokenize_unpaired(records: Sequence[dict], tokenizer: Any, *, max_length: int, overflow: str
                      ) -> tuple[list[UnpairedExample], dict[str, int]]:
    out, stats = [], {"overflow": 0}
    for r in records:
        row = {"prompt": r["prompt"], "completion": r["completion"], "tools": r.get("tools")}
        example = tokenize_sft({k: v for k, v in row.items() if v is not None}, tokenizer,
                               max_length=max_length, overflow=overflow)
        if example is None:
            stats["overflow"] += 1
            continue
        out.append(UnpairedExample(r["prompt"], r["completion"], example, bool(r["label"]), r.get("tools")))
    return out, stats


def is_paired(records: Sequence[dict]) -> bool:
    return bool(records) and "chosen" in records[0]
