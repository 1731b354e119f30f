"""Reward models: an outcome RM trained on preference pairs, a process RM on labelled steps.

Outcome (``process: false``): a scalar head read at the last token of prompt + completion + eos;
the Bradley-Terry loss ``-log σ(r_c - r_r - m)`` (InstructGPT, Ouyang et al. 2022, Eq. 1; the
per-pair margin m of Llama 2 when records carry a ``margin`` column) with optional reward
centring. Chosen and rejected of a micro-batch go through the model in one packed forward pass.
Unlike InstructGPT, which puts all K-choose-2 comparisons of a prompt in one batch element,
each record is one pair and the loss is the mean over the pairs of the global batch.

Process (``process: true``): stepwise records ``{prompt, steps, labels}`` are laid out as
``prompt + step_1 + sep + step_2 + sep + ...``; the head's logit at the last token of each
separator scores the step so far, trained with binary cross-entropy on the step labels (as
Math-Shepherd, Wang et al. 2024, with its tag token; Lightman et al. 2023 predict at the
step's last token). Step scores sigmoid(logit) are aggregated into a trajectory score with a
``STEP_AGGREGATIONS`` entry (``aggregation``, default ``min``) by the scorer.

Held-out figures: pairwise accuracy, mean margin and reward mean / std (outcome); step accuracy,
step BCE and trajectory accuracy (aggregated score > 0.5 against "every step good"), with the
share of good steps and trajectories as their majority-class baselines (process).

This module also holds the pair-data plumbing the offline preference trainer shares: configs
for pair data, lenient loading that drops (and counts) identical or empty pairs, tokenisation
of pairs, and the step -> micro-batches schedule.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from tether.config import DataConfig, StageConfig, StrictModel
from tether.core.reward import STEP_AGGREGATIONS, bradley_terry_loss
from tether.data import DataError, TokenizedExample, tokenize_sft, validate_records
from tether.data.loading import read_rows
from tether.models.loading import resolve_model
from tether.models.reward_model import load_reward_model, score_positions, set_reward_info, step_sequence
from tether.pipeline import register_stage
from tether.tasks import get_task
from tether.tasks import preferences as synthetic
from tether.trainers.loop import Trainer

log = logging.getLogger(__name__)


# ---- configs ------------------------------------------------------------------------------------


class PreferenceTaskSource(StrictModel):
    """Synthetic preference / stepwise records from a built-in task (``tether.tasks.preferences``).

    Training records come from the task's train split (``n``), held-out ones from its eval split
    (``eval_n``), so they never share a problem.
    """

    name: str = "arithmetic"
    options: dict[str, Any] = Field(default_factory=dict)
    n: int = Field(1000, ge=1)
    eval_n: int = Field(200, ge=0, description="held-out records from the task's eval split")
    seed: int = 0
    kind: Literal["correctness", "style", "mixed", "stepwise"] | None = Field(
        None, description="pairs (correctness / style / mixed) or stepwise traces; default by stage")
    errors: list[Literal["slip", "dropped_carry", "answer"]] = Field(
        default_factory=lambda: list(synthetic.ERRORS), min_length=1,
        description="kinds of mistake in wrong completions / steps (tether.tasks.preferences.wrong_addition)")
    wrong_fraction: float = Field(0.5, ge=0, le=1, description="stepwise: share of traces with a wrong step")
    chat: bool = False


class PairDataConfig(DataConfig):
    """Preference or stepwise records: a file (``path``, held out by ``eval_path`` or
    ``eval_fraction``) or a synthetic task (``task``)."""

    task: PreferenceTaskSource | None = None
    eval_path: str | None = None
    eval_fraction: float = Field(0.0, ge=0, lt=1, description="share of `path` records held out "
                                                              "when there is no eval_path")


class RewardModelConfig(StageConfig):
    type: Literal["rm"] = "rm"
    data: PairDataConfig = Field(default_factory=lambda: PairDataConfig(task={"name": "arithmetic"}))
    process: bool = Field(False, description="process reward model on stepwise records")
    step_separator: str = Field("\n", min_length=1, description="appended after every step (process RM)")
    aggregation: str = Field("min", description="step-score aggregation (process RM): min, product, last, mean")
    center_coef: float = Field(0.0, ge=0, description="reward centring weight (outcome RM)")

    @model_validator(mode="after")
    def _consistent(self) -> RewardModelConfig:
        if self.aggregation not in STEP_AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.aggregation!r}; valid: {', '.join(STEP_AGGREGATIONS)}")
        if self.eval is not None:
            raise ValueError("a reward model stage has no task evaluation ('eval'): it is evaluated on "
                             "held-out pairs (data.task.eval_n, data.eval_path or data.eval_fraction)")
        expected = "stepwise" if self.process else "preference"
        if self.data.format not in (None, expected):
            raise ValueError(f"data.format is {self.data.format!r} but a {'process' if self.process else 'outcome'} "
                             f"reward model trains on {expected!r} records")
        kind = self.data.task.kind if self.data.task is not None else None
        if kind is not None and (kind == "stepwise") != self.process:
            raise ValueError(f"data.task.kind {kind!r} does not fit process={self.process}: a process reward "
                             "model trains on 'stepwise' records, an outcome one on pairs")
        return self


# ---- records --------------------------------------------------------------------------------------


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


def load_pair_records(source: Any, format: str | None = None, *, split: str = "train"
                      ) -> tuple[list[dict], dict[str, int]]:
    """Load and validate records like ``load_records``, first dropping pairs whose chosen equals
    their rejected and records with an empty completion, which are counted, not fatal.

    Returns ``(records, {"identical": n, "empty": n})``. Any other bad row raises ``DataError``
    naming the source, row (or jsonl line) and field, with the numbering of the original file.
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
        records = validate_records(kept, format, name, line_numbers=[lines[i] for i in keep])
    else:
        try:
            records = validate_records(kept, format, name)
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
    """Training and held-out records of a pair-data config, and the drop counts.

    ``kind``: the synthetic kind used when ``data.task.kind`` is unset. ``unpaired``: synthetic
    training records as unpaired ``{prompt, completion, label}`` (KTO); held-out ones stay pairs.
    """
    if data.path is not None:
        records, counts = load_pair_records(data.path, format)
        if data.eval_path is not None:
            held, eval_counts = load_pair_records(data.eval_path, None if unpaired else format)
            counts = {k: counts[k] + eval_counts[k] for k in counts}
            return records, held, counts
        train, held = _held_out(records, data.eval_fraction, seed=0)
        return train, held, counts
    source = data.task
    task = get_task(source.name, **source.options)
    kind = source.kind or kind
    common = {"seed": source.seed, "errors": source.errors}
    if kind == "stepwise":
        def make(n: int, split: str) -> list[dict]:
            return synthetic.stepwise_records(task, n, split=split, wrong_fraction=source.wrong_fraction, **common)
        return make(source.n, "train"), (make(source.eval_n, "eval") if source.eval_n else []), {}
    train_fn = synthetic.unpaired_records if unpaired else synthetic.preference_records
    train = train_fn(task, source.n, split="train", kind=kind, chat=source.chat, **common)
    held = (synthetic.preference_records(task, source.eval_n, split="eval", kind=kind, chat=source.chat, **common)
            if source.eval_n else [])
    return train, held, {}


@dataclass
class PairExample:
    """A tokenised preference pair; ``margin`` is the record's optional required reward gap."""

    chosen: TokenizedExample
    rejected: TokenizedExample
    margin: float | None = None


def _completion_example(prompt: Any, completion: Any, record: dict, tokenizer: Any, max_length: int,
                        overflow: str) -> TokenizedExample | None:
    row = {"prompt": prompt, "completion": completion}
    if record.get("tools") is not None:
        row["tools"] = record["tools"]
    return tokenize_sft(row, tokenizer, max_length=max_length, overflow=overflow)


def tokenize_pairs(records: Sequence[dict], tokenizer: Any, *, max_length: int, overflow: str = "truncate"
                   ) -> tuple[list[PairExample], dict[str, int]]:
    """Each pair as two SFT-style examples (prompt masked, completion + eos as loss tokens).

    Pairs that lose every completion token to ``max_length`` (or any, with ``overflow="drop"``)
    are dropped as ``overflow``; pairs whose two token sequences are equal as ``identical``.
    """
    pairs, stats = [], {"overflow": 0, "identical": 0}
    for i, record in enumerate(records):
        chosen = _completion_example(record["prompt"], record["chosen"], record, tokenizer, max_length, overflow)
        rejected = _completion_example(record["prompt"], record["rejected"], record, tokenizer, max_length, overflow)
        if chosen is None or rejected is None:
            stats["overflow"] += 1
            continue
        if chosen.input_ids == rejected.input_ids:
            stats["identical"] += 1
            continue
        margin = record.get("margin")
        if margin is not None:
            try:
                margin = float(margin)
            except (TypeError, ValueError):
                raise DataError(f"record {i + 1}, field 'margin': expected a number, got {margin!r}",
                                row=i + 1, field="margin") from None
        pairs.append(PairExample(chosen, rejected, margin))
    return pairs, stats


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


# ---- batching ------------------------------------------------------------------------------------


class BatchSchedule:
    """Which examples form the micro-batches of optimiser step ``s``: a pure function of ``s``, for exact resume.

    Examples are shuffled by ``seed`` and cut into micro-batches of ``batch_size`` (a partial last
    one is dropped), dealt round-robin to ranks; ``grad_accum`` micro-batches make a step. With
    ``reshuffle`` every epoch reshuffles the examples; without it the micro-batches keep their
    composition and only their order changes per epoch, so anything computed per micro-batch
    before training (cached reference log-probs of KTO's mismatched pairs) stays valid.
    """

    def __init__(self, n: int, *, batch_size: int, grad_accum: int, seed: int, rank: int = 0,
                 world_size: int = 1, reshuffle: bool = True) -> None:
        self.n, self.batch_size, self.grad_accum, self.seed = n, batch_size, grad_accum, seed
        self.rank, self.world_size, self.reshuffle = rank, world_size, reshuffle
        self.per_rank = n // batch_size // world_size
        if self.per_rank < grad_accum:
            raise ValueError(f"{n} examples make only {self.per_rank} micro-batches of {batch_size} per rank, "
                             f"fewer than grad_accum={grad_accum}")
        self.steps_per_epoch = self.per_rank // grad_accum
        self._cache: tuple[int, list[list[int]]] | None = None

    def _groups(self, epoch: int) -> list[list[int]]:
        order = list(range(self.n))
        random.Random(f"tether-pairs:{self.seed}:{epoch}").shuffle(order)
        groups = [order[k:k + self.batch_size] for k in range(0, self.n - self.batch_size + 1, self.batch_size)]
        return groups[self.rank::self.world_size][: self.per_rank]

    def fixed_batches(self) -> list[list[int]]:
        """This rank's micro-batches when compositions are fixed (``reshuffle=False``)."""
        return self._groups(0)

    def epoch(self, epoch: int) -> list[list[int]]:
        if self._cache is None or self._cache[0] != epoch:
            if self.reshuffle:
                groups = self._groups(epoch)
            else:
                groups = self._groups(0)
                random.Random(f"tether-pair-order:{self.seed}:{epoch}").shuffle(groups)
            self._cache = (epoch, groups)
        return self._cache[1]

    def for_step(self, step: int) -> list[list[int]]:
        epoch, offset = divmod(step, self.steps_per_epoch)
        return self.epoch(epoch)[offset * self.grad_accum:(offset + 1) * self.grad_accum]


def chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[k:k + size] for k in range(0, len(items), size)]


# ---- the trainer ---------------------------------------------------------------------------------


class RewardModelTrainer(Trainer):
    """Bradley-Terry (outcome) or step-level BCE (process) on the shared loop."""

    def __init__(self, config: RewardModelConfig, model: torch.nn.Module, tokenizer: Any, run_dir: str | Path,
                 *, records: list[dict] | None = None, eval_records: list[dict] | None = None,
                 dropped: dict[str, int] | None = None, stage: str | None = None) -> None:
        super().__init__(config, model, tokenizer, run_dir, stage=stage)
        cfg = self.config
        set_reward_info(model, process=cfg.process, step_separator=cfg.step_separator, aggregation=cfg.aggregation)
        fmt = "stepwise" if cfg.process else "preference"
        counts: dict[str, int] = dict(dropped or {})
        if records is None:
            records, default_eval, counts = pair_data(cfg.data, kind=fmt if cfg.process else "correctness",
                                                      format=fmt)
            eval_records = default_eval if eval_records is None else eval_records
        self.examples, stats = self._tokenize(records)
        self.eval_examples, _ = self._tokenize(eval_records or [])
        self.data_stats = {f"dropped_{k}": counts.get(k, 0) + stats.get(k, 0) for k in ("identical", "empty", "overflow")}
        if not self.examples:
            raise ValueError(f"stage {self.stage!r}: no training examples left ({self.data_stats})")
        self.schedule = BatchSchedule(len(self.examples), batch_size=cfg.train.batch_size,
                                      grad_accum=cfg.train.grad_accum, seed=cfg.train.seed, rank=self.dist.rank,
                                      world_size=self.dist.world_size)
        dropped = {k: v for k, v in self.data_stats.items() if v}
        if dropped:
            log.warning("%s: dropped %s", self.stage, dropped)
        self.results.update({f"data/{k}": float(v) for k, v in dropped.items()})
        self.logger.log(0, {f"data/{k}": v for k, v in self.data_stats.items()})
        log.info("%s: %d training and %d held-out %s examples (%s)", self.stage, len(self.examples),
                 len(self.eval_examples), fmt, self.data_stats)

    def _tokenize(self, records: list[dict]) -> tuple[list, dict[str, int]]:
        cfg = self.config
        if cfg.process:
            return tokenize_stepwise(records, self.tokenizer, separator=cfg.step_separator,
                                     max_length=cfg.data.max_length)
        return tokenize_pairs(records, self.tokenizer, max_length=cfg.data.max_length, overflow=cfg.data.overflow)

    # ---- scores -----------------------------------------------------------------------------------
    def pair_rewards(self, pairs: Sequence[PairExample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rewards of chosen and rejected, shape (B,) each, from one packed forward pass."""
        sequences = [p.chosen.input_ids for p in pairs] + [p.rejected.input_ids for p in pairs]
        scores = score_positions(self.model, sequences, [[len(s) - 1] for s in sequences],
                                 row_tokens=self.config.data.pack_length, pad_token_id=self.tokenizer.pad_token_id,
                                 packing=self.config.data.packing)
        return scores[: len(pairs)], scores[len(pairs):]

    def step_logits(self, examples: Sequence[StepExample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step logits and labels, flat (P,), and the step count of each example (B,)."""
        logits = score_positions(self.model, [e.input_ids for e in examples], [e.positions for e in examples],
                                 row_tokens=self.config.data.pack_length, pad_token_id=self.tokenizer.pad_token_id,
                                 packing=self.config.data.packing)
        labels = torch.tensor([y for e in examples for y in e.labels], device=logits.device)
        return logits, labels, torch.tensor([len(e.positions) for e in examples])

    # ---- losses -----------------------------------------------------------------------------------
    def outcome_loss(self, pairs: Sequence[PairExample], global_pairs: float) -> tuple[torch.Tensor, dict]:
        chosen, rejected = self.pair_rewards(pairs)
        margin = None
        if any(p.margin is not None for p in pairs):
            margin = chosen.new_tensor([p.margin or 0.0 for p in pairs])
        loss, metrics = bradley_terry_loss(chosen, rejected, margin=margin, center_coef=self.config.center_coef)
        return loss * len(pairs) / global_pairs, metrics

    def process_loss(self, examples: Sequence[StepExample], global_steps: float) -> tuple[torch.Tensor, dict]:
        logits, labels, _ = self.step_logits(examples)
        loss = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum") / global_steps
        metrics = {"step_accuracy": ((logits > 0).float() == labels).float().mean(),
                   "step_score/mean": torch.sigmoid(logits.detach()).mean()}
        return loss, metrics

    def training_step(self) -> dict[str, Any]:
        groups = [[self.examples[i] for i in g] for g in self.schedule.for_step(self.step)]
        if self.config.process:
            denominator = self.global_count(sum(len(e.positions) for g in groups for e in g))
            return self.optimizer_step(groups, lambda g: self.process_loss(g, denominator))
        denominator = self.global_count(sum(len(g) for g in groups))
        return self.optimizer_step(groups, lambda g: self.outcome_loss(g, denominator))

    # ---- evaluation -------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out pairwise accuracy, margin and reward statistics, or step / trajectory accuracy."""
        if not self.eval_examples:
            return {}
        self.model.eval()
        size = self.config.train.batch_size
        if not self.config.process:
            scores = [self.pair_rewards(c) for c in chunks(self.eval_examples, size)]
            chosen, rejected = torch.cat([s[0] for s in scores]), torch.cat([s[1] for s in scores])
            loss, m = bradley_terry_loss(chosen, rejected)
            return {"pairwise_accuracy": float(m["accuracy"]), "margin": float(m["margin"]),
                    "rewards/chosen": float(m["rewards/chosen"]), "rewards/rejected": float(m["rewards/rejected"]),
                    "rewards/mean": float(m["rewards/mean"]), "rewards/std": float(m["rewards/std"]),
                    "loss": float(loss)}
        logits, labels, counts = zip(*(self.step_logits(c) for c in chunks(self.eval_examples, size)), strict=True)
        logits, labels, counts = torch.cat(logits), torch.cat(labels), torch.cat(counts)
        aggregate = STEP_AGGREGATIONS.get(self.config.aggregation)
        padded = torch.zeros(len(counts), int(counts.max()))
        mask = torch.arange(padded.shape[1])[None, :] < counts[:, None]
        padded[mask] = torch.sigmoid(logits).cpu()
        good = torch.zeros_like(padded)
        good[mask] = labels.cpu()
        trajectory_good = torch.where(mask, good, 1.0).amin(-1) > 0.5
        trajectory = aggregate(padded, mask) > 0.5
        return {"step_accuracy": float(((logits > 0).float() == labels).float().mean()),
                "step_bce": float(F.binary_cross_entropy_with_logits(logits, labels)),
                "trajectory_accuracy": float((trajectory == trajectory_good).float().mean()),
                # the majority-class baselines these accuracies are to be read against
                "step_good_fraction": float(labels.mean()),
                "trajectory_good_fraction": float(trajectory_good.float().mean())}


# ---- the one-call API and the stage --------------------------------------------------------------


def train_reward_model(config: RewardModelConfig | dict, *, out: str | Path, model: Any = None,
                       tokenizer: Any = None, dataset: Any = None, eval_dataset: Any = None,
                       resume: bool = False) -> dict[str, float]:
    """Train an outcome (pairs) or process (``config.process``, stepwise records) reward model.

    ``model``: None (``config.model``), a path / hub id (an SFT checkpoint gets a new score head),
    or a loaded ``*ForSequenceClassification`` model with its ``tokenizer``. ``dataset`` /
    ``eval_dataset`` (a file, list of dicts or ``datasets.Dataset``) replace ``config.data``.
    Writes the model to ``out/<stage>`` (reload with ``AutoModelForSequenceClassification`` or
    ``RewardModelScorer``) and returns the held-out figures.
    """
    cfg = config if isinstance(config, RewardModelConfig) else RewardModelConfig.model_validate(config)
    model, tokenizer = resolve_model(model, tokenizer, cfg.model, loader=load_reward_model)
    fmt = "stepwise" if cfg.process else "preference"
    records = held = None
    dropped: dict[str, int] = {}
    if dataset is not None:
        records, dropped = load_pair_records(dataset, fmt)
    if eval_dataset is not None:
        held, eval_dropped = load_pair_records(eval_dataset, fmt)
        dropped = {k: dropped.get(k, 0) + v for k, v in eval_dropped.items()}
    trainer = RewardModelTrainer(cfg, model, tokenizer, out, records=records, eval_records=held, dropped=dropped,
                                 stage=cfg.name or cfg.type)
    return trainer.fit(resume=resume)


@register_stage("rm", RewardModelConfig, "reward model: Bradley-Terry on pairs, or a process RM on labelled steps")
def run_reward_model(cfg: RewardModelConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    return train_reward_model(cfg, out=run_dir, resume=resume)
