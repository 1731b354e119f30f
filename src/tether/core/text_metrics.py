"""Figures over a set of completions that say how a model writes, not whether it is right.

Each is ``fn(completions, correct) -> {name: value}`` (``correct``: one 0/1 per completion, from the task's
verifier) registered in ``TEXT_METRICS`` under the name ``eval.metrics`` takes; an evaluation computes
the requested ones on its greedy completions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from tether.core.registry import Registry

TEXT_METRICS: Registry = Registry("text metric")

# Words a reasoning model uses when it re-examines its work (the R1 paper's "aha" vocabulary).
REFLECTION_WORDS = ("wait", "check", "verify", "recheck", "mistake", "actually", "hmm", "again")


def distinct_n(completions: Sequence[str], n: int) -> float:
    """distinct-n (Li et al. 2016, "A Diversity-Promoting Objective Function for Neural Conversation
    Models"): the number of distinct n-grams of whitespace tokens over all completions divided by the
    total number of n-grams; 0 when there is none."""
    grams = [tuple(tokens[i:i + n]) for text in completions for tokens in [text.split()]
             for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


@TEXT_METRICS.register("distinct")
def distinct(completions: Sequence[str], correct: Sequence[float]) -> dict[str, float]:
    """distinct-1 and distinct-2 of the completions (:func:`distinct_n`): lexical diversity."""
    return {"distinct_1": distinct_n(completions, 1), "distinct_2": distinct_n(completions, 2)}


@TEXT_METRICS.register("length_by_outcome")
def length_by_outcome(completions: Sequence[str], correct: Sequence[float]) -> dict[str, float]:
    """Mean length in characters of the correct and of the incorrect completions (NaN for an empty side):
    whether wrong answers run longer, as they do in long-reasoning models."""
    def mean(values: list[int]) -> float:
        return sum(values) / len(values) if values else float("nan")

    right = [len(c) for c, ok in zip(completions, correct, strict=True) if ok > 0]
    wrong = [len(c) for c, ok in zip(completions, correct, strict=True) if ok <= 0]
    return {"length/correct": mean(right), "length/incorrect": mean(wrong)}


@TEXT_METRICS.register("reflection")
def reflection(completions: Sequence[str], correct: Sequence[float]) -> dict[str, float]:
    """Reflection words per completion (:data:`REFLECTION_WORDS`, whole words, any case), and the share of
    completions with at least one: the "aha moment" count of the DeepSeek-R1 paper."""
    pattern = re.compile(r"\b(" + "|".join(REFLECTION_WORDS) + r")\b", re.IGNORECASE)
    counts = [len(pattern.findall(text)) for text in completions]
    n = max(len(counts), 1)
    return {"reflection/words": sum(counts) / n, "reflection/share": sum(c > 0 for c in counts) / n}
