"""Progress of long work as plain lines, for output that is a log file as much as a terminal.

A rich bar draws nothing until the end when output is not a terminal, and cannot nest inside the
trainer's own bar; :class:`ProgressLines` prints ``label: done/total unit (p%), rate, time left`` every
``every`` seconds and once at the end (when the work took that long), through the rich console so the
lines sit above a live bar instead of breaking it.
"""

from __future__ import annotations

import math
import time

from rich.console import Console

EVERY_S = 30.0  # seconds between lines unless a caller says otherwise


def format_duration(seconds: float) -> str:
    """``1h02m``, ``1m05s``, ``42s`` (whole seconds, rounded), or ``?`` when unknown."""
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class ProgressLines:
    """Report ``update(done)`` calls as a line every ``every`` seconds (default :data:`EVERY_S`); silent
    when not ``enabled``."""

    def __init__(self, label: str, total: int, unit: str, *, enabled: bool = True, every: float | None = None,
                 console: Console | None = None) -> None:
        self.label, self.total, self.unit, self.enabled = label, total, unit, enabled
        self.every = EVERY_S if every is None else every
        self.console = console
        self.began = self.last = time.monotonic()
        self.done = 0

    def update(self, done: int) -> None:
        self.done = done
        now = time.monotonic()
        finished = done >= self.total
        if not self.enabled or (now - self.last < self.every and not (finished and now - self.began >= self.every)):
            return
        self.last = now
        rate = done / max(now - self.began, 1e-9)
        left = (self.total - done) / rate if rate > 0 else float("inf")
        line = (f"{self.label}: {done}/{self.total} {self.unit} ({done / max(self.total, 1):.0%}), "
                f"{rate:.1f} {self.unit}/s, {format_duration(left)} left")
        if self.console is not None:
            self.console.print(line, highlight=False, markup=False, soft_wrap=True)
        else:
            print(line, flush=True)
