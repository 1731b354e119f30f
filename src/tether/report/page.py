"""The report's HTML: the answer first (headline figures before -> after), run facts, configuration, stages.

Everything from the run directory is escaped (:func:`_e`); images are embedded ``data:`` URIs.
"""

from __future__ import annotations

import base64
import html
import json
import time
from typing import Any

from tether.report.interactive import assets_html, chart_html, init_html
from tether.report.plots import Plot, safe_name
from tether.report.read import as_number
from tether.runtime.progress import format_duration

# Figures without an interval that still answer "what did this stage do" (a task's own rates, an RM's
# pairwise accuracy, a preference stage's implicit accuracy, a gold reward).
HEADLINE_EXTRA = ("violation_rate", "helpfulness", "pairwise_accuracy", "implicit_accuracy", "step_accuracy",
                  "gold", "gold_greedy", "proxy")


CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1400px; padding: 0 1em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2em; margin-top: 2em; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.text { font-family: ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; max-width: 50em; }
figure { margin: 1em 0; } figcaption { color: #555; font-size: 0.9em; }
img { max-width: 100%; height: auto; } .note { color: #8a5a00; } .muted { color: #666; }
.answer td.num { font-size: 1.1em; } .good { color: #1e7b34; } .bad { color: #b03a2e; }
details { margin: 0.5em 0 1em; } summary { cursor: pointer; color: #444; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
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


def headline_figures(figures: dict[str, Any]) -> list[str]:
    """The figures of one stage worth leading with: every rate with a 95% interval, then the extras."""
    rates = [k for k in figures if f"{k}_ci95_low" in figures and not k.startswith(("before/", "gain/"))]
    rates = rates or [k for k in ("accuracy", "success") if k in figures]  # results written before intervals
    return rates + [k for k in HEADLINE_EXTRA if k in figures and k not in rates]


def _pct(value: float, rate: bool) -> str:
    return f"{100 * value:.1f}%" if rate else f"{value:.4g}"


def _with_interval(figures: dict[str, Any], key: str, rate: bool) -> str:
    value = as_number(figures.get(key))
    if value is None:
        return "–"
    low, high = as_number(figures.get(f"{key}_ci95_low")), as_number(figures.get(f"{key}_ci95_high"))
    interval = f" [{_pct(low, rate)}, {_pct(high, rate)}]" if low is not None and high is not None else ""
    return _pct(value, rate) + interval


def headline_html(results: dict[str, dict]) -> str:
    """The answer: each stage's headline figures, before -> after with 95% intervals, the paired gain."""
    rows = []
    for stage, figures in results.items():
        for key in headline_figures(figures):
            rate = f"{key}_ci95_low" in figures or key in ("accuracy", "success", *HEADLINE_EXTRA[:5])
            before = _with_interval(figures, f"before/{key}", rate) if f"before/{key}" in figures else ""
            gain = as_number(figures.get(f"gain/{key}"))
            gain_text = ""
            if gain is not None:
                low, high = figures.get(f"gain/{key}_ci95_low"), figures.get(f"gain/{key}_ci95_high")
                span = f" [{100 * low:+.1f}, {100 * high:+.1f}]" if low is not None and high is not None else ""
                tone = "good" if low is not None and low > 0 else "bad" if high is not None and high < 0 else ""
                gain_text = f'<span class="{tone}">{100 * gain:+.1f} points{span}</span>'
            n = figures.get("n") if f"{key}_ci95_low" in figures else None
            n = figures.get(f"{key}_n", n)
            rows.append(f"<tr><th>{_e(stage)}</th><th>{_e(key)}</th><td class=\"num\">{_e(before)}</td>"
                        f"<td class=\"num\">{_e(_with_interval(figures, key, rate))}</td>"
                        f"<td class=\"num\">{gain_text}</td><td class=\"num\">{_e(fmt(n) if n else '')}</td></tr>")
    if not rows:
        return '<p class="muted">No held-out figures yet (results.json is missing or holds none).</p>'
    return ('<table class="answer"><tr><th>stage</th><th>figure</th><th>before</th><th>after (95% interval)</th>'
            "<th>paired gain (95%)</th><th>n</th></tr>" + "".join(rows) + "</table>")


def facts_html(statuses: dict[str, str], seconds: dict[str, float], facts: dict[str, Any]) -> str:
    """How the run went: each stage's status and wall time, then each invocation's command, times, status,
    versions and commit (``run.json``)."""
    stages = list(dict.fromkeys([*statuses, *seconds]))
    rows = "".join(f"<tr><th>{_e(s)}</th><td>{_e(statuses.get(s, ''))}</td>"
                   f"<td class=\"num\">{_e(format_duration(seconds[s]) if s in seconds else '')}</td></tr>" for s in stages)
    total = sum(seconds.values())
    out = ["<table><tr><th>stage</th><th>status</th><th>wall time</th></tr>" + rows +
           f"<tr><th>all</th><td></td><td class=\"num\">{_e(format_duration(total))}</td></tr></table>"]
    invocations = facts.get("invocations") or []
    if invocations:
        cells = []
        for inv in invocations:
            versions = ", ".join(f"{k} {v}" for k, v in (inv.get("versions") or {}).items())
            cells.append(f"<tr><td class=\"text\">{_e(inv.get('command', ''))}</td><td>{_e(inv.get('started', ''))}</td>"
                         f"<td>{_e(inv.get('ended') or '')}</td><td>{_e(inv.get('status', ''))}</td>"
                         f"<td>{_e(versions)}</td><td class=\"text\">{_e(inv.get('commit') or '')}</td></tr>")
        out.append("<table><tr><th>command</th><th>started</th><th>ended</th><th>status</th><th>versions</th>"
                   "<th>tether commit</th></tr>" + "".join(cells) + "</table>")
    else:
        out.append('<p class="muted">No run.json: this run predates the record of commands and versions.</p>')
    return "\n".join(out)


def config_html(text: str) -> str:
    if not text:
        return ""
    return f"<details><summary>resolved configuration (config.yaml)</summary><pre>{_e(text)}</pre></details>"


def flat_html(flat: dict[str, float]) -> str:
    if not flat:
        return ""
    items = ", ".join(f"{name} = {fmt(value)}" for name, value in sorted(flat.items()))
    return f"<details><summary>{len(flat)} series that never moved (not plotted)</summary><p>{_e(items)}</p></details>"


def stage_html(stage: str, plots: list[Plot], samples: list[dict], flat: dict[str, float] | None = None) -> str:
    parts = [f'<h2 id="stage-{_e(safe_name(stage))}">{_e(stage)}</h2>']
    for plot in plots:
        static = figure_html(plot.title, plot.png)
        parts.append(f'<h3 class="chart-title">{_e(plot.title)}</h3>' + chart_html(plot.panels, static)
                     if plot.panels else static)
    if not plots:
        parts.append('<p class="muted">No moving metric logged for this stage.</p>')
    parts.append(flat_html(flat or {}))
    parts.append(samples_html(samples))
    return "\n".join(parts)


def page_html(title: str, description: str, body: list[str]) -> str:
    """The page; with interactive charts in ``body``, the charting library in the head and its init script
    at the end."""
    generated = time.strftime("%Y-%m-%d %H:%M:%S")
    content = "\n".join(body)
    charts = 'class="chart-data"' in content
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>tether report: {_e(title)}</title><style>{CSS}</style>{assets_html() if charts else ''}"
            f"</head><body>\n<h1>tether report: {_e(title)}</h1><p class=\"muted\">{_e(description)}</p>\n"
            + content + f'\n<p class="muted">Written by tether on {generated}.</p>\n'
            + (init_html() if charts else "") + "</body></html>\n")

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
