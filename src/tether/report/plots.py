"""The report's figures (matplotlib on the Agg canvas, no pyplot): key curves first, the rest by group."""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.core.statistics import seed_summary
from tether.report.read import Series, StageMetrics, is_flat, read_jsonl, stage_metrics

GOLD_KEYS = ("reward/gold", "reward/gold/mean", "gold")

PROXY_KEYS = ("reward/proxy", "reward/proxy/mean", "proxy")

KL_KEYS = ("kl", "policy/kl", "kl/mean")

DEFAULT_GROUP = "train"

MAX_PANELS = 16  # per figure; a larger group is split over several figures

DPI = 90
# The curves a reader looks at first, in this order: the first metric matching each pattern.
KEY_CURVES = (r"reward(/mean)?$", r"reward/[^/]+/mean$", r"eval/(accuracy|success|pass@\d+)$", r"(policy/)?kl(/mean)?$",
              r"(policy/)?entropy(/mean)?$", r"(train/)?loss$")


@dataclass(frozen=True)
class Plot:
    """One rendered figure: its caption, its file name under ``plots/``, its PNG bytes and, for the
    page's interactive version, the panels it was drawn from (metric -> label -> series)."""

    title: str
    filename: str
    png: bytes
    panels: dict[str, dict[str, Series]] | None = None


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

def _draw_series(ax: Any, name: str, lines: dict[str, Series], colours: dict[str, str] | None = None, *,
                 legend: bool = True, spreads: dict[str, Series] | None = None) -> None:
    """One panel: a line per run (per seed in a report over seeds, labelled), value against step. With
    ``colours`` (label -> colour, the same in every panel of a figure) every panel names its lines, unless
    ``legend`` is off (the figure has one legend for all panels). ``spreads`` (label -> step -> std) shades
    the line's value +- std at the steps it has one."""
    for label, series in lines.items():
        steps = sorted(series)
        drawn = ax.plot(steps, [series[s] for s in steps], lw=1.2, marker="o" if len(steps) <= 30 else None, ms=3,
                        label=label or None, alpha=0.85 if len(lines) > 1 else 1.0,
                        color=colours.get(label) if colours else None)
        spread = (spreads or {}).get(label) or {}
        shaded = [s for s in steps if s in spread]
        if shaded:
            ax.fill_between(shaded, [series[s] - spread[s] for s in shaded], [series[s] + spread[s] for s in shaded],
                            color=drawn[0].get_color(), alpha=0.15, lw=0)
    if legend and (len(lines) > 1 or (colours and len(colours) > 1 and any(lines))):
        ax.legend(fontsize=6)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)

MANY_LINES = 6  # more lines than this: one legend beside the panels instead of one in each


def small_multiples(title: str, panels: dict[str, dict[str, Series]],
                    spreads: dict[str, dict[str, Series]] | None = None) -> bytes:
    """One panel per metric against step (each holding one line per run), four panels a row; one colour per
    line in every panel (from a 20-colour palette past 10 lines), and past ``MANY_LINES`` lines one legend
    to the right of the panels. ``spreads`` (metric -> label -> step -> std): a shaded band around a line."""
    from matplotlib import colormaps, rcParams
    from matplotlib.lines import Line2D

    labels = list(dict.fromkeys(label for lines in panels.values() for label in lines))
    cycle = [c["color"] for c in rcParams["axes.prop_cycle"]]
    if len(labels) > len(cycle):
        cycle = list(colormaps["tab20"].colors)
    colours = {label: cycle[i % len(cycle)] for i, label in enumerate(labels)}  # one colour per line, every panel
    shared = len(labels) > MANY_LINES
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    height, legend_width = 2.4 * rows + 0.5, 1.5 if shared else 0.0
    width = 3.2 * cols + legend_width
    fig = _new_figure(width, height)
    fig.subplots_adjust(left=0.8 / width, right=1 - (0.02 * 3.2 * cols + legend_width) / width,
                        bottom=0.55 / height, top=1 - 0.75 / height, wspace=0.4, hspace=0.6)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (name, lines) in zip(axes, panels.items(), strict=False):
        _draw_series(ax, name, lines, colours, legend=not shared, spreads=(spreads or {}).get(name))
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    if shared:
        handles = [Line2D([], [], color=colours[label], lw=1.5, marker="o", ms=3) for label in labels]
        fig.legend(handles, labels, loc="center right", fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=min(12.0, 9.0 * width / max(len(title), 1) * 12))  # a long title shrinks to fit
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

def reward_histogram(title: str, rewards: dict[int, list[float]]) -> bytes | None:
    """The distribution of per-sample rewards at each given step (the stage's first and last, step ->
    rewards), overlaid on shared bins with each step's mean in its label; None when there are none."""
    if not rewards:
        return None
    values = [r for step in rewards.values() for r in step]
    low, high = min(values), max(values)
    bins = [low + (high - low) * i / 20 for i in range(21)] if high > low else [low - 0.5, low + 0.5]
    fig = _new_figure(6.0, 3.6)
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.15, top=0.86)
    ax = fig.subplots()
    for (step, step_rewards), colour in zip(rewards.items(), ("tab:grey", "tab:blue"), strict=False):
        mean = sum(step_rewards) / len(step_rewards)
        ax.hist(step_rewards, bins=bins, alpha=0.55, color=colour,
                label=f"step {step:g}: {len(step_rewards)} samples, mean {mean:.3g}")
    ax.legend(fontsize=7)
    ax.set_xlabel("reward", fontsize=8)
    ax.set_ylabel("samples", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    return _png(fig)


def safe_name(text: str) -> str:
    """``text`` usable as a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("._") or "x"


def key_curves(names: Sequence[str]) -> list[str]:
    """The key metrics among ``names`` (:data:`KEY_CURVES`), in that order; a pattern may match several."""
    out: list[str] = []
    for pattern in KEY_CURVES:
        out += [n for n in sorted(names) if re.fullmatch(pattern, n) and n not in out]
    return out


def stage_plots(stage: str, runs: dict[str, StageMetrics]) -> tuple[list[Plot], dict[str, float]]:
    """Every figure of one stage, one line per run (``runs``: label -> metrics; one unlabelled run for a
    plain report): the key curves first, then a small-multiple figure per group, then gold / proxy vs KL
    for a single run. Series that never move, and evaluations logged at a single step (their figure is in
    the table), are left out; returns the flat ones (name -> value) for the page to list."""
    flat: dict[str, float] = {}
    moving: dict[str, None] = {}  # ordered set: moves in at least one run
    for metrics in runs.values():
        for name, series in metrics.items():
            if len(series) <= 1 and name.startswith("eval/"):
                continue  # an evaluation logged once: its figure is in the table
            if is_flat(series):
                flat.setdefault(name, next(iter(series.values()), math.nan))
            else:
                moving[name] = None
    flat = {n: v for n, v in flat.items() if n not in moving}

    def panels_of(names: list[str]) -> dict[str, dict[str, Series]]:
        return {n: {label: m[n] for label, m in runs.items() if m.get(n)} for n in names}

    plots = []
    key = key_curves(list(moving))
    if key:
        title = f"{stage}: key curves"
        panels = panels_of(key)
        plots.append(Plot(title, f"{safe_name(stage)}-key.png", small_multiples(title, panels), panels))
    rest = {n: {} for n in moving if n not in key}
    for group, members in group_metrics(rest).items():
        names_in_group = list(members)
        chunks = [names_in_group[i:i + MAX_PANELS] for i in range(0, len(names_in_group), MAX_PANELS)]
        for i, chunk in enumerate(chunks):
            part = f" ({i + 1}/{len(chunks)})" if len(chunks) > 1 else ""
            suffix = f"-{i + 1}" if len(chunks) > 1 else ""
            title = f"{stage}: {group}{part}"
            panels = panels_of(chunk)
            plots.append(Plot(title, f"{safe_name(stage)}-{safe_name(group)}{suffix}.png",
                              small_multiples(title, panels), panels))
    title = f"{stage}: gold and proxy reward against KL"
    png = gold_proxy_kl(title, next(iter(runs.values()))) if len(runs) == 1 else None
    if png is not None:
        plots.append(Plot(title, f"{safe_name(stage)}-gold-proxy-kl.png", png))
    return plots, flat


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

def mean_and_std_over_runs(series: Sequence[Series]) -> tuple[Series, Series]:
    """Per step, the mean over the runs that logged it, and the sample standard deviation (n - 1) where at
    least two did."""
    mean, std = {}, {}
    for step in sorted(set().union(*series)):
        summary = seed_summary([s[step] for s in series if step in s])
        mean[step] = summary["mean"]
        if summary["n"] > 1:
            std[step] = summary["std"]
    return mean, std


def comparison_png(run_dirs: Sequence[Path], stages: Sequence[str], keys: Sequence[str], title: str) -> bytes | None:
    """One panel per metric, one line per stage: the stage's value against step, averaged over the runs
    (seeds) that logged it at that step, shaded +- one standard deviation over them; None when no stage
    logged any of the metrics."""
    runs = [stage_metrics(read_jsonl(Path(d) / "metrics.jsonl")[0]) for d in run_dirs]
    panels: dict[str, dict[str, Series]] = {}
    spreads: dict[str, dict[str, Series]] = {}
    counts = set()  # how many runs logged each line
    for key in keys:
        for stage in stages:
            series = [s for s in (run.get(stage, {}).get(key, {}) for run in runs) if s]
            mean, std = mean_and_std_over_runs(series)
            if mean:
                panels.setdefault(key, {})[stage] = mean
                spreads.setdefault(key, {})[stage] = std
                counts.add(len(series))
    if not panels:
        return None
    n = f"{min(counts)}" if len(counts) == 1 else f"{min(counts)}-{max(counts)}"
    label = f" (mean +- std of {n} runs)" if max(counts) > 1 else ""
    return small_multiples(title + label, panels, spreads)
