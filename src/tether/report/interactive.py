"""Interactive charts in the report: uPlot (MIT, vendored in ``vendor/``, embedded in the page, no network).

Each small-multiple figure becomes a grid of uPlot charts drawn from a JSON block next to it: drag to zoom
on steps, double-click to zoom out, hover for every line's value at that step in the legend. The static PNG
stays in a ``<noscript>`` for readers without JavaScript (and in ``plots/``).

The data block holds names and numbers from the run directory, so it is serialised with every ``<``,
``>`` and ``&`` escaped as a JSON unicode escape: nothing in it can close the ``<script>`` element or
open another; the only scripts on the page are the library and :data:`INIT`, both ours.
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

from tether.report.read import Series

VENDOR = Path(__file__).with_name("vendor")
LIBRARY_NOTE = "/* uPlot 1.6.32, MIT License, Copyright (c) 2022 Leon Sorokin (vendor/LICENSE-uPlot) */"
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf"]

INIT = """(function () {
  var colours = %(colours)s;
  document.querySelectorAll("script.chart-data").forEach(function (block) {
    var spec = JSON.parse(block.textContent);
    var grid = document.createElement("div");
    grid.className = "charts";
    block.parentNode.insertBefore(grid, block);
    spec.panels.forEach(function (panel) {
      var cell = document.createElement("div");
      grid.appendChild(cell);
      var series = [{label: "step"}].concat(panel.labels.map(function (label, i) {
        return {label: label || panel.name, stroke: colours[i %% colours.length], width: 1.5, spanGaps: true,
                points: {show: panel.x.length <= 30, size: 4}};
      }));
      new uPlot({title: panel.name, width: 330, height: 210, series: series, scales: {x: {time: false}},
                 axes: [{size: 30}, {size: 55}], cursor: {drag: {x: true, y: false}}, legend: {live: true}},
                [panel.x].concat(panel.ys), cell);
    });
  });
})();"""


@cache
def _library() -> tuple[str, str]:
    script = (VENDOR / "uPlot.iife.min.js").read_text()
    if script.startswith("/*!"):  # its banner holds a web address; the page references none
        script = script[script.index("*/") + 2:]
    return LIBRARY_NOTE + script, (VENDOR / "uPlot.min.css").read_text()


def assets_html() -> str:
    """The library and its stylesheet, once per page, in the head."""
    script, css = _library()
    return (f"<style>{css}\n.charts {{ display: flex; flex-wrap: wrap; gap: 0.5em 1.5em; }}</style>"
            f"<script>{script}</script>")


def init_html() -> str:
    """The script that draws every chart block; placed at the end of the body."""
    return f"<script>{INIT % {'colours': json.dumps(COLOURS)}}</script>"


def safe_json(value: object) -> str:
    """JSON that cannot end or start a script element: ``<``, ``>`` and ``&`` as unicode escapes."""
    text = json.dumps(value, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def chart_data(panels: dict[str, dict[str, Series]]) -> dict:
    """Panels (metric -> label -> step -> value) as uPlot data: one shared step axis per panel, each line's
    values on it (null where that line has no point)."""
    out = []
    for name, lines in panels.items():
        steps = sorted({step for series in lines.values() for step in series})
        ys = [[series.get(step) if series.get(step) is not None and math.isfinite(series[step]) else None
               for step in steps] for series in lines.values()]
        out.append({"name": name, "labels": list(lines), "x": steps, "ys": ys})
    return {"panels": out}


def chart_html(panels: dict[str, dict[str, Series]], fallback: str) -> str:
    """An interactive figure: the data block the init script draws, the static ``fallback`` in noscript."""
    return (f'<script type="application/json" class="chart-data">{safe_json(chart_data(panels))}</script>'
            f"<noscript>{fallback}</noscript>")
