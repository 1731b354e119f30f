"""What ``tether run --deterministic`` switches on beyond the reproducibility every run has.

By default a run is a pure function of its resolved configuration (seeds and ``train.threads``
included), the hardware and the library versions: tether seeds every random choice from the config and
consumes parallel work in a fixed order. Two things can still make the same configuration differ
bitwise between two processes, and this module turns both off:

- on CPU, MKL's GEMM with more than one thread picks its code path (and so its rounding) at run time;
  ``MKL_CBWR=COMPATIBLE`` (Intel's Conditional Numerical Reproducibility) pins it. It only takes effect
  when set before ``torch`` is first imported, and makes float32 matrix products several times slower.
- on GPU, some kernels accumulate with atomics; ``torch.use_deterministic_algorithms(True)`` picks
  deterministic ones (raising on an operation that has none) and cuBLAS needs
  ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` for it.
"""

from __future__ import annotations

import os
import sys

DETERMINISTIC_ENVIRONMENT = {"MKL_CBWR": "COMPATIBLE", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def enable_determinism() -> list[str]:
    """Set :data:`DETERMINISTIC_ENVIRONMENT` and turn on torch's deterministic algorithms; returns a warning
    for each setting that could not take effect (MKL's, when torch was imported before this call)."""
    warnings = []
    if "torch" in sys.modules and os.environ.get("MKL_CBWR") != DETERMINISTIC_ENVIRONMENT["MKL_CBWR"]:
        warnings.append("torch was imported before --deterministic: MKL_CBWR=COMPATIBLE needs setting in the "
                        "environment before Python starts for multi-threaded CPU runs to be bitwise reproducible")
    for key, value in DETERMINISTIC_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    import torch

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    return warnings
