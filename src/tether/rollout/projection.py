"""A decode step's linear projection, with its weight prepacked for the CPU matrix-product kernels.

At decode time a projection multiplies the same weight by a few dozen rows every step. The plain
``F.linear`` re-reads the weight in its stored layout each time; a weight reordered once into the
kernel's own blocked layout (MKL's packed GEMM in float32, oneDNN's in bfloat16, the layouts
``torch.compile``'s CPU freezing pass uses) is multiplied faster. Measured on this project's 2-core
CPU, the engine at batch 64 (32 new tokens, median of 5 alternating runs): the small model (hidden 512)
1.20x faster in float32, 1.10x in bfloat16, packing 21 / 15 ms per ``generate`` batch; the tiny model
(hidden 128) 0.95x, so packing is left to models whose hidden size is at least :data:`PACK_MIN_HIDDEN`.

On AMD (and Hygon) processors (:func:`~tether.models.linear.onednn_packs_float32`) the float32 weight is
packed in oneDNN's layout instead: MKL's pack gained nothing there (AVX-512 Zen 4: the small model's
512 -> 1536 projection at 64 rows 617 us plain, 614 packed by MKL, 455 packed by oneDNN; 512 -> 2816: 1138,
1209, 860; 1408 -> 512: 587, 623, 449. AVX2 Zen 3, all 8 layers' projections of one step: 32.8 ms plain,
34.1 packed by MKL, 26.2 packed by oneDNN; 2 threads, 2026-12-06).

MKL's packed float32 GEMM is tied to the row count it was packed for: when the batch changes (finished
rows dropped) the weight is packed again for the new count, or, with few steps left, multiplied plainly.
oneDNN's bfloat16 layout serves any row count. Everything else (CUDA, float16, a build without MKL or
oneDNN, bfloat16 on a processor whose instructions oneDNN's bfloat16 kernels lack, such as an AVX2-only
one: :func:`~tether.models.linear.onednn_runs`) and unpacked weights run
:func:`~tether.models.linear.onednn_linear` (``F.linear``, or oneDNN's plain product where float32 pays).
Packed products agree with ``F.linear`` to float rounding (bfloat16: identical in the tests).
"""

from __future__ import annotations

import torch

from tether.models.linear import onednn_float32_pays, onednn_linear, onednn_packs_float32, onednn_runs

PACK_MIN_HIDDEN = 512
# Repack for a new row count only when at least this many steps remain (a pack of the small model's
# weights costs about 3-4 steps of what it saves).
REPACK_MIN_STEPS = 8


def _mkl_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def packing_pays(weight: torch.Tensor, hidden_size: int) -> bool:
    """Whether decode projections of this dtype / device / model width are worth prepacking."""
    if weight.device.type != "cpu" or hidden_size < PACK_MIN_HIDDEN:
        return False
    if weight.dtype == torch.float32:
        return onednn_packs_float32() or _mkl_available()
    return weight.dtype == torch.bfloat16 and onednn_runs(torch.bfloat16)


class Projection:
    """``x @ weight.T + bias`` for 2-D ``x``; :meth:`pack` prepares the weight for ``rows`` rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.packed: torch.Tensor | None = None
        self.rows = 0  # the row count MKL's float32 pack serves (0: any, oneDNN)
        # unpacked and not on oneDNN: the product F.linear runs for a 2-D input (addmm with a bias, mm
        # without), called directly on the transposed weight, without its per-call checks and dispatches
        self.transposed = None if onednn_float32_pays(weight) else weight.t()

    def pack(self, rows: int) -> None:
        if self.weight.dtype == torch.float32 and not onednn_packs_float32():
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, rows)
            self.rows = rows
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, rows)

    def unpack(self) -> None:
        self.packed, self.rows = None, 0

    def serves(self, rows: int) -> bool:
        """Whether the packed weight multiplies ``rows`` rows (False when unpacked)."""
        return self.packed is not None and self.rows in (0, rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.serves(x.shape[0]):
            if self.transposed is not None and x.dim() == 2:
                return torch.mm(x, self.transposed) if self.bias is None else torch.addmm(self.bias, x, self.transposed)
            return onednn_linear(x, self.weight, self.bias)
        if self.rows:
            return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, self.rows)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
