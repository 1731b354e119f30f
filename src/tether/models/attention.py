"""Which attention kernel a forward runs, and the training forward's bfloat16 autocast.

Under ``train.precision: bf16-mixed`` every training forward runs in ``torch.autocast(dtype=bfloat16)``
(Micikevicius et al. 2018, "Mixed Precision Training": float32 master weights, low-precision products).
On a CPU the fused SDPA kernel (flash attention for CPU) is fast in bfloat16 forward but slow in bfloat16
backward, while attention as two matrix products and a softmax is the other way round. Measured on the
2-core development CPU (2026-12-04; one forward and backward of 32 packed sequences of 30-90 tokens, median
of 5): transformers' ``eager`` 96 against 138 ms on the tiny model, 680 against 848 ms on the small one;
forward alone ``sdpa`` is faster (28 against 46 ms, 207 against 249). So :func:`training_autocast`
switches an ``sdpa`` model to :func:`matmul_attention` on a CPU in bfloat16, and :func:`matmul_attention_pays`
gives cascade attention the same rule. Inside :func:`training_autocast` that holds without gradients too: the
frozen passes (reference, old-policy, critic values) must run the training forward's kernels, or a policy
equal to its reference does not score exactly 0 (bfloat16 SDPA and matrix products round differently: up to
9e-3 nats per token on the small model, and DPO's first-step rewards came out nonzero). Outside it (a
bfloat16 model decoding or evaluating) a forward without gradients keeps SDPA. In float32 and on GPUs
nothing changes.

:func:`matmul_attention` differs from ``eager`` in one way: its softmax runs in the scores' precision.
``eager`` adds a float32 mask to bfloat16 scores, takes a float32 softmax and casts the probabilities back,
four full passes over the (batch, heads, query, key) scores that cost more than the two matrix products
(2026-12-05, small model, bf16-mixed SFT: a quarter of the step). The CPU softmax kernel computes in float32
internally and rounds once on output, so the probabilities are the ones ``eager`` rounds to bfloat16; its
backward rounds the scores' gradient to bfloat16, which the following matrix-product backward does anyway.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

MATMUL_ATTENTION = "tether_matmul"
LOW_PRECISION = (torch.bfloat16, torch.float16)
_TRAINING_FORWARD: ContextVar[bool] = ContextVar("tether_training_forward", default=False)


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


def matmul_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float | None = None, dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention (Vaswani et al. 2017, eq. 1), ``softmax(Q K^T / sqrt(d) + M) V``, as two
    matrix products and a softmax in the scores' own precision. ``query`` (B, H, Lq, D), ``key`` / ``value``
    (B, H_kv, Lk, D) with H a multiple of H_kv (grouped-query attention, Ainslie et al. 2023); ``mask``
    broadcastable to (B, H, Lq, Lk), boolean (True: attend) or additive float. Returns the output
    (B, H, Lq, D) and the attention probabilities."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = (query * (query.shape[-1] ** -0.5 if scale is None else scale)) @ key.transpose(-1, -2)
    if mask is not None:
        lowest = torch.finfo(scores.dtype).min  # finite: a query that sees no key gets uniform weights, not NaN
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, lowest)
        else:
            scores = scores + mask.clamp(min=lowest).to(scores.dtype)
    weights = scores.softmax(-1)
    if dropout_p:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ value, weights


def matmul_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None,
                             dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`matmul_attention` as a transformers attention function (returns the output as (B, L, H, D))."""
    out, weights = matmul_attention(query, key, value, attention_mask, scaling, dropout if module.training else 0.0)
    return out.transpose(1, 2).contiguous(), weights


AttentionInterface.register(MATMUL_ATTENTION, matmul_attention_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(MATMUL_ATTENTION, eager_mask)  # a full additive mask, never skipped


def matmul_attention_pays(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a forward runs attention as matrix products rather than the fused SDPA kernel: on a CPU, in
    16-bit precision, with gradients enabled or inside :func:`training_autocast` (a frozen pass runs the
    training forward's kernels; see the module docstring for the measurement)."""
    return device.type == "cpu" and dtype in LOW_PRECISION and (torch.is_grad_enabled() or _TRAINING_FORWARD.get())


def _sdpa_models(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformers models inside ``model`` (itself, a DDP or PEFT wrapper's, both parts of an
    actor-critic) whose attention is ``sdpa``, one per config."""
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and getattr(module.config, "_attn_implementation", None) == "sdpa":
            found.setdefault(id(module.config), module)
    return list(found.values())


@contextmanager
def training_autocast(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """bfloat16 autocast on ``device``; on a CPU every ``sdpa`` model inside ``model`` runs
    :func:`matmul_attention`, with or without gradients, so that a frozen pass computes what the training
    forward computes."""
    token = _TRAINING_FORWARD.set(True)
    try:
        with ExitStack() as stack:
            if matmul_attention_pays(device, torch.bfloat16):
                for inner in _sdpa_models(model):
                    stack.enter_context(attention_implementation(inner, MATMUL_ATTENTION))
            stack.enter_context(torch.autocast(device_type=device.type, dtype=torch.bfloat16))
            yield
    finally:
        _TRAINING_FORWARD.reset(token)
