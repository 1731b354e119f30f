"""Stages: the stage table, each stage's glue, the recipe runner and the one-call public API.

- :mod:`~tether.stages.registry`: every stage type, its config class and what runs it (an explicit table);
- :mod:`~tether.stages.api`: ``train_sft``, ``train_grpo``, ... (one stage each, for a notebook);
- :mod:`~tether.stages.pipeline`: recipes (stages in order, ``@stage`` references, resume);
- :mod:`~tether.stages.rlhf`, :mod:`~tether.stages.cai`, :mod:`~tether.stages.distill`,
  :mod:`~tether.stages.judge_data`: the stages that are more than one trainer (sweeps, data writers,
  rounds of generate -> filter -> SFT).
"""

from tether.stages.api import (
    evaluate,
    run_trainer,
    train_agent,
    train_agent_sft,
    train_dpo,
    train_grpo,
    train_online_dpo,
    train_ppo,
    train_reward_model,
    train_sft,
    train_spin,
)
from tether.stages.pipeline import load_recipe, run_recipe, validate_recipe
from tether.stages.registry import STAGE_TYPES, StageType

__all__ = [
    "STAGE_TYPES",
    "StageType",
    "evaluate",
    "load_recipe",
    "run_recipe",
    "run_trainer",
    "train_agent",
    "train_agent_sft",
    "train_dpo",
    "train_grpo",
    "train_online_dpo",
    "train_ppo",
    "train_reward_model",
    "train_sft",
    "train_spin",
    "validate_recipe",
]
