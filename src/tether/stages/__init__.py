"""Stages: the stage table, each stage's glue, the recipe runner and the one-call public API.

- :mod:`~tether.stages.registry`: every stage type, its config class and what runs it (an explicit table);
- :mod:`~tether.stages.api`: ``train_sft``, ``train_grpo``, ... (one stage each, for a notebook);
- :mod:`~tether.stages.recipes` / :mod:`~tether.stages.pipeline`: recipe files and overrides; validating
  and running them (stages in order, ``@stage`` references, resume);
- :mod:`~tether.stages.rlhf`, :mod:`~tether.stages.cai`, :mod:`~tether.stages.distill`,
  :mod:`~tether.stages.judge_data`: the stages that are more than one trainer (sweeps, data writers,
  rounds of generate -> filter -> SFT).
"""

from __future__ import annotations

from tether.core.lazy import lazy_exports

_EXPORTS = {
    "STAGE_TYPES": "tether.stages.registry",
    "StageType": "tether.stages.registry",
    "evaluate": "tether.stages.api",
    "load_recipe": "tether.stages.recipes",
    "run_recipe": "tether.stages.pipeline",
    "run_trainer": "tether.stages.api",
    "train_agent": "tether.stages.api",
    "train_agent_sft": "tether.stages.api",
    "train_dpo": "tether.stages.api",
    "train_grpo": "tether.stages.api",
    "train_online_dpo": "tether.stages.api",
    "train_ppo": "tether.stages.api",
    "train_reward_model": "tether.stages.api",
    "train_sft": "tether.stages.api",
    "train_spin": "tether.stages.api",
    "validate_recipe": "tether.stages.pipeline",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
