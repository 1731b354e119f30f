"""Rank awareness for the shared loop: works unchanged in one process and under torchrun."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def current(cls) -> DistInfo:
        if dist.is_available() and dist.is_initialized():
            return cls(rank=dist.get_rank(), world_size=dist.get_world_size())
        return cls()


def all_reduce_sum(value: float | torch.Tensor) -> torch.Tensor:
    """Sum a number over all ranks (the number itself in a single process)."""
    tensor = torch.as_tensor(value, dtype=torch.float64).clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_mean(value: float | torch.Tensor) -> torch.Tensor:
    return all_reduce_sum(value) / DistInfo.current().world_size


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
