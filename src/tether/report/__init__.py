"""Run reports: ``RUN_DIR/report.html``, one self-contained page that leads with the answer.

The report only reads what a run directory already holds -- ``metrics.jsonl``, ``results.json``,
``run.json``, ``config.yaml``, ``STAGE/stage.json``, ``STAGE/samples.jsonl``, ``STAGE/rewards.json`` and any
``*.png`` at its top level (e.g. ``overoptimization.png``) -- and writes ``report.html`` plus the same plots as files under
``plots/``. The page references nothing outside itself: images are base64 ``data:`` URIs and the CSS is
inline, so it opens offline, as an e-mail attachment or from an archived run.

Order: the answer (each stage's headline figures, before -> after with 95% intervals and the paired
gain; across seeds, mean +- std with the interval of the mean), the run facts (each stage's status and
wall time; each invocation's command, versions and tether commit), the resolved configuration, then
per stage its key curves (reward, held-out accuracy, KL, entropy, loss), the other metrics by prefix, the
histogram of every sample's reward at the first and the last training step (an RL stage's
``rewards.json``), the series that never moved folded into one line, and sample completions with their
rewards. When a stage logs a gold reward, a proxy (reward-model) reward and the KL to the reference, both
rewards are also plotted against KL, the picture of Gao, Schulman and Hilton 2022. ``tether report A B ...``
(:func:`write_comparison_report`) puts several runs on the same axes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tether.data.files import write_text_atomic
from tether.report.page import (
    _e,
    config_html,
    facts_html,
    figure_html,
    headline_html,
    page_html,
    results_html,
    samples_html,
    seeds_html,
    stage_html,
)
from tether.report.plots import Plot, comparison_png, headline_plot, reward_histogram, safe_name, stage_plots
from tether.report.read import (
    as_number,
    read_config_text,
    read_jsonl,
    read_results,
    read_rewards,
    read_run_facts,
    read_samples,
    run_title,
    stage_metrics,
    stage_seconds,
    stage_status,
)

__all__ = [
    "PLOTS_DIR",
    "REPORT_FILE",
    "Plot",
    "as_number",
    "comparison_png",
    "read_jsonl",
    "read_results",
    "safe_name",
    "samples_html",
    "stage_metrics",
    "write_comparison_report",
    "write_report",
    "write_seeds_report",
]

REPORT_FILE = "report.html"

PLOTS_DIR = "plots"


def _metrics_note(run_dir: Path, rows: list[dict], bad: int) -> str:
    path = run_dir / "metrics.jsonl"
    notes = []
    if not path.exists():
        notes.append("No metrics: metrics.jsonl is missing from the run directory, so there is nothing to plot.")
    elif not rows:
        notes.append("No metrics: metrics.jsonl is empty (or holds no readable records), so there is nothing "
                     "to plot.")
    if bad:
        notes.append(f"Skipped {bad} unreadable line(s) of metrics.jsonl.")
    return "".join(f'<p class="note">{_e(n)}</p>' for n in notes)

def _fresh_plots_dir(run_dir: Path) -> Path:
    plots_dir = run_dir / PLOTS_DIR
    plots_dir.mkdir(exist_ok=True)
    for old in plots_dir.glob("*.png"):  # from an earlier report of this run
        old.unlink()
    return plots_dir

def _extra_images(run_dir: Path, shown: Sequence[str] = ()) -> str:
    """PNGs the run saved at its top level (e.g. the over-optimisation plot), embedded as they are, except
    the files named in ``shown`` (already on the page)."""
    images = sorted(p for p in run_dir.glob("*.png") if p.name not in shown)
    if not images:
        return ""
    return "<h2>Other plots</h2>\n" + "\n".join(figure_html(p.name, p.read_bytes(), p.name) for p in images)

def _comparisons(run_dir: Path, seeds: Sequence[int]) -> list[tuple[str, str]]:
    """The across-seed plots of the recipe's ``compare`` stages (their spec is in the first seed's stage.json),
    written to ``run_dir/<file>``: (html, file name) each."""
    out = []
    first = run_dir / f"seed-{seeds[0]}" if seeds else run_dir
    for marker in sorted(first.glob("*/stage.json")):
        spec = json.loads(marker.read_text())
        if spec.get("type") != "compare":
            continue
        png = comparison_png([run_dir / f"seed-{k}" for k in seeds], spec["stages"], spec["metrics"],
                             spec.get("title") or spec["stage"])
        if png is not None:
            (run_dir / spec["file"]).write_bytes(png)
            out.append((figure_html(spec["stage"], png, f"{spec['file']}: mean +- std over seeds"), spec["file"]))
    return out


def _stage_sections(run_dir: Path | None, runs: dict[str, dict], plots_dir: Path, stages: Sequence[str]) -> list[str]:
    body = []
    for stage in stages:
        plots, flat = stage_plots(stage, {label: metrics.get(stage, {}) for label, metrics in runs.items()})
        samples = read_samples(run_dir / stage) if run_dir is not None else []
        title = f"{stage}: rewards of the first and last training steps"
        png = reward_histogram(title, read_rewards(run_dir / stage)) if run_dir is not None else None
        if png is not None:
            plots.append(Plot(title, f"{safe_name(stage)}-reward-histogram.png", png))
        for plot in plots:
            (plots_dir / plot.filename).write_bytes(plot.png)
        if plots or samples or flat:
            body.append(stage_html(stage, plots, samples, flat))
    return body


def write_seeds_report(run_dir: Path) -> Path:
    """The report of ``tether run --seeds``: the headline figures across seeds first (mean +- std, the
    interval of the mean, each seed's value), then every figure, the per-seed plots of the headline
    figures, the recipe's comparisons and every stage's curves with one line per seed."""
    seeds = json.loads((run_dir / "seeds.json").read_text()).get("seeds", [])
    aggregated = read_results(run_dir)
    headline = {stage: {k: v for k, v in figures.items()
                        if k.split("/")[-1] in ("accuracy", "success", "violation_rate", "helpfulness",
                                                "pairwise_accuracy", "implicit_accuracy", "gold")
                        or (k.startswith("gain/") and not k.endswith(("_ci95_low", "_ci95_high")))}
                for stage, figures in aggregated.items()}
    runs = {f"seed {k}": stage_metrics(read_jsonl(run_dir / f"seed-{k}" / "metrics.jsonl")[0]) for k in seeds}
    plots_dir = _fresh_plots_dir(run_dir)
    body = [f'<p class="muted">{len(seeds)} seeds: {_e(", ".join(map(str, seeds)))}; each a run directory '
            "seed-K/ with its own report (run facts, configuration, samples).</p>",
            "<h2>The answer, across seeds</h2>", seeds_html(headline),
            "<details><summary>every figure across seeds</summary>", seeds_html(aggregated), "</details>",
            config_html(read_config_text(run_dir))]
    for key in ("accuracy", "gain/accuracy", "success"):
        png = headline_plot(aggregated, key)
        if png is not None:
            (plots_dir / f"seeds-{safe_name(key)}.png").write_bytes(png)
            body.append(figure_html(key, png))
    comparisons = _comparisons(run_dir, seeds)
    body.extend(html for html, _ in comparisons)
    body.append(_extra_images(run_dir, shown=[file for _, file in comparisons]))  # e.g. over-optimisation, over seeds
    body += _stage_sections(None, runs, plots_dir, list(dict.fromkeys(s for m in runs.values() for s in m)))
    return write_text_atomic(run_dir / REPORT_FILE, page_html(*run_title(run_dir, "recipe.yaml"), body))


def write_report(run_dir: str | Path) -> Path:
    """Write ``RUN_DIR/report.html`` (and ``RUN_DIR/plots/*.png``); returns the report's path. The folder of
    a run over seeds (``seeds.json`` in it) gets :func:`write_seeds_report`.

    Works on a finished, running or interrupted run; a missing or empty ``metrics.jsonl`` gives a
    report that says so. Raises FileNotFoundError when ``run_dir`` is not a directory.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run directory {str(run_dir)!r}")
    if (run_dir / "seeds.json").exists():
        return write_seeds_report(run_dir)
    rows, bad = read_jsonl(run_dir / "metrics.jsonl")
    metrics, results = stage_metrics(rows), read_results(run_dir)
    stages = list(dict.fromkeys([*metrics, *results]))
    plots_dir = _fresh_plots_dir(run_dir)
    facts = read_run_facts(run_dir)
    body = [_metrics_note(run_dir, rows, bad), "<h2>The answer</h2>", headline_html(results),
            "<h2>The run</h2>", facts_html({s: stage_status(run_dir / s) for s in stages},
                                           stage_seconds(facts, rows), facts),
            config_html(read_config_text(run_dir)),
            "<details><summary>every held-out figure</summary>", results_html(results), "</details>"]
    body += _stage_sections(run_dir, {"": metrics}, plots_dir, stages)
    body.append(_extra_images(run_dir))
    return write_text_atomic(run_dir / REPORT_FILE, page_html(*run_title(run_dir), body))


def write_comparison_report(run_dirs: Sequence[str | Path], out: str | Path) -> Path:
    """``tether report A B ...``: several runs on one page: their headline figures side by side, then every
    stage they share with one line per run on the same axes. Runs are labelled by their folder names."""
    dirs = [Path(d) for d in run_dirs]
    for d in dirs:
        if not d.is_dir():
            raise FileNotFoundError(f"no run directory {str(d)!r}")
    labels = [d.name if [x.name for x in dirs].count(d.name) == 1 else str(d) for d in dirs]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plots_dir = out.parent / f"{out.stem}-plots"
    plots_dir.mkdir(exist_ok=True)
    body = [f'<p class="muted">{len(dirs)} runs: {_e(", ".join(labels))}.</p>', "<h2>The answer, run by run</h2>"]
    for label, d in zip(labels, dirs, strict=True):
        body += [f"<h3>{_e(label)}</h3>", headline_html(read_results(d))]
    runs = {label: stage_metrics(read_jsonl(d / "metrics.jsonl")[0]) for label, d in zip(labels, dirs, strict=True)}
    shared = [s for s in dict.fromkeys(s for m in runs.values() for s in m) if sum(s in m for m in runs.values()) > 1]
    body += _stage_sections(None, runs, plots_dir, shared)
    return write_text_atomic(out, page_html("comparison of " + ", ".join(labels), "", body))
