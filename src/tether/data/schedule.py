"""Which examples make the micro-batches of each optimiser step: a pure function of the step, for exact resume."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from tether.data.schemas import DataError


class BatchSchedule:
    """Which examples form the micro-batches of optimiser step ``s``: a pure function of ``s``, for exact resume.

    Examples are shuffled by ``seed`` and cut into micro-batches of ``batch_size`` (a partial last
    one is dropped), dealt round-robin to ranks; ``grad_accum`` micro-batches make a step. With
    ``reshuffle`` every epoch reshuffles the examples; without it the micro-batches keep their
    composition and only their order changes per epoch, so anything computed per micro-batch
    before training (cached reference log-probs of KTO's mismatched pairs) stays valid.
    """

    def __init__(self, n: int, *, batch_size: int, grad_accum: int, seed: int, rank: int = 0,
                 world_size: int = 1, reshuffle: bool = True) -> None:
        self.n, self.batch_size, self.grad_accum, self.seed = n, batch_size, grad_accum, seed
        self.rank, self.world_size, self.reshuffle = rank, world_size, reshuffle
        self.per_rank = n // batch_size // world_size
        if self.per_rank < grad_accum:
            raise DataError(f"{n} examples make only {self.per_rank} micro-batches of {batch_size} per rank, "
                            f"fewer than grad_accum={grad_accum}: lower train.batch_size (or grad_accum), or give "
                            "more data")
        self.steps_per_epoch = self.per_rank // grad_accum
        self._cache: tuple[int, list[list[int]]] | None = None

    def _groups(self, epoch: int) -> list[list[int]]:
        order = list(range(self.n))
        random.Random(f"tether-pairs:{self.seed}:{epoch}").shuffle(order)
        groups = [order[k:k + self.batch_size] for k in range(0, self.n - self.batch_size + 1, self.batch_size)]
        return groups[self.rank::self.world_size][: self.per_rank]

    def fixed_batches(self) -> list[list[int]]:
        """This rank's micro-batches when compositions are fixed (``reshuffle=False``)."""
        return self._groups(0)

    def epoch(self, epoch: int) -> list[list[int]]:
        if self._cache is None or self._cache[0] != epoch:
            if self.reshuffle:
                groups = self._groups(epoch)
            else:
                groups = self._groups(0)
                random.Random(f"tether-pair-order:{self.seed}:{epoch}").shuffle(groups)
            self._cache = (epoch, groups)
        return self._cache[1]

    def for_step(self, step: int) -> list[list[int]]:
        epoch, offset = divmod(step, self.steps_per_epoch)
        return self.epoch(epoch)[offset * self.grad_accum:(offset + 1) * self.grad_accum]


def chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[k:k + size] for k in range(0, len(items), size)]
