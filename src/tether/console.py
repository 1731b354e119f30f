"""What ``tether`` prints: the results of a run, and of a run over seeds, with their intervals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def _console() -> Console:
    """The terminal's width on a terminal; in a log file (80 columns by default) at least 160, so tables keep
    figure names and values whole instead of cutting them."""
    probe = Console()
    return probe if probe.is_terminal else Console(width=max(probe.width, 160))


console = _console()


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _interval(figures: dict[str, Any], key: str) -> str:
    """``50.5% [43.6%, 57.3%]``: a rate with its 95% interval when the figures carry one."""
    low, high = figures.get(f"{key}_ci95_low"), figures.get(f"{key}_ci95_high")
    return f"{figures[key]:.1%}" + (f" [{low:.1%}, {high:.1%}]" if low is not None and high is not None else "")


def _figures_cell(figures: dict[str, Any]) -> str:
    """One stage's figures, each interval folded into its figure: ``accuracy=0.5050 [0.4364, 0.5734]``."""
    cells = []
    for key, value in figures.items():
        if key.endswith(("_ci95_low", "_ci95_high")):
            continue
        low, high = figures.get(f"{key}_ci95_low"), figures.get(f"{key}_ci95_high")
        if key.rpartition("/")[2] == "n":
            value = int(value)  # a count of problems
        cells.append(f"{key}={_fmt(value)}" + (f" [{_fmt(low)}, {_fmt(high)}]" if low is not None else ""))
    return ", ".join(cells) or "-"


def print_results(results: dict[str, dict]) -> None:
    table = Table(title="results")
    table.add_column("stage")
    table.add_column("figures")
    for stage, figures in results.items():
        table.add_row(stage, _figures_cell(figures))
    console.print(table)
    n = next((int(f["n"]) for f in results.values() if "n" in f), None)
    accuracies = [(s, _interval(f, "accuracy")) for s, f in results.items() if "accuracy" in f]
    befores = [(s, f) for s, f in results.items() if "before/accuracy" in f]
    if befores and accuracies and accuracies[0][0] == befores[0][0]:  # the starting model has no stage of its own
        accuracies.insert(0, (f"before {befores[0][0]}", _interval(befores[0][1], "before/accuracy")))
    if accuracies:
        console.print("held-out accuracy" + (f" (n={n}, 95% Wilson interval)" if n else "") + ": "
                      + " -> ".join(f"{s} {a}" for s, a in accuracies))
    for stage, f in results.items():
        if "gain/accuracy" in f:
            console.print(f"gain of {stage} on the same problems: {f['gain/accuracy'] * 100:+.1f} points "
                          f"[{f['gain/accuracy_ci95_low'] * 100:+.1f}, {f['gain/accuracy_ci95_high'] * 100:+.1f}] "
                          "(paired bootstrap, 95%)")
    successes = [(s, _interval(f, "success")) for s, f in results.items() if "success" in f]  # agent stages
    if successes:
        console.print("held-out success: " + " -> ".join(f"{s} {a}" for s, a in successes))
    for key in ("violation_rate", "helpfulness"):  # the 'secret' task's principle (cai, d-rlaif)
        values = [(s, f[key]) for s, f in results.items() if key in f]
        if values:
            console.print(f"held-out {key.replace('_', ' ')}: " + " -> ".join(f"{s} {v:.1%}" for s, v in values))


HEADLINE_FIGURES = ("before/accuracy", "accuracy", "gain/accuracy", "success", "violation_rate", "helpfulness")


def print_seed_results(aggregated: dict[str, dict[str, dict]]) -> None:
    """The headline figures across seeds: mean +- std, the t interval of the mean, the seeds' values."""
    table = Table(title="across seeds (mean +- std, 95% interval of the mean)")
    for column in ("stage", "figure", "mean +- std", "95% interval", "seeds", "values"):
        table.add_column(column)
    for stage, figures in aggregated.items():
        for key in HEADLINE_FIGURES:
            if key in figures:
                s = figures[key]
                gain = key.startswith("gain/")  # a difference of rates: in points
                fmt = (lambda v: f"{v * 100:+.1f}") if gain else (lambda v: f"{v:.1%}")
                table.add_row(stage, key + (" (points)" if gain else ""), f"{fmt(s['mean'])} +- {s['std'] * 100:.1f}",
                              f"[{fmt(s['ci95'][0])}, {fmt(s['ci95'][1])}]", str(s["n"]),
                              " ".join(fmt(v) for v in s["values"]))
    if table.row_count:
        console.print(table)
    else:  # an empty table would read as a run that measured nothing
        console.print(f"across seeds: no headline figure ({', '.join(HEADLINE_FIGURES)}) in this recipe's results; "
                      "every figure's mean, std and interval is in results.json and the report", soft_wrap=True)


def print_plan(name: str, run_dir: Path, plan: list[dict[str, Any]]) -> None:
    """``tether run --dry-run``: every check passed; what each stage would do."""
    table = Table(title=f"{name} -> {run_dir} (dry run: nothing trained)", show_lines=False)
    for column in ("stage", "type", "model", "steps", "action"):
        table.add_column(column)
    for row in plan:
        table.add_row(row["stage"], row["type"], str(row["model"]), str(row["steps"] or ""), row["action"])
    console.print(table)
