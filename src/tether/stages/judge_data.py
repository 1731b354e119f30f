"""The ``judge_data`` stage: synthetic judge training data with known verdicts, for an SFT stage to train a judge."""

from __future__ import annotations

import random
from pathlib import Path

from tether.config.preference import JudgeDataConfig
from tether.data.files import write_jsonl_atomic
from tether.rewards.judge import judge_records
from tether.tasks import get_task, sft_records
from tether.trainers import checkpoint as ckpt


def run_judge_data(cfg: JudgeDataConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    """Write ``STAGE/train.jsonl`` (``judge_records``, mixed with ``sft_n`` task demonstrations) and, with
    ``task.eval_n``, held-out ``STAGE/eval.jsonl``; returns the record counts."""
    source = cfg.task
    task = get_task(source.name, **source.options)
    common = {"kind": cfg.kind, "template": cfg.template, "seed": source.seed, "errors": source.errors,
              "scale": cfg.scale, "solve_first": cfg.solve_first}
    rows = judge_records(task, source.n, **common)
    if cfg.sft_n:
        rows += sft_records(task, cfg.sft_n, seed=source.seed + 1)
        random.Random(f"judge-data:{source.seed}").shuffle(rows)
    stage_dir = run_dir / (cfg.name or cfg.type)
    write_jsonl_atomic(stage_dir / "train.jsonl", rows)
    results = {"records": float(len(rows)), "judge_records": float(len(rows) - cfg.sft_n)}
    if source.eval_n:
        write_jsonl_atomic(stage_dir / "eval.jsonl", judge_records(task, source.eval_n, split="eval", **common))
    ckpt.mark_done(stage_dir, {"stage": cfg.name, "type": cfg.type, "results": results})
    return results
