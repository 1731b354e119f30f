"""Rank awareness for the shared loop: works unchanged in one process and under torchrun."""

from __future__ import annotations

import atexit
import datetime
import os
from dataclasses import dataclass
from typing import Any

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


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_distributed(*, timeout_minutes: float = 30.0) -> DistInfo:
    """Join the process group ``torchrun`` describes in the environment, once; nothing in a plain process.

    Backend: gloo on CPU; with CUDA, NCCL for GPU tensors and gloo for the CPU ones (the loop's
    counts and metrics), and this rank's GPU (``LOCAL_RANK``) made the current device.
    """
    if dist.is_available() and not dist.is_initialized() and launched_by_torchrun():
        backend = "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            backend = "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))
        atexit.register(_destroy)
    return DistInfo.current()


def _destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order; ``[value]`` in a single process."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def reduce_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """One value per metric for the whole job: the mean over the ranks that report it, the maximum for
    keys ending ``_max`` and the minimum for ``_min``. Collective; the metrics themselves in one process.

    A loss the loop reports is each rank's share of the global mean times the world size, so the
    mean over ranks is the global loss, as in a single process.
    """
    from tether.trainers.metrics import to_float

    local = {k: to_float(v) for k, v in metrics.items()}
    if DistInfo.current().world_size == 1:
        return local
    out: dict[str, float] = {}
    gathered = all_gather_objects(local)
    for key in dict.fromkeys(k for rank in gathered for k in rank):
        values = [rank[key] for rank in gathered if key in rank]
        if key.endswith("_max"):
            out[key] = max(values)
        elif key.endswith("_min"):
            out[key] = min(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def all_gather_rows(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's tensor of shape (N_r, *rest): rows may differ per rank, and trailing dimensions too
    (each is zero-padded to the largest, then cut back). ``[tensor]`` in a single process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [tensor]
    shapes = all_gather_objects(tuple(tensor.shape))
    full = [max(s[d] for s in shapes) for d in range(tensor.dim())]
    padded = tensor.new_zeros(full)
    padded[tuple(slice(0, n) for n in tensor.shape)] = tensor
    out = [torch.empty_like(padded) for _ in shapes]
    dist.all_gather(out, padded)
    return [t[tuple(slice(0, n) for n in shape)] for t, shape in zip(out, shapes, strict=True)]
