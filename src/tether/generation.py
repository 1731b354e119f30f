"""Bulk, resumable corpus generation: ``tether generate`` and the ``generate`` stage.

K samples per prompt from any :class:`~tether.rollout.GenerationEngine` (the local KV-cached
sampler, or an OpenAI-compatible endpoint such as ``tether serve`` or a vLLM server), one record
per sample::

    {"prompt_id": 12, "sample": 3, "prompt": "47+85=", "completion": "<think>...</think>132",
     "tokens": 31, "finish_reason": "stop", ...the prompt record's other columns, e.g. "answer"}

How a kill is survived. Records are appended to a jsonl journal one engine call (a chunk of
prompts with all their samples) at a time, then flushed and ``fsync``-ed, so a killed run loses
at most the chunk in flight. On restart the journal is read back: everything after its last
newline (a torn line) is cut off, the ``(prompt_id, sample)`` pairs already present are skipped,
and only the missing samples are generated, so the finished file holds each pair exactly once.
A ``.parquet`` output is written from the journal at the end (to a temporary name, then renamed;
the journal, ``NAME.partial.jsonl``, is then removed). A ``NAME.meta.json`` beside the output
records the model, the prompts and the sampling settings; resuming with different ones is an
error rather than a silently mixed corpus.

Prompt ids are positions in the prompt list, so the prompt file must not change between a run
and its resumption (the meta file checks a hash of the prompts).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from tether.config.base import ConfigError
from tether.data import tokenize_prompts
from tether.data.files import write_atomic
from tether.data.schemas import DataError
from tether.data.sources import read_prompt_records
from tether.rollout import GenerationEngine, HFEngine, SamplingParams

CORPUS_FIELDS = ("prompt_id", "sample", "prompt", "completion", "tokens", "finish_reason")


# ---- engines -----------------------------------------------------------------------------------------
def make_engine(engine: str = "local", model: Any = "tether/tiny", *, tokenizer: Any = None,
                base_url: str | None = None, api_key_env: str | None = None, batch_size: int | None = None,
                **engine_options: Any) -> tuple[GenerationEngine, Any]:
    """``(engine, tokenizer)``: ``"local"`` loads ``model`` (path, hub id, ``tether/tiny`` or a loaded
    model with its ``tokenizer``) into an :class:`HFEngine`; ``"openai"`` talks to an OpenAI-compatible
    endpoint at ``base_url`` serving ``model``, with the tokenizer (``tokenizer``, else ``model``)
    loaded locally to turn prompts into token ids."""
    from tether.models.loading import load_model, load_tokenizer

    if engine == "local":
        if isinstance(model, str | Path):
            model, tokenizer = load_model(str(model), tokenizer=tokenizer, **engine_options)
        elif tokenizer is None:
            raise ValueError("pass the tokenizer together with a loaded model")
        model.eval()
        return HFEngine(model, tokenizer, batch_size=batch_size), tokenizer
    if engine == "openai":
        if not base_url:
            raise ConfigError("the openai engine needs a base URL (--base-url)")
        try:
            from tether.rollout.openai_engine import OpenAIEngine
        except ImportError as err:
            raise ConfigError(f"the openai engine needs tether.rollout.openai_engine, which cannot be "
                              f"imported here ({err})") from None
        if tokenizer is None or isinstance(tokenizer, str | Path):
            tokenizer = load_tokenizer(str(tokenizer or model))
        return OpenAIEngine(base_url, str(model), api_key_env=api_key_env, tokenizer=tokenizer,
                            **engine_options), tokenizer
    raise ConfigError(f"unknown engine {engine!r}; valid: local, openai")


# ---- the corpus file ---------------------------------------------------------------------------------
def journal_path(out: Path) -> Path:
    """Where records are appended while generating: the output itself for jsonl."""
    return out if out.suffix != ".parquet" else out.with_name(out.stem + ".partial.jsonl")


def recover_journal(path: Path) -> list[dict]:
    """Records of a jsonl journal; a torn last line (no newline after it) is cut off the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    records = []
    for number, line in enumerate(data[:end].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise DataError(f"{path}, line {number}: invalid JSON in the middle of the corpus ({err.msg}); "
                            "only the last line can be torn by a kill", source=str(path), row=number) from None
    return records


def read_corpus(path: str | Path) -> list[dict]:
    """Every record of a generated corpus (jsonl, or parquet with its journal if unfinished)."""
    path = Path(path)
    if path.suffix == ".parquet" and path.exists():
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    journal = journal_path(path)
    if not journal.exists():
        raise FileNotFoundError(f"corpus {str(path)!r} does not exist")
    return recover_journal(journal)


def write_records(path: str | Path, records: Sequence[dict]) -> Path:
    """Write records as jsonl or parquet (by suffix), to a temporary name then renamed."""
    path = Path(path)

    def write(tmp: Path) -> None:
        if path.suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(list(records)), tmp)
        else:
            tmp.write_text("".join(json.dumps(record) + "\n" for record in records))

    return write_atomic(path, write)


def _check_meta(out: Path, meta: dict, resume: bool) -> None:
    """Refuse to resume a corpus made with other settings; write the settings for the next resume."""
    path = out.with_name(out.stem + ".meta.json")
    if resume and path.exists():
        old = json.loads(path.read_text())
        changed = sorted(k for k in set(old) | set(meta) if old.get(k) != meta.get(k))
        if changed:
            raise ConfigError(f"{out} was generated with different {', '.join(changed)}; resuming would mix "
                              "two corpora (start over with --overwrite, or write to another file)")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=2))


def prompts_digest(prompts: Sequence[Any]) -> str:
    return hashlib.sha256(json.dumps(list(prompts), sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---- generation --------------------------------------------------------------------------------------
def _pending(done: set[tuple[int, int]], n_prompts: int, n: int) -> list[tuple[int, list[int]]]:
    """``(prompt_id, missing sample indices)`` for every prompt not yet complete."""
    out = []
    for pid in range(n_prompts):
        missing = [s for s in range(n) if (pid, s) not in done]
        if missing:
            out.append((pid, missing))
    return out


def _chunks(pending: list[tuple[int, list[int]]], per_call: int) -> Iterator[list[tuple[int, list[int]]]]:
    for start in range(0, len(pending), per_call):
        yield pending[start:start + per_call]


def _progress(enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]generate[/]"), BarColumn(),
                    TextColumn("{task.completed}/{task.total} prompts"),
                    TextColumn("{task.fields[rate]:.1f} samples/s"), TimeRemainingColumn(), disable=not enabled)


def generate_corpus(engine: GenerationEngine, tokenizer: Any, prompts: Sequence[dict | str], out: str | Path,
                    params: SamplingParams, *, chat: bool = False, prompt_template: str = "{prompt}",
                    batch_size: int = 256, resume: bool = True, meta: dict | None = None,
                    progress: bool = True) -> dict[str, float]:
    """Generate ``params.n`` samples per prompt into ``out`` (``.jsonl`` or ``.parquet``), resumably.

    ``prompts``: records with a ``prompt`` field (other columns are copied into every sample's
    record) or plain strings. ``batch_size``: samples per engine call, which is also how often the
    file is flushed. ``resume=False`` starts over. ``meta``: extra settings (the model, say) that
    must match for a resume. ``params.seed`` seeds each chunk as ``seed + first prompt id``.

    Returns counts: ``records`` (in the file), ``generated`` (this call), ``resumed`` (found on
    disk), ``prompts``, ``mean_tokens`` and ``finish/stop``, ``finish/length``.
    """
    out = Path(out)
    records_in = [p if isinstance(p, dict) else {"prompt": p} for p in prompts]
    texts = [prompt_template.format(prompt=r["prompt"]) if isinstance(r["prompt"], str) else r["prompt"]
             for r in records_in]
    settings = {"prompts": len(texts), "prompts_sha": prompts_digest(texts), "n": params.n,
                "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "max_new_tokens": params.max_new_tokens, "greedy": params.greedy, "seed": params.seed,
                "chat": chat, **(meta or {})}
    _check_meta(out, settings, resume)
    journal = journal_path(out)
    if not resume:
        for stale in (journal, out):
            stale.unlink(missing_ok=True)
    elif out != journal and out.exists() and not journal.exists():
        write_records(journal, read_corpus(out))  # a finished parquet: its records seed the journal
    existing = recover_journal(journal)
    done = {(r["prompt_id"], r["sample"]) for r in existing}
    pending = _pending(done, len(texts), params.n)
    generated = _run_chunks(engine, tokenizer, records_in, texts, pending, journal, params, chat=chat,
                            per_call=max(1, batch_size // params.n), progress=progress,
                            already=len(texts) - len(pending))
    records = recover_journal(journal)
    if out != journal:
        write_records(out, sorted(records, key=lambda r: (r["prompt_id"], r["sample"])))
        journal.unlink()
    return corpus_stats(records) | {"generated": generated, "resumed": len(existing)}


def _run_chunks(engine: GenerationEngine, tokenizer: Any, records_in: list[dict], texts: list[Any],
                pending: list[tuple[int, list[int]]], journal: Path, params: SamplingParams, *, chat: bool,
                per_call: int, progress: bool, already: int) -> int:
    """Generate every pending chunk, appending + fsync-ing its records; returns how many were written."""
    journal.parent.mkdir(parents=True, exist_ok=True)
    written, start = 0, time.perf_counter()
    with open(journal, "a") as f, _progress(progress) as bar:
        task = bar.add_task("generate", total=len(texts), completed=already, rate=0.0)
        for chunk in _chunks(pending, per_call):
            ids = tokenize_prompts([texts[pid] for pid, _ in chunk], tokenizer, chat=chat)
            seed = None if params.seed is None else params.seed + chunk[0][0]
            rollout = engine.generate(ids, SamplingParams(**{**vars(params), "seed": seed}))
            lines = []
            for i in range(len(rollout)):
                pid, missing = chunk[rollout.prompt_index[i]]
                sample = i % params.n
                if sample not in missing:  # a half-written prompt regenerates all n, keeps the missing ones
                    continue
                extra = {k: v for k, v in records_in[pid].items() if k not in CORPUS_FIELDS}
                lines.append(json.dumps({**extra, "prompt_id": pid, "sample": sample, "prompt": texts[pid],
                                         "completion": rollout.texts[i], "tokens": len(rollout.completion_ids[i]),
                                         "finish_reason": rollout.finish_reasons[i]}) + "\n")
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
            written += len(lines)
            bar.update(task, advance=len(chunk), rate=written / max(time.perf_counter() - start, 1e-9))
    return written


def corpus_stats(records: Sequence[dict]) -> dict[str, float]:
    """Counts of a corpus: records, prompts, mean completion tokens, finish reasons."""
    n = max(len(records), 1)
    stats: dict[str, float] = {"records": len(records), "prompts": len({r["prompt_id"] for r in records}),
                               "mean_tokens": sum(r["tokens"] for r in records) / n}
    for reason in ("stop", "length"):
        stats[f"finish/{reason}"] = sum(r["finish_reason"] == reason for r in records)
    return stats


def generate_file(model: Any, prompts_path: str | Path, out: str | Path, *, n: int = 1, temperature: float = 1.0,
                  top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 128, greedy: bool = False,
                  seed: int | None = None, chat: bool = False, batch_size: int = 64,
                  prompt_template: str = "{prompt}", resume: bool = True, engine: str = "local",
                  tokenizer: Any = None, base_url: str | None = None, api_key_env: str | None = None,
                  progress: bool = True) -> dict[str, float]:
    """Generate ``n`` samples per prompt of a prompts file into ``out``; see :func:`generate_corpus`."""
    records = read_prompt_records(prompts_path)
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                            max_new_tokens=max_new_tokens, greedy=greedy, seed=seed)
    gen, tok = make_engine(engine, model, tokenizer=tokenizer, base_url=base_url, api_key_env=api_key_env,
                           batch_size=batch_size if engine == "local" else None)
    return generate_corpus(gen, tok, records, out, params, chat=chat, prompt_template=prompt_template,
                           batch_size=batch_size, resume=resume, progress=progress,
                           meta={"model": str(model), "engine": engine})
