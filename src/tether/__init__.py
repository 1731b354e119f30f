"""tether: every LLM post-training loop in one small, readable core.

The public API mirrors the command line: typed configs and one call per stage.

>>> from tether import SFTConfig, train_sft
>>> train_sft(SFTConfig(data={"path": "train.jsonl"}), out="runs/sft")  # doctest: +SKIP
"""

from __future__ import annotations

import os

from tether.core.lazy import lazy_exports

# OpenMP threads that spin while waiting make a CPU oversubscribed by another process run 5-20x
# slower (measured on a 2-core machine); yielding costs ~nothing when the CPU is free. Takes
# effect only if torch is imported after tether; the user's own setting always wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

_EXPORTS = {
    "SFTConfig": "tether.config",
    "PretrainConfig": "tether.config",
    "GRPOConfig": "tether.config",
    "PPOConfig": "tether.config",
    "DPOConfig": "tether.config",
    "RewardModelConfig": "tether.config",
    "OnlineDPOConfig": "tether.config",
    "SPINConfig": "tether.config",
    "AgentConfig": "tether.config",
    "AgentSFTConfig": "tether.config",
    "GenerateConfig": "tether.config",
    "SelfDistillConfig": "tether.config",
    "FilterConfig": "tether.config",
    "SLCAIConfig": "tether.config",
    "AILabelsConfig": "tether.config",
    "RLAIFConfig": "tether.config",
    "JudgeConfig": "tether.config",
    "ScorerConfig": "tether.config",
    "RewardSpec": "tether.config",
    "SamplingConfig": "tether.config",
    "EvalConfig": "tether.config",
    "ModelConfig": "tether.config",
    "TaskSource": "tether.config",
    "TaskSpec": "tether.config",
    "StageConfig": "tether.config",
    "SFTTrainer": "tether.trainers.sft",
    "RLTrainer": "tether.trainers.rl",
    "RLBatch": "tether.trainers.rl",
    "PPOTrainer": "tether.trainers.ppo",
    "AgentRLTrainer": "tether.trainers.agent",
    "RewardModelTrainer": "tether.trainers.reward",
    "PreferenceTrainer": "tether.trainers.preference",
    "OnlinePreferenceTrainer": "tether.trainers.online_preference",
    "SPINTrainer": "tether.trainers.online_preference",
    "train_sft": "tether.stages",
    "train_grpo": "tether.stages",
    "train_ppo": "tether.stages",
    "train_dpo": "tether.stages",
    "train_reward_model": "tether.stages",
    "train_online_dpo": "tether.stages",
    "train_spin": "tether.stages",
    "train_agent": "tether.stages",
    "train_agent_sft": "tether.stages",
    "evaluate": "tether.stages",
    "run_recipe": "tether.stages",
    "load_recipe": "tether.stages",
    "generate": "tether.stages.distill",
    "self_distill": "tether.stages.distill",
    "train_sl_cai": "tether.stages.cai",
    "ai_labels": "tether.stages.cai",
    "train_rlaif": "tether.stages.cai",
    "evaluate_agent": "tether.evaluation",
    "load_model": "tether.models",
    "build_tiny": "tether.models",
    "get_task": "tether.tasks",
    "gold_reward": "tether.tasks.gold",
    "load_reward_model": "tether.models.reward_model",
    "RewardModelScorer": "tether.rewards.scorer",
    "PointwiseJudge": "tether.rewards.judge",
    "PairwiseJudge": "tether.rewards.judge",
    "build_judge": "tether.scoring",
    "Scorer": "tether.scoring",
    "build_scorer": "tether.scoring",
    "Constitution": "tether.rewards.constitution",
    "load_constitution": "tether.rewards.constitution",
    "critique_and_revise": "tether.rewards.cai",
    "preference_labels": "tether.rewards.cai",
    "judge_bias": "tether.rewards.cai",
    "SandboxLimits": "tether.runtime.sandbox",
    "run_python": "tether.runtime.sandbox",
    "OpenAIEngine": "tether.rollout.openai_engine",
    "create_app": "tether.serve",
    "generate_corpus": "tether.generation",
    "make_engine": "tether.generation",
    "read_corpus": "tether.generation",
    "filter_corpus": "tether.filtering",
    "select_best": "tether.best_of_n",
    "run_best_of_n": "tether.best_of_n",
    "write_report": "tether.report",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
