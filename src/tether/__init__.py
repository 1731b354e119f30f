"""tether: every LLM post-training loop in one small, readable core.

The public API mirrors the command line: typed configs and one call per stage.

>>> from tether import SFTConfig, train_sft
>>> train_sft(SFTConfig(data={"path": "train.jsonl"}), out="runs/sft")  # doctest: +SKIP
"""

from __future__ import annotations

import os
from importlib import import_module
from typing import Any

# OpenMP threads that spin while waiting make a CPU oversubscribed by another process run 5-20x
# slower (measured on a 2-core machine); yielding costs ~nothing when the CPU is free. Takes
# effect only if torch is imported after tether; the user's own setting always wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

_EXPORTS = {
    "SFTConfig": "tether.trainers.sft",
    "PretrainConfig": "tether.trainers.sft",
    "SFTTrainer": "tether.trainers.sft",
    "train_sft": "tether.stages",
    "train_grpo": "tether.stages",
    "AgentConfig": "tether.trainers.agent",
    "AgentSFTConfig": "tether.trainers.agent",
    "AgentRLTrainer": "tether.trainers.agent",
    "train_agent": "tether.trainers.agent",
    "train_agent_sft": "tether.trainers.agent",
    "evaluate_agent": "tether.trainers.agent",
    "SandboxLimits": "tether.runtime.sandbox",
    "run_python": "tether.runtime.sandbox",
    "GRPOConfig": "tether.trainers.rl",
    "RLTrainer": "tether.trainers.rl",
    "train_ppo": "tether.stages",
    "PPOConfig": "tether.trainers.ppo",
    "PPOTrainer": "tether.trainers.ppo",
    "gold_reward": "tether.tasks.gold",
    "evaluate": "tether.stages",
    "run_recipe": "tether.pipeline",
    "load_recipe": "tether.pipeline",
    "load_model": "tether.models",
    "build_tiny": "tether.models",
    "get_task": "tether.tasks",
    "RewardModelConfig": "tether.trainers.reward",
    "RewardModelTrainer": "tether.trainers.reward",
    "train_reward_model": "tether.trainers.reward",
    "DPOConfig": "tether.trainers.preference",
    "PreferenceTrainer": "tether.trainers.preference",
    "train_dpo": "tether.trainers.preference",
    "write_report": "tether.report",
    "RewardModelScorer": "tether.rewards.scorer",
    "load_reward_model": "tether.models.reward_model",
    "OnlineDPOConfig": "tether.trainers.online_preference",
    "OnlinePreferenceTrainer": "tether.trainers.online_preference",
    "train_online_dpo": "tether.trainers.online_preference",
    "OpenAIEngine": "tether.rollout.openai_engine",
    "PointwiseJudge": "tether.rewards.judge",
    "PairwiseJudge": "tether.rewards.judge",
    "build_judge": "tether.rewards.judge",
    "create_app": "tether.serve",
    "generate_corpus": "tether.generation",
    "make_engine": "tether.generation",
    "read_corpus": "tether.generation",
    "FilterConfig": "tether.filtering",
    "filter_corpus": "tether.filtering",
    "build_scorer": "tether.filtering",
    "select_best": "tether.best_of_n",
    "run_best_of_n": "tether.best_of_n",
    "GenerateConfig": "tether.trainers.distill",
    "SelfDistillConfig": "tether.trainers.distill",
    "generate": "tether.trainers.distill",
    "self_distill": "tether.trainers.distill",
    "Constitution": "tether.rewards.constitution",
    "load_constitution": "tether.rewards.constitution",
    "critique_and_revise": "tether.rewards.cai",
    "preference_labels": "tether.rewards.cai",
    "judge_bias": "tether.rewards.cai",
    "SLCAIConfig": "tether.trainers.cai",
    "AILabelsConfig": "tether.trainers.cai",
    "RLAIFConfig": "tether.trainers.cai",
    "train_sl_cai": "tether.trainers.cai",
    "ai_labels": "tether.trainers.cai",
    "train_rlaif": "tether.trainers.cai",
    "SPINConfig": "tether.trainers.spin",
    "train_spin": "tether.trainers.spin",
}


def __getattr__(name: str) -> Any:
    """Lazy exports, so ``import tether`` stays fast and the CLI starts quickly."""
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tether' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
