"""Preference pairs from scored samples: the rules online / iterative DPO uses to turn K scored
responses to one prompt into (chosen, rejected) pairs.

Every rule is ``fn(scores, *, margin, threshold) -> list[(chosen_index, rejected_index)]`` over the
K scores of one prompt (``None`` or NaN = missing: that sample takes part in no pair), registered in
``PAIR_RULES`` under the name configs use:

- ``best_vs_worst``: the highest against the lowest score, if they differ by more than ``margin``
  (the rule of Xiong et al. 2024, iterative DPO, and Yuan et al. 2024, self-rewarding; the first
  sample wins a tie for best, the last a tie for worst, so the choice is deterministic);
- ``all_pairs``: every pair whose scores differ by more than ``margin``, larger gaps first;
- ``threshold``: every sample scoring at least ``threshold`` against every one scoring below it,
  larger gaps first (a correct/incorrect split for a verifier).

``pairwise_scores`` turns a pairwise judge's verdicts among K samples into per-sample scores (the
mean win probability against the others, a Borda count), so the same rules apply to a pairwise judge.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from tether.core.registry import Registry

Pair = tuple[int, int]
PAIR_RULES: Registry[Callable[..., list[Pair]]] = Registry("pair rule")


def _present(scores: Sequence[float | None]) -> list[tuple[int, float]]:
    return [(i, float(s)) for i, s in enumerate(scores) if s is not None and math.isfinite(float(s))]


def _by_gap(pairs: list[Pair], scores: Sequence[float | None]) -> list[Pair]:
    return sorted(pairs, key=lambda p: (-(float(scores[p[0]]) - float(scores[p[1]])), p))


@PAIR_RULES.register("best_vs_worst")
def best_vs_worst(scores: Sequence[float | None], *, margin: float = 0.0, threshold: float | None = None) -> list[Pair]:
    """The best-scored sample against the worst, when their gap exceeds ``margin``."""
    present = _present(scores)
    if len(present) < 2:
        return []
    best = max(present, key=lambda x: (x[1], -x[0]))
    worst = min(present, key=lambda x: (x[1], -x[0]))
    return [(best[0], worst[0])] if best[1] - worst[1] > margin else []


@PAIR_RULES.register("all_pairs")
def all_pairs(scores: Sequence[float | None], *, margin: float = 0.0, threshold: float | None = None) -> list[Pair]:
    """Every pair of samples whose gap exceeds ``margin``, the largest gaps first."""
    present = _present(scores)
    pairs = [(i, j) for i, si in present for j, sj in present if si - sj > margin]
    return _by_gap(pairs, scores)


@PAIR_RULES.register("threshold")
def threshold_pairs(scores: Sequence[float | None], *, margin: float = 0.0, threshold: float | None = None
                    ) -> list[Pair]:
    """Samples scored at least ``threshold`` against those below it."""
    if threshold is None:
        raise ValueError("pair rule 'threshold' needs a threshold")
    present = _present(scores)
    good = [i for i, s in present if s >= threshold]
    bad = [i for i, s in present if s < threshold]
    return _by_gap([(i, j) for i in good for j in bad], scores)


def make_pairs(scores: Sequence[float | None], rule: str, *, margin: float = 0.0, threshold: float | None = None,
               max_pairs: int | None = None) -> list[Pair]:
    """The rule's pairs for one prompt, at most ``max_pairs`` of them (the first ones: largest gaps)."""
    pairs = PAIR_RULES.get(rule)(scores, margin=margin, threshold=threshold)
    return pairs[:max_pairs] if max_pairs is not None else pairs


def pairwise_scores(k: int, verdicts: dict[Pair, float | None]) -> list[float | None]:
    """Per-sample mean win probability from pairwise verdicts ``{(i, j): P(i beats j)}`` among ``k``
    samples; missing verdicts are skipped, and a sample with none is missing."""
    wins = [0.0] * k
    games = [0] * k
    for (i, j), p in verdicts.items():
        if p is None:
            continue
        wins[i] += p
        wins[j] += 1.0 - p
        games[i] += 1
        games[j] += 1
    return [wins[i] / games[i] if games[i] else None for i in range(k)]


def win_probabilities(scores: Sequence[float | None], *, temperature: float | None = None,
                      pairwise: bool = False) -> list[float | None]:
    """Each sample's estimated probability of beating the policy, over the K samples of one prompt.

    SPPO (Wu et al. 2024), Eq. 3.10: ``P̂(y_i ≻ π) = 1/K Σ_k P(y_i ≻ y_k)``, the sum over all K samples
    including ``y_i`` itself (``P(y_i ≻ y_i) = 1/2``). From scalar scores ``s`` (a verifier, a reward
    model): ``P(y_i ≻ y_k) = σ((s_i - s_k) / temperature)`` (Bradley-Terry), or with ``temperature``
    None the hard comparison 1 / 1/2 / 0 (win / tie / loss). With ``pairwise`` the scores already are
    each sample's mean win probability against the other K - 1 (a pairwise judge's
    :func:`pairwise_scores`), so ``P̂ = ((K - 1) s + 1/2) / K``. Missing scores take part in nothing
    and get None; K counts the present samples.
    """
    if temperature is not None and temperature <= 0:
        raise ValueError(f"win probability temperature must be > 0, got {temperature}")
    present = _present(scores)
    k = len(present)
    out: list[float | None] = [None] * len(scores)
    for i, s_i in present:
        if pairwise:
            out[i] = ((k - 1) * s_i + 0.5) / k
            continue
        total = 0.0
        for _, s_j in present:
            if temperature is not None:
                total += 1.0 / (1.0 + math.exp(-(s_i - s_j) / temperature))
            else:
                total += 1.0 if s_i > s_j else 0.5 if s_i == s_j else 0.0
        out[i] = total / k
    return out


def rso_sample(scores: Sequence[float | None], *, beta: float, num_samples: int, rng: random.Random) -> list[int]:
    """Statistical rejection sampling: which of K samples from the SFT policy to keep so that the kept ones
    are draws from the reward-tilted policy ``π_r(y|x) ∝ π_sft(y|x) exp(r(x, y) / β)``.

    Liu et al. 2023, "Statistical Rejection Sampling Improves Preference Optimization" (RSO), Algorithm 1:
    propose a remaining candidate, accept it with probability ``exp((r - r_max) / β)`` (``r_max`` the
    largest remaining reward, so the best one is always accepted when proposed), remove what is accepted,
    until ``num_samples`` are accepted or none remain. Each proposal here is a uniform draw from the
    remaining candidates, so the first kept sample is exactly ``P(i) ∝ exp(r_i / β)`` over the K samples;
    the paper's listing scans the candidates in order instead, which favours the first ones. Small β
    keeps only the top rewards, large β approaches uniform. Missing scores are never kept. Returns the
    indices in the order they were accepted; deterministic given ``rng``'s state.
    """
    if beta <= 0:
        raise ValueError(f"rso beta must be > 0, got {beta}")
    if num_samples < 1:
        raise ValueError(f"rso num_samples must be >= 1, got {num_samples}")
    remaining = _present(scores)
    accepted: list[int] = []
    while remaining and len(accepted) < num_samples:
        best = max(reward for _, reward in remaining)
        position = rng.randrange(len(remaining))
        index, reward = remaining[position]
        if rng.random() < math.exp((reward - best) / beta):
            accepted.append(index)
            del remaining[position]
    return accepted


def rso_scores(scores: Sequence[float | None], *, beta: float, num_samples: int, rng: random.Random
               ) -> list[float | None]:
    """``scores`` with every sample :func:`rso_sample` does not keep set to None, so a pair rule pairs only
    among the kept ones (the reward-tilted samples)."""
    kept = set(rso_sample(scores, beta=beta, num_samples=num_samples, rng=rng))
    return [s if i in kept else None for i, s in enumerate(scores)]
