"""The ``compare`` stage: a figure of several stages' metrics over steps, side by side."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tether.config.common import StageConfig


class CompareConfig(StageConfig):
    """One panel per metric, one line per stage (read from the run's metrics.jsonl); over seeds, the mean."""

    type: Literal["compare"] = Field("compare", description="the stage type")
    stages: list[str] = Field(..., min_length=1, description="the stages to compare (earlier in the recipe)")
    metrics: list[str] = Field(..., min_length=1, description="metric names of metrics.jsonl, one panel each")
    file: str = Field("comparison.png", pattern=r"^[\w.-]+\.png$", description="the figure, in the run directory")
    title: str = Field("", description="the figure's title; empty: the stage's name")
