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
an independent best-of-n draw, so the estimate is unbiased. ``tokens/best_of_<n>`` is the mean number
of sampled tokens in a block: the generation compute of one best-of-n answer.

Step-level search (``searches``, :mod:`tether.rollout.step_search`) runs on the same problems at each n
with ``beam_width x expansions = n`` candidates a round: ``search_<n>/<label>`` is its accuracy and
``tokens/search_<n>/<label>`` its sampled tokens per problem, so the methods compare at matched compute.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich import get_console

from tether.config.common import EvalConfig, ModelConfig
from tether.config.distill import SearchConfig
from tether.data import tokenize_prompts
from tether.filtering import prompt_key
from tether.generation import generate_corpus, generate_file, read_corpus, write_records
from tether.models.loading import resolve_model
from tether.rewards.scorer import RewardModelScorer
from tether.rollout import HFEngine, SamplingParams
from tether.rollout.step_search import EngineStepProposer, SearchResult, prm_beam_search, prm_prefix_scorer
from tether.runtime.progress import ProgressLines
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


def block_tokens(tokens: Sequence[Sequence[int]], ns: Sequence[int]) -> dict[int, float]:
    """Mean sampled tokens of a best-of-n block (the blocks of :func:`best_of_n_curve`) for each n."""
    out = {}
    for n in ns:
        sums = [sum(row[start:start + n]) for row in tokens for start in range(0, len(row) - n + 1, n)]
        out[n] = sum(sums) / max(len(sums), 1)
    return out


def _grid(records: Sequence[dict], values: Sequence[Any], prompts: int, samples: int) -> list[list[Any]]:
    grid: list[list[Any]] = [[None] * samples for _ in range(prompts)]
    for record, value in zip(records, values, strict=True):
        grid[record["prompt_id"]][record["sample"]] = value
    return grid


def evaluate_best_of_n(model: Any, tokenizer: Any, cfg: EvalConfig, ns: Sequence[int], scorers: dict[str, RecordScorer],
                       *, corpus: str | Path | None = None, progress: bool = True,
                       searches: dict[str, SearchConfig] | None = None) -> dict[str, float]:
    """Best-of-n accuracy on ``cfg.n`` held-out problems for each n in ``ns`` and each named scorer, and
    each named step-level search at every n.

    Samples ``max(ns)`` completions per problem at ``cfg.temperature`` (written, resumably, to
    ``corpus`` when given). Returns ``{"best_of_<n>/<scorer>": accuracy, "tokens/best_of_<n>": ...,
    "search_<n>/<search>": accuracy, "tokens/search_<n>/<search>": ..., "mean@<N>": ...}``.
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
    tokens = _grid(records, [r.get("tokens", 0) for r in records], len(prompts), samples)
    results.update({f"tokens/best_of_{n}": value for n, value in block_tokens(tokens, ns).items()})
    for label, scorer in scorers.items():
        curve = best_of_n_curve(right, _grid(records, scorer(records), len(prompts), samples), ns)
        results.update({f"best_of_{n}/{label}": acc for n, acc in curve.items()})
    for label, search in (searches or {}).items():
        prm = RewardModelScorer(search.prm, batch_size=search.batch_size, chat=cfg.chat)
        for n in ns:
            width, expansions = search.shape(n)
            lines = ProgressLines(f"search {label} n={n}", len(prompts), "problems", enabled=progress,
                                  console=get_console())
            found = search_answers(model, tokenizer, prompts, cfg, prm, beam_width=width, expansions=expansions,
                                   aggregation=search.aggregation, max_steps=search.max_steps,
                                   on_progress=lines.update)
            right_answers = [task.verify(r.text, p["answer"]) for r, p in zip(found, prompts, strict=True)]
            results[f"search_{n}/{label}"] = sum(right_answers) / len(found)
            results[f"tokens/search_{n}/{label}"] = sum(r.tokens for r in found) / len(found)
            results[f"finished/search_{n}/{label}"] = sum(r.finished for r in found) / len(found)
    return results


def search_answers(model: Any, tokenizer: Any, prompts: Sequence[dict], cfg: EvalConfig, prm: RewardModelScorer, *,
                   beam_width: int, expansions: int, aggregation: str = "last", max_steps: int = 16,
                   separator: str | None = None, on_progress: Callable[[int], None] | None = None
                   ) -> list[SearchResult]:
    """PRM-guided step-level beam search (:func:`~tether.rollout.step_search.prm_beam_search`) on ``prompts``
    (records with a ``prompt``), ``cfg.batch_size`` prompts at a time, sampled at ``cfg.temperature`` with
    at most ``cfg.max_new_tokens`` per trace, steps cut at the PRM's separator (or ``separator``).
    Deterministic given ``cfg.seed``: each batch of prompts is seeded ``cfg.seed + its first prompt``.
    ``on_progress(done)`` is called with the number of prompts searched after each batch."""
    if not prm.process:
        raise ValueError("PRM-guided search needs a process reward model (trained with process: true); "
                         "an outcome model scores whole answers only: use it as a best-of-n scorer")
    texts = [cfg.prompt_template.format(prompt=r["prompt"]) if isinstance(r["prompt"], str) else r["prompt"]
             for r in prompts]
    engine = HFEngine(model, tokenizer, batch_size=cfg.batch_size)
    results: list[SearchResult] = []
    for start in range(0, len(texts), cfg.batch_size):
        chunk = texts[start:start + cfg.batch_size]
        params = SamplingParams(temperature=cfg.temperature, seed=cfg.seed + start)
        propose = EngineStepProposer(engine, tokenizer, tokenize_prompts(chunk, tokenizer, chat=cfg.chat),
                                     separator or prm.step_separator, params)
        results += prm_beam_search(len(chunk), propose, prm_prefix_scorer(prm, chunk, aggregation),
                                   beam_width=beam_width, expansions=expansions, max_steps=max_steps,
                                   max_new_tokens=cfg.max_new_tokens)
        if on_progress is not None:
            on_progress(len(results))
    return results


HEADS = ("best_of_", "search_")


def curves(results: dict[str, float]) -> dict[str, dict[int, float]]:
    """Accuracy against n per method: ``{"best_of_4/rm": 0.5, "search_4/beam": 0.6}`` ->
    ``{"rm": {4: 0.5}, "beam": {4: 0.6}}``."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for key, value in results.items():
        head, _, label = key.partition("/")
        for prefix in HEADS:
            if head.startswith(prefix) and label:
                out[label][int(head[len(prefix):])] = value
    return dict(out)


def token_curves(results: dict[str, float]) -> dict[str, dict[int, float]]:
    """Sampled tokens per problem against n per method: a best-of-n scorer gets ``tokens/best_of_<n>``
    (the same samples for every scorer), a search its own ``tokens/search_<n>/<label>``."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for key in results:
        head, _, label = key.partition("/")
        if label and head.startswith("best_of_") and f"tokens/{head}" in results:
            out[label][int(head[len("best_of_"):])] = results[f"tokens/{head}"]
        elif label and head.startswith("search_") and f"tokens/{key}" in results:
            out[label][int(head[len("search_"):])] = results[f"tokens/{key}"]
    return dict(out)


def comparison_table(results: dict[str, float]) -> str:
    """A markdown table: one row per n, accuracy (and tokens per problem, where counted) per method."""
    acc, tokens = curves(results), token_curves(results)
    ns = sorted({n for curve in acc.values() for n in curve})
    lines = ["| n | " + " | ".join(acc) + " |", "|---" * (len(acc) + 1) + "|"]
    for n in ns:
        cells = []
        for label, curve in acc.items():
            cell = f"{100 * curve[n]:.1f}%" if n in curve else "-"
            if n in tokens.get(label, {}):
                cell += f" ({tokens[label][n]:.0f} tok)"
            cells.append(cell)
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_best_of_n(results: dict[str, float], path: str | Path, *, title: str = "best-of-n") -> Path:
    """Accuracy against n (log2 axis), one line per scorer or search, saved as a PNG; with token counts,
    a second panel has accuracy against sampled tokens per problem (compute matched on the x axis)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tokens = token_curves(results)
    fig = Figure(figsize=(10 if tokens else 5, 3.5))  # on the Agg canvas: no pyplot, no global backend switch
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2 if tokens else 1, squeeze=False)
    for label, curve in curves(results).items():
        ns = sorted(curve)
        line = axes[0, 0].plot(ns, [curve[n] for n in ns], marker="o", label=label)[0]
        if label in tokens:
            xs = sorted(n for n in tokens[label] if n in curve)
            axes[0, 1].plot([tokens[label][n] for n in xs], [curve[n] for n in xs], marker="o", label=label,
                            color=line.get_color())
    axes[0, 0].set_xlabel("n (samples, or beam width x expansions)")
    axes[0, 0].set_title(title)
    if tokens:
        axes[0, 1].set_xlabel("sampled tokens per problem")
        axes[0, 1].set_title("accuracy against generation compute")
    for ax in axes[0]:
        ax.set_xscale("log", base=2)
        ax.set_ylabel("held-out accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def run_best_of_n(model: Any, cfg: EvalConfig, ns: Sequence[int], scorers: dict[str, Any], *,
                  tokenizer: Any = None, corpus: str | Path | None = None, plot: str | Path | None = None,
                  progress: bool = True, defaults: dict[str, Any] | None = None,
                  searches: dict[str, SearchConfig | dict] | None = None,
                  table: str | Path | None = None) -> dict[str, float]:
    """:func:`evaluate_best_of_n` from a model path (or loaded model + ``tokenizer``), scorer configs
    (:class:`~tether.config.ScorerConfig` or dicts, or ready scorer functions) and search configs
    (:class:`~tether.config.distill.SearchConfig` or dicts), with a plot and a markdown table if asked.
    ``defaults``: options for the task-aware reward functions of the scorers it builds (a stage's task)."""
    model, tokenizer = resolve_model(model, tokenizer, ModelConfig())
    model.eval()
    built = {label: build_scorer(spec, defaults=defaults) for label, spec in scorers.items()}
    specs = {label: s if isinstance(s, SearchConfig) else SearchConfig.model_validate(s)
             for label, s in (searches or {}).items()}
    for search in specs.values():
        for n in ns:
            search.shape(n)
    results = evaluate_best_of_n(model, tokenizer, cfg, ns, built, corpus=corpus, progress=progress, searches=specs)
    if plot is not None:
        plot_best_of_n(results, plot, title=f"best-of-n, {cfg.task}")
    if table is not None:
        Path(table).parent.mkdir(parents=True, exist_ok=True)
        Path(table).write_text(comparison_table(results))
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
