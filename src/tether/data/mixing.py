"""Several SFT / pretraining sources mixed by weight (``data.mix``): which examples make each epoch.

The scheme, deterministic given ``train.seed`` and a pure function of the epoch (so a resumed run
draws exactly what an uninterrupted one would):

1. **Counts.** Every epoch holds ``size`` examples (``data.mix_size``; default: as many as the sources
   hold together). Source i gets ``c_i`` of them, the apportionment of ``size`` by the weights with
   largest remainders (Hamilton's method): ``c_i = floor(size * w_i / W)``, then the examples still
   missing go one each to the largest fractional parts ``size * w_i / W - floor(...)`` (ties to the
   earlier source). So ``|c_i - size * w_i / W| < 1``, the counts sum to ``size``, and every epoch
   has the same composition: a share follows its weight exactly, not in expectation.
2. **Which examples.** Each source is an endless stream of passes over its examples, pass ``p``
   shuffled by ``(seed, source name, p)``; epoch ``e`` takes positions ``e * c_i ... (e + 1) * c_i - 1``
   of source i's stream. A down-weighted source is walked through over several epochs, no example
   repeated before all were used; an up-weighted one goes round whole passes, each example about
   ``c_i / n_i`` times an epoch (exactly, when ``n_i`` divides ``c_i``).
3. The epoch's examples of all sources are then shuffled together into micro-batches
   (``tether.data.packing.make_batches`` by ``(seed, epoch)``), as a single source's are.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tether.data.schemas import DataError

T = TypeVar("T")


def mixture_counts(weights: Sequence[float], size: int) -> list[int]:
    """Examples per source in an epoch of ``size``: the largest-remainder (Hamilton) apportionment of
    ``size`` by ``weights``, ties to the earlier source (see the module docstring)."""
    if not weights:
        raise ValueError("a mixture needs at least one source")
    if any(not (w > 0) or math.isinf(w) for w in weights):
        raise ValueError(f"mixture weights must be finite numbers > 0, got {list(weights)}")
    if size < 0:
        raise ValueError(f"a mixture's size must be >= 0, got {size}")
    total = math.fsum(weights)
    quotas = [size * w / total for w in weights]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: size - sum(counts)]:
        counts[i] += 1
    return counts


def stream_indices(n: int, start: int, count: int, *, seed: int | str, namespace: str = "tether-mix:") -> list[int]:
    """Positions ``start ... start + count - 1`` of an endless stream of passes over ``range(n)``, pass ``p``
    shuffled by ``(namespace, seed, p)``: the indices of a source's examples that an epoch takes (mixtures), or
    of the prompts a step or round draws (the RL and online-preference trainers, each in its namespace)."""
    if n < 1:
        raise ValueError("a stream needs at least one example")
    out: list[int] = []
    position, end = start, start + count
    while position < end:
        p, offset = divmod(position, n)
        order = list(range(n))
        random.Random(f"{namespace}{seed}:{p}").shuffle(order)
        take = order[offset: offset + (end - position)]
        out.extend(take)
        position += len(take)
    return out


@dataclass
class Mixture(Generic[T]):
    """Named sources of examples and their per-epoch counts; :meth:`epoch` draws one epoch."""

    names: list[str]
    sources: list[list[T]]
    counts: list[int]
    seed: int = 0
    _cache: tuple[int, list[T], list[int]] | None = field(default=None, repr=False)

    @classmethod
    def build(cls, names: Sequence[str], sources: Sequence[list[T]], weights: Sequence[float], *,
              size: int | None = None, seed: int = 0) -> Mixture[T]:
        """The mixture of ``sources`` (each non-empty) by ``weights``, ``size`` examples an epoch (default: the
        sources' total). A source the apportionment leaves with no example is an error."""
        for name, examples in zip(names, sources, strict=True):
            if not examples:
                raise DataError(f"data.mix source {name!r} has no examples", source=name)
        size = sum(len(s) for s in sources) if size is None else size
        counts = mixture_counts(weights, size)
        for name, weight, count in zip(names, weights, counts, strict=True):
            if count == 0:
                raise DataError(f"data.mix source {name!r} gets none of the {size} examples an epoch at weight "
                                f"{weight:g} of {math.fsum(weights):g}; raise its weight or data.mix_size",
                                source=name)
        return cls(list(names), [list(s) for s in sources], counts, seed)

    @property
    def size(self) -> int:
        return sum(self.counts)

    def epoch(self, epoch: int) -> tuple[list[T], list[int]]:
        """Epoch ``epoch``'s examples, grouped by source, and the source number of each."""
        if self._cache is None or self._cache[0] != epoch:
            examples: list[T] = []
            source_of: list[int] = []
            for i, (name, items, count) in enumerate(zip(self.names, self.sources, self.counts, strict=True)):
                picked = stream_indices(len(items), epoch * count, count, seed=f"{self.seed}:{name}")
                examples.extend(items[k] for k in picked)
                source_of.extend([i] * count)
            self._cache = (epoch, examples, source_of)
        return self._cache[1], self._cache[2]
