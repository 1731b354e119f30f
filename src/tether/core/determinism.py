"""What ``tether run --deterministic`` switches on beyond the reproducibility every run has.

By default a run is a pure function of its resolved configuration (seeds and ``train.threads``
included), the hardware and the library versions, at one CPU thread: tether seeds every random
choice from the config and consumes parallel work in a fixed order. ``--deterministic`` adds:

- ``torch.use_deterministic_algorithms(True)``: on GPU, kernels that accumulate with atomics are
  replaced by deterministic ones (an operation that has none raises), with the cuBLAS workspace
  setting it needs (``CUBLAS_WORKSPACE_CONFIG=:4096:8``) and cuDNN benchmarking off;
- ``MKL_CBWR=COMPATIBLE`` and ``MKL_DYNAMIC=FALSE``: MKL keeps one code path and its thread count
  (Intel's conditional numerical reproducibility, meant to give the same rounding on any x86 CPU
  kind). MKL reads them when torch loads, so they only take effect when set before the first import
  of torch, and they make float32 matrix products slower;
- a refusal to train on CPU with more than one thread: measured on this project's machine, two runs
  of the same GRPO steps at 2 threads end on different weights even with ``MKL_CBWR=COMPATIBLE``.
"""

from __future__ import annotations

import os
import sys

DETERMINISTIC_ENVIRONMENT = {"MKL_CBWR": "COMPATIBLE", "MKL_DYNAMIC": "FALSE", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def enable_determinism() -> list[str]:
    """Set :data:`DETERMINISTIC_ENVIRONMENT` and turn on torch's deterministic algorithms; returns a warning
    for each setting that could not take effect (MKL's, when torch was imported before this call)."""
    warnings = []
    if "torch" in sys.modules and any(os.environ.get(k) != DETERMINISTIC_ENVIRONMENT[k]
                                      for k in ("MKL_CBWR", "MKL_DYNAMIC")):
        warnings.append("torch was imported before --deterministic, so MKL_CBWR=COMPATIBLE and MKL_DYNAMIC=FALSE "
                        "do not apply; set them in the environment before Python starts")
    for key, value in DETERMINISTIC_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    import torch

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    return warnings


def check_deterministic_threads(threads: int, device: str) -> None:
    """Under deterministic algorithms, refuse CPU training with more than one thread (not bitwise
    repeatable; see the module docstring)."""
    import torch

    if torch.are_deterministic_algorithms_enabled() and threads > 1 and not device.startswith(("cuda", "auto")):
        raise ValueError(f"--deterministic: train.threads={threads} on CPU is not bitwise reproducible between "
                         "processes; set *.train.threads=1")
