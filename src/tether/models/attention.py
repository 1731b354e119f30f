"""Which attention kernel a forward runs, and the training forward's bfloat16 autocast.

Under ``train.precision: bf16-mixed`` every training forward runs in ``torch.autocast(dtype=bfloat16)``
(Micikevicius et al. 2018, "Mixed Precision Training": float32 master weights, low-precision products).
On a CPU the fused SDPA kernel (flash attention for CPU) is fast in bfloat16 forward but slow in bfloat16
backward, while attention as two matrix products and a float32 softmax (transformers' ``eager``) is the
other way round. Measured on the 2-core development CPU (2026-12-04; one forward and backward of 32
packed sequences of 30-90 tokens, median of 5): ``eager`` 96 against 138 ms on the tiny model, 680
against 848 ms on the small one; forward alone ``sdpa`` is faster (28 against 46 ms, 207 against 249).
So :func:`training_autocast` switches an ``sdpa`` model to ``eager`` only on a CPU, in bfloat16, while
gradients are taken, and :func:`matmul_attention_pays` gives cascade attention the same rule. In float32
and on GPUs nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


@contextmanager
def attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Run ``model`` with the registered transformers attention function ``name`` inside the block."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


def matmul_attention_pays(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether attention as matrix products beats the fused SDPA kernel here: on a CPU, in 16-bit
    precision, with gradients enabled (see the module docstring for the measurement)."""
    return device.type == "cpu" and dtype in LOW_PRECISION and torch.is_grad_enabled()


@contextmanager
def training_autocast(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """bfloat16 autocast on ``device``; on a CPU with gradients enabled, an ``sdpa`` model runs ``eager``."""
    inner = getattr(model, "module", model)  # DistributedDataParallel keeps the model in .module
    config = getattr(inner, "config", None)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        if matmul_attention_pays(device, torch.bfloat16) and getattr(config, "_attn_implementation", None) == "sdpa":
            with attention_implementation(inner, "eager"):
                yield
        else:
            yield
