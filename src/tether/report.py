"""Run reports: ``RUN_DIR/report.html``, one self-contained page of plots, figures and samples.

The report only reads what a run directory already holds -- ``metrics.jsonl``, ``results.json``,
``STAGE/samples.jsonl`` and any ``*.png`` at its top level (e.g. ``overoptimization.png``) -- and
writes ``report.html`` plus the same plots as files under ``plots/``. The page references nothing
outside itself: images are base64 ``data:`` URIs and the CSS is inline, so it opens offline, as an
e-mail attachment or from an archived run.

Plots: per stage, one small-multiple figure per metric prefix (``policy/``, ``reward/``, ``eval/``;
metrics without a prefix form the ``train`` group), each metric against step. Values that are not
finite numbers (``null`` for NaN in ``metrics.jsonl``, strings, booleans) are skipped. When a stage
logs a gold reward, a proxy (reward-model) reward and the KL to the reference, both rewards are also
plotted against KL, the picture of Gao, Schulman and Hilton 2022.
"""

from __future__ import annotations

import base64
import html
import io
import json
import logging
import math
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tether.data.files import write_text_atomic

log = logging.getLogger(__name__)

REPORT_FILE = "report.html"
PLOTS_DIR = "plots"
# Names the trainers log these under; the first one present is used.
GOLD_KEYS = ("reward/gold", "reward/gold/mean", "gold")
PROXY_KEYS = ("reward/proxy", "reward/proxy/mean", "proxy")
KL_KEYS = ("kl", "policy/kl", "kl/mean")
NOT_METRICS = frozenset({"stage", "step", "time"})
DEFAULT_GROUP = "train"
MAX_PANELS = 16  # per figure; a larger group is split over several figures
SAMPLES_PER_STEP = 8
DPI = 90

Series = dict[float, float]  # step -> value
StageMetrics = dict[str, Series]  # metric name -> series


@dataclass(frozen=True)
class Plot:
    """One rendered figure: its caption, its file name under ``plots/`` and its PNG bytes."""

    title: str
    filename: str
    png: bytes


# ---- reading the run directory ---------------------------------------------------------------------
def read_jsonl(path: Path) -> tuple[list[dict], int]:
    """The JSON objects of a jsonl file and the count of lines that were not one (a run killed
    mid-write can leave a torn last line; the report shows the rest)."""
    if not path.exists():
        return [], 0
    rows, bad = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


def as_number(value: Any) -> float | None:
    """``value`` as a finite float, or None for NaN / inf / null / strings / booleans."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def stage_metrics(rows: Iterable[dict]) -> dict[str, StageMetrics]:
    """Numeric series per stage and metric, stages in the order they first logged. A step logged
    twice (a stage resumed from a checkpoint re-logs the steps after it) keeps its last value."""
    out: dict[str, StageMetrics] = {}
    for row in rows:
        step = as_number(row.get("step"))
        if step is None:
            continue
        metrics = out.setdefault(str(row.get("stage", "?")), {})
        for key, value in row.items():
            number = as_number(value)
            if key not in NOT_METRICS and number is not None:
                metrics.setdefault(key, {})[step] = number
    return out


def read_results(run_dir: Path) -> dict[str, dict]:
    """``results.json`` (figures keyed by stage), or ``{}`` when missing or unreadable."""
    path = run_dir / "results.json"
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError:
        log.warning("%s is not valid JSON; the report has no results table", path.name)
        return {}
    return {str(k): v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


def read_samples(stage_dir: Path) -> list[dict]:
    """Samples of a stage's first and last sampled steps (``write_samples``), to compare the two."""
    rows, _ = read_jsonl(stage_dir / "samples.jsonl")
    steps = sorted({r.get("step") for r in rows if as_number(r.get("step")) is not None})
    keep = {steps[0], steps[-1]} if steps else set()
    picked: list[dict] = []
    for step in sorted(keep):
        picked += [r for r in rows if r.get("step") == step][:SAMPLES_PER_STEP]
    return picked


def run_title(run_dir: Path, config_file: str = "config.yaml") -> tuple[str, str]:
    """Name and description of the recipe from ``config.yaml``, else the folder's name."""
    try:
        config = yaml.safe_load((run_dir / config_file).read_text())
    except (OSError, yaml.YAMLError):
        config = None
    config = config if isinstance(config, dict) else {}
    return str(config.get("name") or run_dir.resolve().name), str(config.get("description") or "")


# ---- plots -----------------------------------------------------------------------------------------
def group_metrics(metrics: StageMetrics) -> dict[str, StageMetrics]:
    """Metrics grouped by prefix (``reward/mean`` -> ``reward``); ``train`` and ``eval`` first."""
    groups: dict[str, StageMetrics] = {}
    for key in sorted(metrics):
        prefix = key.split("/", 1)[0] if "/" in key else DEFAULT_GROUP
        groups.setdefault(prefix, {})[key] = metrics[key]
    order = {DEFAULT_GROUP: 0, "eval": 1}
    return dict(sorted(groups.items(), key=lambda item: (order.get(item[0], 2), item[0])))


def _new_figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # A bare Figure on the Agg canvas: no pyplot, no global backend switch, no display needed.
    # Fixed margins rather than a layout engine: constrained layout took 2-3x longer per figure.
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    # No "Software" text chunk: it holds matplotlib's web address, and the page carries no URL.
    fig.savefig(buffer, format="png", metadata={"Software": None})
    return buffer.getvalue()


def _draw_series(ax: Any, name: str, lines: dict[str, Series]) -> None:
    """One panel: a line per run (per seed in a report over seeds, labelled), value against step."""
    for label, series in lines.items():
        steps = sorted(series)
        ax.plot(steps, [series[s] for s in steps], lw=1.2, marker="o" if len(steps) <= 30 else None, ms=3,
                label=label or None, alpha=0.85 if len(lines) > 1 else 1.0)
    if len(lines) > 1:
        ax.legend(fontsize=6)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def small_multiples(title: str, panels: dict[str, dict[str, Series]]) -> bytes:
    """One panel per metric against step (each holding one line per run), four panels a row."""
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    height = 2.4 * rows + 0.5
    fig = _new_figure(3.2 * cols, height)
    fig.subplots_adjust(left=0.8 / (3.2 * cols), right=0.98, bottom=0.55 / height, top=1 - 0.75 / height,
                        wspace=0.4, hspace=0.6)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (name, lines) in zip(axes, panels.items(), strict=False):
        _draw_series(ax, name, lines)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title)
    return _png(fig)


def _first_present(metrics: StageMetrics, names: tuple[str, ...]) -> Series | None:
    return next((metrics[n] for n in names if metrics.get(n)), None)


def gold_proxy_kl(title: str, metrics: StageMetrics) -> bytes | None:
    """Gold and proxy reward against KL to the reference (their own y axes: the RM's scale is
    arbitrary), or None when the stage does not log all three."""
    gold, proxy, kl = (_first_present(metrics, keys) for keys in (GOLD_KEYS, PROXY_KEYS, KL_KEYS))
    if gold is None or proxy is None or kl is None:
        return None
    fig = _new_figure(6.0, 4.0)
    fig.subplots_adjust(left=0.12, right=0.86, bottom=0.13, top=0.88)
    ax = fig.subplots()
    right = ax.twinx()
    for axis, series, label, colour in ((ax, gold, "gold reward", "tab:green"),
                                        (right, proxy, "proxy (RM) reward", "tab:blue")):
        points = sorted((kl[s], series[s]) for s in series if s in kl)
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, lw=1, color=colour)
        axis.set_ylabel(label, color=colour)
    ax.set_xlabel("KL to reference")
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    return _png(fig)


def safe_name(text: str) -> str:
    """``text`` usable as a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("._") or "x"


def stage_plots(stage: str, runs: dict[str, StageMetrics]) -> list[Plot]:
    """Every figure of one stage: a small-multiple figure per group with one line per run (``runs``:
    label -> metrics; one unlabelled run for a plain report), then gold/proxy vs KL for a single run."""
    names = {name: {} for metrics in runs.values() for name in metrics}
    plots = []
    for group, members in group_metrics(names).items():
        names_in_group = list(members)
        chunks = [names_in_group[i:i + MAX_PANELS] for i in range(0, len(names_in_group), MAX_PANELS)]
        for i, chunk in enumerate(chunks):
            part = f" ({i + 1}/{len(chunks)})" if len(chunks) > 1 else ""
            suffix = f"-{i + 1}" if len(chunks) > 1 else ""
            title = f"{stage}: {group}{part}"
            panels = {n: {label: m[n] for label, m in runs.items() if m.get(n)} for n in chunk}
            plots.append(Plot(title, f"{safe_name(stage)}-{safe_name(group)}{suffix}.png",
                              small_multiples(title, panels)))
    title = f"{stage}: gold and proxy reward against KL"
    png = gold_proxy_kl(title, next(iter(runs.values()))) if len(runs) == 1 else None
    if png is not None:
        plots.append(Plot(title, f"{safe_name(stage)}-gold-proxy-kl.png", png))
    return plots


# ---- HTML ------------------------------------------------------------------------------------------
CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1400px; padding: 0 1em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2em; margin-top: 2em; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.text { font-family: ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; max-width: 50em; }
figure { margin: 1em 0; } figcaption { color: #555; font-size: 0.9em; }
img { max-width: 100%; height: auto; } .note { color: #8a5a00; } .muted { color: #666; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def fmt(value: Any) -> str:
    """A figure for a table cell: numbers to four significant digits, anything else as text."""
    number = as_number(value)
    if number is None:
        return json.dumps(value) if isinstance(value, dict | list) else str(value)
    return str(int(number)) if isinstance(value, int) else f"{number:.4g}"


def _cell(value: Any) -> str:
    numeric = as_number(value) is not None
    return f'<td class="{"num" if numeric else "text"}">{_e(fmt(value))}</td>'


def figure_html(alt: str, png: bytes, caption: str = "") -> str:
    """An image embedded as a data URI (our plots carry their title; others get a caption)."""
    data = base64.b64encode(png).decode("ascii")
    caption = f"<figcaption>{_e(caption)}</figcaption>" if caption else ""
    return f'<figure><img alt="{_e(alt)}" src="data:image/png;base64,{data}">{caption}</figure>'


def results_html(results: dict[str, dict]) -> str:
    """Final evaluation figures: one row per figure, one column per stage that has any."""
    stages = [s for s, figures in results.items() if figures]
    if not stages:
        return '<p class="muted">No evaluation figures (results.json is missing or empty).</p>'
    names = list(dict.fromkeys(k for s in stages for k in results[s]))
    head = "".join(f"<th>{_e(s)}</th>" for s in stages)
    body = "".join(
        f"<tr><th>{_e(n)}</th>" + "".join(_cell(results[s][n]) if n in results[s] else "<td>–</td>"
                                          for s in stages) + "</tr>" for n in names)
    return f'<table class="results"><tr><th>figure</th>{head}</tr>{body}</table>'


def samples_html(samples: list[dict]) -> str:
    """Sample completions with their rewards (and whatever else was logged with them)."""
    if not samples:
        return ""
    first = ["step", "prompt", "completion", "reward"]
    columns = [c for c in first if any(c in s for s in samples)]
    columns += [c for c in dict.fromkeys(k for s in samples for k in s) if c not in columns]
    head = "".join(f"<th>{_e(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(_cell(s[c]) if c in s else "<td></td>" for c in columns) + "</tr>"
                   for s in samples)
    return f'<h3>Samples</h3><table class="samples"><tr>{head}</tr>{body}</table>'


def stage_html(stage: str, plots: list[Plot], samples: list[dict]) -> str:
    parts = [f'<h2 id="stage-{_e(safe_name(stage))}">{_e(stage)}</h2>']
    parts += [figure_html(p.title, p.png) for p in plots]
    if not plots:
        parts.append('<p class="muted">No numeric metrics logged for this stage.</p>')
    parts.append(samples_html(samples))
    return "\n".join(parts)


def page_html(title: str, description: str, body: list[str]) -> str:
    generated = time.strftime("%Y-%m-%d %H:%M:%S")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>tether report: {_e(title)}</title><style>{CSS}</style></head><body>\n"
            f"<h1>tether report: {_e(title)}</h1><p class=\"muted\">{_e(description)}</p>\n"
            + "\n".join(body)
            + f'\n<p class="muted">Written by tether on {generated}.</p>\n</body></html>\n')


# ---- the report ------------------------------------------------------------------------------------
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


def _extra_images(run_dir: Path) -> str:
    """PNGs the run saved at its top level (e.g. the over-optimisation plot), embedded as they are."""
    images = sorted(run_dir.glob("*.png"))
    if not images:
        return ""
    return "<h2>Other plots</h2>\n" + "\n".join(figure_html(p.name, p.read_bytes(), p.name) for p in images)


def seeds_html(aggregated: dict[str, dict]) -> str:
    """Every figure over seeds: mean +- std, the 95% interval of the mean, the number of seeds, the values."""
    rows = [f"<tr><th>{_e(stage)}</th><th>{_e(name)}</th><td class=\"num\">{s['mean']:.4g} &plusmn; {s['std']:.2g}"
            f"</td><td class=\"num\">[{s['ci95'][0]:.4g}, {s['ci95'][1]:.4g}]</td><td class=\"num\">{s['n']}</td>"
            f"<td class=\"num\">{_e(' '.join(f'{v:.4g}' for v in s['values']))}</td></tr>"
            for stage, figures in aggregated.items() for name, s in figures.items()
            if isinstance(s, dict) and {"mean", "std", "ci95", "n", "values"} <= set(s)
            and not name.endswith(("_ci95_low", "_ci95_high"))]
    if not rows:
        return '<p class="muted">No figures over seeds yet (results.json is missing or empty).</p>'
    head = "<tr><th>stage</th><th>figure</th><th>mean &plusmn; std</th><th>95% interval</th><th>seeds</th>" \
           "<th>values</th></tr>"
    return f'<table class="results">{head}{"".join(rows)}</table>'


def headline_plot(aggregated: dict[str, dict], key: str) -> bytes | None:
    """``key`` (e.g. accuracy) per stage: each seed a dot, the mean with its 95% interval as an error bar."""
    stages = [s for s, figures in aggregated.items() if isinstance(figures.get(key), dict)]
    if not stages:
        return None
    fig = _new_figure(max(4.0, 1.3 * len(stages) + 1.5), 3.2)
    ax = fig.subplots()
    for x, stage in enumerate(stages):
        summary = aggregated[stage][key]
        ax.plot([x] * len(summary["values"]), summary["values"], "o", color="#999", ms=4)
        ax.errorbar([x + 0.15], [summary["mean"]], yerr=[[summary["mean"] - summary["ci95"][0]],
                                                          [summary["ci95"][1] - summary["mean"]]],
                    fmt="s", color="#c0392b", capsize=4, ms=5)
    ax.set_xticks(range(len(stages)), stages, fontsize=8)
    ax.set_ylabel(key, fontsize=8)
    ax.set_title(f"{key}: seeds (grey) and mean with 95% interval (red)", fontsize=9)
    ax.grid(alpha=0.3)
    return _png(fig)


def comparison_png(run_dirs: Sequence[Path], stages: Sequence[str], keys: Sequence[str], title: str) -> bytes | None:
    """One panel per metric, one line per stage: the stage's value against step, averaged over the runs
    (seeds) that logged it at that step; None when no stage logged any of the metrics."""
    runs = [stage_metrics(read_jsonl(Path(d) / "metrics.jsonl")[0]) for d in run_dirs]
    panels: dict[str, dict[str, Series]] = {}
    for key in keys:
        for stage in stages:
            series = [run.get(stage, {}).get(key, {}) for run in runs]
            steps = sorted(set().union(*series))
            mean = {step: sum(s[step] for s in series if step in s) / sum(step in s for s in series) for step in steps}
            if mean:
                panels.setdefault(key, {})[stage] = mean
    if not panels:
        return None
    label = f" (mean of {len(runs)} runs)" if len(runs) > 1 else ""
    return small_multiples(title + label, panels)


def _comparisons(run_dir: Path, seeds: Sequence[int]) -> list[str]:
    """The across-seed plots of the recipe's ``compare`` stages (their spec is in the first seed's stage.json),
    written to ``run_dir/<file>``."""
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
            out.append(figure_html(spec["stage"], png, f"{spec['file']}: mean over seeds"))
    return out


def write_seeds_report(run_dir: Path) -> Path:
    """The report of ``tether run --seeds``: the across-seed table, the headline figures per seed with their
    mean and interval, and every stage's curves with one line per seed."""
    seeds = json.loads((run_dir / "seeds.json").read_text()).get("seeds", [])
    aggregated = read_results(run_dir)
    runs = {f"seed {k}": stage_metrics(read_jsonl(run_dir / f"seed-{k}" / "metrics.jsonl")[0]) for k in seeds}
    plots_dir = _fresh_plots_dir(run_dir)
    body = [f'<p class="muted">{len(seeds)} seeds: {_e(", ".join(map(str, seeds)))}; each a run directory '
            "seed-K/ with its own report.</p>", "<h2>Across seeds</h2>", seeds_html(aggregated)]
    for key in ("accuracy", "gain/accuracy", "success"):
        png = headline_plot(aggregated, key)
        if png is not None:
            (plots_dir / f"seeds-{safe_name(key)}.png").write_bytes(png)
            body.append(figure_html(key, png))
    body.extend(_comparisons(run_dir, seeds))
    for stage in dict.fromkeys(stage for metrics in runs.values() for stage in metrics):
        plots = stage_plots(stage, {label: metrics.get(stage, {}) for label, metrics in runs.items()})
        for plot in plots:
            (plots_dir / plot.filename).write_bytes(plot.png)
        body.append(stage_html(stage, plots, []))
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
    plots_dir = _fresh_plots_dir(run_dir)
    body = [_metrics_note(run_dir, rows, bad), "<h2>Evaluation</h2>", results_html(results)]
    for stage in dict.fromkeys([*metrics, *results]):
        plots = stage_plots(stage, {"": metrics.get(stage, {})})
        samples = read_samples(run_dir / stage)
        for plot in plots:
            (plots_dir / plot.filename).write_bytes(plot.png)
        if plots or samples:
            body.append(stage_html(stage, plots, samples))
    body.append(_extra_images(run_dir))
    return write_text_atomic(run_dir / REPORT_FILE, page_html(*run_title(run_dir), body))
