"""The optimiser side of a step: AdamW with weight decay on matrices only, the learning-rate schedule, and
gradient clipping that leaves a non-finite gradient as it was for the diagnostic."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from tether.config.base import ConfigError
from tether.config.common import OptimConfig
from tether.trainers.metrics import to_float


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """The total gradient norm, clipping to ``max_norm`` only when it is finite, so that a non-finite
    gradient stays as it was for the diagnostic (the step is skipped anyway)."""
    utils = torch.nn.utils
    if not hasattr(utils, "clip_grads_with_norm_"):  # torch < 2.6
        return to_float(utils.clip_grad_norm_(params, max_norm))
    total = utils.get_total_norm([p.grad for p in params if p.grad is not None])
    norm = to_float(total)
    if math.isfinite(norm):
        utils.clip_grads_with_norm_(params, max_norm, total)
    return norm


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, *,
                    parts: list[tuple[Iterable[torch.nn.Parameter], float]] | None = None) -> torch.optim.Optimizer:
    """AdamW, weight decay on matrices only. ``parts``: (parameters, learning rate) pairs giving parts
    of the model their own rate (PPO's critic); default the whole model at ``cfg.lr``."""
    groups = []
    for part, lr in parts or [(model.parameters(), cfg.lr)]:
        params = [p for p in part if p.requires_grad]
        groups += [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay, "lr": lr},
                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr": lr}]
    if not any(g["params"] for g in groups):
        raise ConfigError("the model has no trainable parameters")
    fused = cfg.fused and all(_fusable(p) for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **{"fused" if fused else "foreach": True})


def _fusable(param: torch.nn.Parameter) -> bool:
    """Whether the fused AdamW kernel takes ``param``: a plain (not sharded) floating tensor on CPU or
    CUDA (``optim.fused``; elsewhere the multi-tensor AdamW runs instead)."""
    return (type(param.data) is torch.Tensor and param.is_floating_point()
            and param.device.type in ("cpu", "cuda"))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    warmup = cfg.warmup_steps or int(cfg.warmup_ratio * total_steps)
    if cfg.schedule == "cosine":
        return get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, total_steps,
                                                           min_lr_rate=cfg.min_lr_ratio)
    if cfg.schedule == "linear":
        return get_linear_schedule_with_warmup(optimizer, warmup, total_steps)
    return get_constant_schedule_with_warmup(optimizer, warmup)
