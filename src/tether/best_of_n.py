"""Best-of-n: sample n completions, keep the one a scorer ranks highest.

With a perfect checker as the scorer, best-of-n accuracy is pass@n; with a learned reward model
it is what the model can reach at inference with that verifier (Cobbe et al. 2021, "Training
Verifiers to Solve Math Word Problems"; Nakano et al. 2021, WebGPT's rejection sampling), and
the gap between the two curves is the reward model's ranking error.

How the curve is estimated: ``N = max(ns)`` samples are drawn once per held-out prompt; for each
``n`` they are cut into ``N // n`` disjoint blocks of ``n`` consecutive samples, the best of each
block (by score; ties go to the earlier sample, unscored samples rank last) is checked against the
task's verifier, and accuracy is the mean over prompts and blocks. Every n thus uses all N
samples, which lowers the variance of the small-n points at no extra generation; each block is
an independent best-of-n draw, so the estimate is unbiased.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tether.config.common import EvalConfig, ModelConfig
from tether.filtering import prompt_key
from tether.generation import generate_corpus, generate_file, read_corpus, write_records
from tether.models.loading import resolve_model
from tether.rollout import HFEngine, SamplingParams
from tether.scoring import RecordScorer, build_scorer
from tether.tasks import eval_records, get_task


def _rank_key(score: float | None) -> float:
    return float("-inf") if score is None else score


def best_index(scores: Sequence[float | None]) -> int:
    """Position of the highest score; ties go to the earliest, None ranks below every number."""
    return max(range(len(scores)), key=lambda i: (_rank_key(scores[i]), -i))


def select_best(records: Sequence[dict], scores: Sequence[float | None]) -> list[dict]:
    """The top-scored record of each prompt (``prompt_id``, else the prompt text), in prompt order,
    with its ``score`` and the number of candidates ``best_of``."""
    groups: dict[Any, list[int]] = defaultdict(list)
    for i, record in enumerate(records):
        groups[prompt_key(record)].append(i)
    out = []
    for members in groups.values():
        members.sort(key=lambda i: records[i].get("sample", 0))
        best = members[best_index([scores[i] for i in members])]
        out.append({**records[best], "score": scores[best], "best_of": len(members)})
    return out


def best_of_n_curve(correct: Sequence[Sequence[float]], scores: Sequence[Sequence[float | None]],
                    ns: Sequence[int]) -> dict[int, float]:
    """Best-of-n accuracy for each n in ``ns`` from ``correct[p][s]`` and ``scores[p][s]`` (P prompts x N
    samples), over disjoint blocks of n samples (see the module docstring)."""
    total = len(correct[0]) if correct else 0
    curve = {}
    for n in ns:
        if not 1 <= n <= total:
            raise ValueError(f"best-of-{n} needs 1 <= n <= {total} samples per prompt")
        hits = []
        for right, score in zip(correct, scores, strict=True):
            for start in range(0, total - n + 1, n):
                hits.append(float(right[start + best_index(score[start:start + n])]))
        curve[n] = sum(hits) / len(hits)
    return curve


def _grid(records: Sequence[dict], values: Sequence[Any], prompts: int, samples: int) -> list[list[Any]]:
    grid: list[list[Any]] = [[None] * samples for _ in range(prompts)]
    for record, value in zip(records, values, strict=True):
        grid[record["prompt_id"]][record["sample"]] = value
    return grid


def evaluate_best_of_n(model: Any, tokenizer: Any, cfg: EvalConfig, ns: Sequence[int], scorers: dict[str, RecordScorer],
                       *, corpus: str | Path | None = None, progress: bool = True) -> dict[str, float]:
    """Best-of-n accuracy on ``cfg.n`` held-out problems for each n in ``ns`` and each named scorer.

    Samples ``max(ns)`` completions per problem at ``cfg.temperature`` (written, resumably, to
    ``corpus`` when given). Returns ``{"best_of_<n>/<scorer>": accuracy, "mean@<N>": ...}``.
    """
    ns = sorted(set(ns))
    samples = ns[-1]
    task = get_task(cfg.task, **cfg.options)
    prompts = eval_records(task, cfg.n, seed=cfg.seed)
    params = SamplingParams(n=samples, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                            seed=cfg.seed)
    engine = HFEngine(model, tokenizer, batch_size=cfg.batch_size)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(corpus) if corpus else Path(tmp) / "samples.jsonl"
        generate_corpus(engine, tokenizer, prompts, path, params, chat=cfg.chat, prompt_template=cfg.prompt_template,
                        batch_size=cfg.batch_size * 4, progress=progress)
        records = read_corpus(path)
    correct = [task.verify(r["completion"], r["answer"]) for r in records]
    right = _grid(records, correct, len(prompts), samples)
    results: dict[str, float] = {f"mean@{samples}": sum(correct) / len(correct)}
    for label, scorer in scorers.items():
        curve = best_of_n_curve(right, _grid(records, scorer(records), len(prompts), samples), ns)
        results.update({f"best_of_{n}/{label}": acc for n, acc in curve.items()})
    return results


def curves(results: dict[str, float]) -> dict[str, dict[int, float]]:
    """``{"best_of_4/rm": 0.5}`` -> ``{"rm": {4: 0.5}}``."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for key, value in results.items():
        head, _, label = key.partition("/")
        if head.startswith("best_of_") and label:
            out[label][int(head[len("best_of_"):])] = value
    return dict(out)


def plot_best_of_n(results: dict[str, float], path: str | Path, *, title: str = "best-of-n") -> Path:
    """Accuracy against n (log2 axis), one line per scorer, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, curve in curves(results).items():
        ns = sorted(curve)
        ax.plot(ns, [curve[n] for n in ns], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("n (samples per problem)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_best_of_n(model: Any, cfg: EvalConfig, ns: Sequence[int], scorers: dict[str, Any], *,
                  tokenizer: Any = None, corpus: str | Path | None = None, plot: str | Path | None = None,
                  progress: bool = True, defaults: dict[str, Any] | None = None) -> dict[str, float]:
    """:func:`evaluate_best_of_n` from a model path (or loaded model + ``tokenizer``) and scorer configs
    (:class:`~tether.config.ScorerConfig` or dicts, or ready scorer functions), with a plot if asked.
    ``defaults``: options for the task-aware reward functions of the scorers it builds (a stage's task)."""
    model, tokenizer = resolve_model(model, tokenizer, ModelConfig())
    model.eval()
    built = {label: build_scorer(spec, defaults=defaults) for label, spec in scorers.items()}
    results = evaluate_best_of_n(model, tokenizer, cfg, ns, built, corpus=corpus, progress=progress)
    if plot is not None:
        plot_best_of_n(results, plot, title=f"best-of-n, {cfg.task}")
    return results


def generate_best_of_n(model: Any, prompts_path: str | Path, out: str | Path, n: int, scorer: Any,
                       **generate_options: Any) -> dict[str, float]:
    """``n`` samples per prompt (kept, resumably, in ``OUT.samples.jsonl``), scored; the top one per
    prompt goes to ``out`` with its ``score``. ``scorer``: a ScorerConfig / dict or a scorer function."""
    out = Path(out)
    samples_path = out.with_name(f"{out.stem}.samples.jsonl")
    stats = generate_file(model, prompts_path, samples_path, n=n, **generate_options)
    records = read_corpus(samples_path)
    score = build_scorer(scorer)
    best = select_best(records, score(records))
    write_records(out, best)
    scored = [b["score"] for b in best if b["score"] is not None]
    return {**stats, "selected": len(best), "mean_best_score": sum(scored) / max(len(scored), 1)}
