"""Bulk generation to jsonl: ``tether generate``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.progress import Progress

from tether.data import tokenize_prompts
from tether.rollout import HFEngine, SamplingParams


def read_prompts(path: Path) -> list[Any]:
    """Prompts from a jsonl / json / parquet file with a ``prompt`` field, or a text file (one per line)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompts file {str(path)!r} does not exist")
    if path.suffix in (".txt", ""):
        return [line for line in path.read_text().splitlines() if line.strip()]
    from tether.data import load_records

    records = load_records(path)
    missing = [i + 1 for i, r in enumerate(records) if "prompt" not in r]
    if missing:
        raise ValueError(f"{path}: row {missing[0]}: missing field 'prompt'")
    return [r["prompt"] for r in records]


def generate_file(model: str, prompts_path: Path, out: Path, *, n: int = 1, temperature: float = 1.0,
                  top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 128, greedy: bool = False,
                  seed: int | None = None, chat: bool = False, batch_size: int = 64) -> int:
    """Generate ``n`` samples per prompt and write one jsonl record per sample, flushed per batch."""
    from tether.models import load_model

    prompts = read_prompts(prompts_path)
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                            max_new_tokens=max_new_tokens, greedy=greedy, seed=seed)
    policy, tokenizer = load_model(model)
    engine = HFEngine(policy, tokenizer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    per_call = max(1, batch_size // n)
    written = 0
    with open(out, "w") as f, Progress() as progress:
        task = progress.add_task("generate", total=len(prompts))
        for start in range(0, len(prompts), per_call):
            chunk = prompts[start:start + per_call]
            rollout = engine.generate(tokenize_prompts(chunk, tokenizer, chat=chat), params)
            for i in range(len(rollout)):
                index = rollout.prompt_index[i]
                record = {"prompt_id": start + index, "sample": i % n, "prompt": chunk[index],
                          "completion": rollout.texts[i], "tokens": len(rollout.completion_ids[i]),
                          "finish_reason": rollout.finish_reasons[i]}
                f.write(json.dumps(record) + "\n")
                written += 1
            f.flush()
            progress.advance(task, len(chunk))
    return written
