"""Rewards routed by prompt type: each sample scored by the reward list its record's ``kind`` names.

DeepSeek-R1 (Guo et al. 2025, Sec. 2.3.4, "Reinforcement Learning for all Scenarios") trains on a mix of
prompts with a different signal per type: rule-based verifiers for reasoning prompts, reward models of human
preference for general ones, and for helpfulness "only the final summary" is scored, so the reasoning does
not enter the judgement. :class:`RoutedRewardComposer` does this over built composers (one per route): the
samples of each kind go to that kind's composer, optionally as their final answers only
(:func:`final_answer`), and the results are put back in sample order.

The result is a :class:`~tether.rewards.RewardResult` like any composer's: its functions are labelled
``<kind>/<label>`` and are NaN on the samples of other kinds, so a weighted sum over them (the ``sum``
aggregation) is exactly each sample's own route's total. A route with no sample in a batch has no entry in
that batch's result. Unlike the paper, which scores harmlessness on the whole response, an
``answer_only`` route strips the thinking for every one of its rewards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tether.rewards.combine import RewardResult
from tether.tasks.base import THINK_CLOSE, THINK_OPEN


def final_answer(completion: str, prompt: str = "") -> str:
    """The part of a completion a helpfulness reward sees: the text after the last ``</think>``, stripped; ""
    when a ``<think>`` block is opened (in the completion, or by a prompt ending in ``<think>``) and never
    closed (all of it is thinking); the whole completion, stripped, when it has no think tags."""
    opened = prompt.rstrip().endswith(THINK_OPEN) or THINK_OPEN in completion
    if THINK_CLOSE in completion:
        return completion.rsplit(THINK_CLOSE, 1)[1].strip()
    return "" if opened else completion.strip()


@dataclass
class RoutedRewardResult(RewardResult):
    """A :class:`RewardResult` whose functions belong to routes: ``routes`` maps each route in the batch to its
    samples (shape (N,), bool), so that a function's ``none`` counts only its own route's samples."""

    routes: dict[str, torch.Tensor] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """The composer's figures, ``none`` counted within each route, and ``reward/route/<kind>/samples``."""
        metrics = super().metrics()
        for key, values in self.per_function.items():
            rows = self.routes[key.split("/", 1)[0]]
            metrics[f"reward/{key}/none"] = float(torch.isnan(values[rows]).sum())
        for kind, rows in self.routes.items():
            metrics[f"reward/route/{kind}/samples"] = float(rows.sum())
        return metrics


class RoutedRewardComposer:
    """One composer per route; ``score`` sends each sample to the route its ``by`` column names.

    ``composers``: route name -> a composer (``score(prompts, completions, columns) -> RewardResult``);
    ``answer_only``: the routes whose composers see final answers (:func:`final_answer`) instead of whole
    completions. A sample whose kind has no route, or a batch without the ``by`` column, is an error.
    """

    def __init__(self, composers: dict[str, Any], *, by: str = "kind", answer_only: Sequence[str] = ()) -> None:
        if not composers:
            raise ValueError("reward routes: give at least one route")
        unknown = sorted(set(answer_only) - set(composers))
        if unknown:
            raise ValueError(f"reward routes: answer_only names {unknown}, which are not routes ({sorted(composers)})")
        self.composers, self.by, self.answer_only = dict(composers), by, frozenset(answer_only)

    def route(self, columns: dict[str, Sequence]) -> list[str]:
        """Each sample's route, from its ``by`` column."""
        if self.by not in columns:
            raise ValueError(f"reward routes read the record column {self.by!r}, which the prompts lack (columns: "
                             f"{sorted(columns) or 'none'}); give every prompt record a {self.by!r} field (a "
                             f"data.mix source's columns: {{{self.by}: ...}})")
        kinds = [str(k) for k in columns[self.by]]
        missing = sorted(set(kinds) - set(self.composers))
        if missing:
            raise ValueError(f"reward routes: no route for {self.by} {missing[0]!r}; routes: "
                             f"{', '.join(sorted(self.composers))}")
        return kinds

    def score(self, prompts: list[str], completions: list[str], columns: dict[str, Sequence] | None = None
              ) -> RoutedRewardResult:
        """Score N completions, each by its own route; see the module docstring for the result's layout."""
        columns = dict(columns or {})
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"got {len(prompts)} prompts for {n} completions")
        kinds = self.route(columns)
        total = torch.full((n,), math.nan)
        valid = torch.zeros(n, dtype=torch.bool)
        per_function: dict[str, torch.Tensor] = {}
        errors: dict[str, int] = {}
        nonfinite: dict[str, int] = {}
        timeouts: dict[str, int] = {}
        weights: list[float] = []
        routes: dict[str, torch.Tensor] = {}
        for kind, composer in self.composers.items():
            index = [i for i, k in enumerate(kinds) if k == kind]
            if not index:
                continue
            sub_prompts = [prompts[i] for i in index]
            sub = [completions[i] for i in index]
            if kind in self.answer_only:
                sub = [final_answer(c, p) for c, p in zip(sub, sub_prompts, strict=True)]
            result = composer.score(sub_prompts, sub, {k: [v[i] for i in index] for k, v in columns.items()})
            rows = torch.tensor(index)
            routes[kind] = torch.zeros(n, dtype=torch.bool).index_fill(0, rows, True)
            total[rows], valid[rows] = result.total, result.valid
            for label, values in result.per_function.items():
                key = f"{kind}/{label}"
                per_function[key] = torch.full((n,), math.nan).index_put((rows,), values)
                errors[key], nonfinite[key] = result.errors[label], result.nonfinite[label]
                timeouts[key] = result.timeouts.get(label, 0)
            weights.extend(result.weights or [1.0] * len(result.per_function))
        return RoutedRewardResult(total, per_function, valid, errors, nonfinite, timeouts, tuple(weights), routes)
