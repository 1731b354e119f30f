"""tether: every LLM post-training loop in one small, readable core.

The public API mirrors the command line: typed configs and one call per stage.

>>> from tether import SFTConfig, train_sft
>>> train_sft(SFTConfig(data={"path": "train.jsonl"}), out="runs/sft")  # doctest: +SKIP
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "SFTConfig": "tether.trainers.sft",
    "PretrainConfig": "tether.trainers.sft",
    "SFTTrainer": "tether.trainers.sft",
    "train_sft": "tether.stages",
    "train_grpo": "tether.stages",
    "GRPOConfig": "tether.trainers.rl",
    "RLTrainer": "tether.trainers.rl",
    "evaluate": "tether.stages",
    "run_recipe": "tether.pipeline",
    "load_recipe": "tether.pipeline",
    "load_model": "tether.models",
    "build_tiny": "tether.models",
    "get_task": "tether.tasks",
}


def __getattr__(name: str) -> Any:
    """Lazy exports, so ``import tether`` stays fast and the CLI starts quickly."""
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tether' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
