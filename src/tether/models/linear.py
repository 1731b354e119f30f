"""Float32 linear layers on oneDNN's matrix-product kernel, on the processors where MKL's is the slower one.

PyTorch multiplies float32 matrices on a CPU with MKL's ``sgemm``. MKL picks its code path by processor
vendor, and on AMD processors it does not run its AVX-512 kernels; oneDNN (also inside every x86 PyTorch
build, the library its bfloat16 products already use) picks by instruction set. Measured on the project's
2-core AMD EPYC (AVX-512, 2026-12-06, 2 threads, median of 20-30 calls): a (2048 x 512) x (512 x 1536)
product 164 against 213 GFLOP/s, (2048 x 1408) x (1408 x 512) 190 against 214, the same products' input
gradient (``grad @ W``) 186 / 188 against 211 / 212; the weight gradient (``grad^T @ x``, both operands
transposed) was not faster on oneDNN (193 against 164, 189 against 194), so it stays on MKL. At the tiny
model's width (128) the two were within 10% either way, so only layers with at least
:data:`ONEDNN_MIN_FEATURES` input features switch, and the tiny model's figures do not move.

:func:`onednn_linears` switches every plain ``nn.Linear`` of a model whose float32 CPU weight qualifies,
for the length of a block: the trainers enter it for the training forward and the frozen passes
(:meth:`~tether.trainers.loop.Trainer.training_forward`, so a policy equal to its reference still scores
exactly 0), and the rollout engine for the prefill. Outside it (and under autocast, on GPUs, on Intel
processors, in other dtypes, for subclasses such as quantised linears, and for modules whose ``forward`` is
already replaced, e.g. by accelerate's hooks) ``nn.Linear`` runs as PyTorch ships it. The two kernels round
differently (products agree to float32 rounding), so runs on an AMD processor are repeatable on it but do
not reproduce an Intel processor's bit for bit, which no float32 GEMM choice would.
"""

from __future__ import annotations

import functools
import platform
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ONEDNN_MIN_FEATURES = 512
CPUINFO = Path("/proc/cpuinfo")
_VENDORS_MKL_UNDERSERVES = ("AuthenticAMD", "HygonGenuine")  # MKL picks slower code paths on these


def cpuinfo_field(name: str) -> str:
    """The first value of field ``name`` (``vendor_id``, ``model name``, ``model``: the whole key, so ``model``
    is not ``model name``) in ``/proc/cpuinfo``, or "" where there is none."""
    try:
        for line in CPUINFO.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return ""


@functools.cache
def cpu_vendor() -> str:
    """The x86 vendor string of this machine (``AuthenticAMD``, ``GenuineIntel``), or "" where unknown."""
    return cpuinfo_field("vendor_id")


def onednn_available() -> bool:
    """Whether this PyTorch build carries oneDNN's linear kernel (``torch.ops.mkldnn._linear_pointwise``)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def cpu_multiplies_bfloat16() -> bool:
    """Whether this CPU has bfloat16 matrix instructions (x86 AVX-512 BF16 or AMX; Arm's BF16 extension, which
    oneDNN's bfloat16 kernels report there). Without them PyTorch emulates bfloat16 products: on an AVX2 AMD
    EPYC (Zen 3, 2 threads) 18-21 GFLOP/s against 150-168 in float32 for the small model's shapes."""
    if any(getattr(torch.cpu, probe, lambda: False)() for probe in ("_is_avx512_bf16_supported",
                                                                    "_is_amx_tile_supported")):
        return True
    return platform.machine().lower() in ("arm64", "aarch64") and onednn_runs(torch.bfloat16)


@functools.cache
def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear kernels (the prepacked weight and the product) run ``dtype`` on this processor.

    float32 runs wherever oneDNN is built in; bfloat16 needs AVX-512 (BW, VL, DQ), AVX-NE-CONVERT or Arm's
    BF16 instructions, and without them oneDNN refuses the product ("bf16 path needs the cpu support ..."):
    an AVX2 processor such as an AMD EPYC of the Zen 3 generation. Probed once with a small product."""
    if not onednn_available():
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype), 4)
        torch.ops.mkldnn._linear_pointwise(torch.ones(4, 8, dtype=dtype), packed, None, "none", [], "")
    except (RuntimeError, AttributeError):  # refused here, or a build without the prepacking op
        return False
    return True


@functools.cache
def _onednn_beats_mkl() -> bool:
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and onednn_packs_float32()


@functools.cache
def onednn_packs_float32() -> bool:
    """Whether float32 weights prepacked in oneDNN's layout multiply a decode step's few dozen rows faster than
    in MKL's packed layout: on AMD (and Hygon) processors, with or without AVX-512. Measured with the small
    model's 8 layers of decode projections at 64 rows, 2 threads: Zen 4 (AVX-512) 455 against 614 us for
    512 -> 1536; Zen 3 (AVX2) 26.2 against 34.1 ms per step (MKL's pack there no faster than a plain
    product, 32.8 ms). At 2048 rows Zen 3's two kernels are on par, so :func:`onednn_float32_pays`, the rule
    for training products, still asks for AVX-512."""
    return onednn_runs(torch.float32) and cpu_vendor() in _VENDORS_MKL_UNDERSERVES


def onednn_float32_pays(weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` is faster on oneDNN than on PyTorch's default float32 kernel: a float32 CPU
    weight with at least :data:`ONEDNN_MIN_FEATURES` input features, on an AVX-512 processor whose vendor
    MKL does not run its AVX-512 code for."""
    return (_onednn_beats_mkl() and type(weight) in (torch.Tensor, nn.Parameter) and weight.device.type == "cpu"
            and weight.dtype == torch.float32 and weight.dim() == 2 and weight.shape[1] >= ONEDNN_MIN_FEATURES)


def _onednn_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


class OneDnnLinear(torch.autograd.Function):
    """``y = x W^T + b`` with the forward and the input gradient ``dy W`` on oneDNN, the weight gradient
    ``dy^T x`` and the bias gradient on PyTorch's own kernels."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return _onednn_product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn_product(grad, weight.t(), None)
        if ctx.needs_input_grad[1]:
            grad_weight = flat.t() @ x.reshape(-1, x.shape[-1])
        if ctx.needs_input_grad[2]:
            grad_bias = flat.sum(0)
        return grad_x, grad_weight, grad_bias


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on oneDNN (with gradients through :class:`OneDnnLinear`); ``F.linear`` itself where the
    weight does not qualify (:func:`onednn_float32_pays`), for inputs of another dtype, or under autocast."""
    if (not onednn_float32_pays(weight) or x.dtype != torch.float32 or torch.is_autocast_enabled("cpu")
            or (bias is not None and bias.dtype != torch.float32)):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return OneDnnLinear.apply(x, weight, bias)
    return _onednn_product(x, weight, bias)


def _onednn_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return onednn_linear(x, self.weight, self.bias)


@contextmanager
def onednn_linears(model: nn.Module) -> Iterator[int]:
    """Inside the block, every plain ``nn.Linear`` of ``model`` whose weight qualifies
    (:func:`onednn_float32_pays`) multiplies on oneDNN; yields how many switched. Restored on exit. Where
    oneDNN does not beat PyTorch's kernel (Intel processors, builds without it) the model is not walked."""
    switched = []
    if _onednn_beats_mkl():
        switched = [module for module in model.modules() if type(module) is nn.Linear
                    and "forward" not in module.__dict__ and onednn_float32_pays(module.weight)]
    for module in switched:
        module.forward = types.MethodType(_onednn_forward, module)
    try:
        yield len(switched)
    finally:
        for module in switched:
            if getattr(module.__dict__.get("forward"), "__func__", None) is _onednn_forward:
                del module.forward
