"""Typed configuration, one place for every config type: pydantic models validated with clear messages.

``base`` (strict models, YAML and overrides), ``common`` (the blocks every stage shares: model,
optimiser, loop, task, evaluation), ``sampling`` (the one ``SamplingConfig``), ``data`` (where records
come from), ``rewards`` (reward specs, judges, the scorer, pairs, filters), and one module per family
of stage configs. ``core`` is the only part of tether a config imports (for registry names).

The names below load their module on first use, so ``import tether.config.base`` (the CLI does, at start)
does not import torch.
"""

from __future__ import annotations

from tether.core.lazy import lazy_exports

_EXPORTS = {
    "AILabelsConfig": "tether.config.cai",
    "AgentConfig": "tether.config.agent",
    "AgentEvalConfig": "tether.config.agent",
    "AgentLoopConfig": "tether.config.agent",
    "AgentSFTConfig": "tether.config.agent",
    "BestOfNConfig": "tether.config.distill",
    "ClipConfig": "tether.config.rl",
    "ConfigError": "tether.config.base",
    "CorpusConfig": "tether.config.cai",
    "CorpusSamplingConfig": "tether.config.distill",
    "CriticConfig": "tether.config.rl",
    "DPOConfig": "tether.config.preference",
    "DataConfig": "tether.config.data",
    "EngineConfig": "tether.config.distill",
    "EnvironmentConfig": "tether.config.agent",
    "EvalConfig": "tether.config.common",
    "EvalStageConfig": "tether.config.sft",
    "FilterConfig": "tether.config.rewards",
    "FilterStageConfig": "tether.config.distill",
    "GRPOConfig": "tether.config.rl",
    "GenerateConfig": "tether.config.distill",
    "GiGPOConfig": "tether.config.agent",
    "GoldDataConfig": "tether.config.rlhf",
    "JudgeConfig": "tether.config.rewards",
    "JudgeDataConfig": "tether.config.preference",
    "JudgeEvalConfig": "tether.config.preference",
    "PolicyPairsConfig": "tether.config.preference",
    "KLConfig": "tether.config.rl",
    "LoopConfig": "tether.config.common",
    "LoraConfig": "tether.config.common",
    "MixSource": "tether.config.data",
    "ModelConfig": "tether.config.common",
    "OnlineDPOConfig": "tether.config.preference",
    "OptimConfig": "tether.config.common",
    "OverOptimizationConfig": "tether.config.rlhf",
    "PPOConfig": "tether.config.rl",
    "PairConfig": "tether.config.rewards",
    "PairDataConfig": "tether.config.data",
    "PreferenceDataConfig": "tether.config.data",
    "PreferenceLossConfig": "tether.config.preference",
    "PreferenceTaskSource": "tether.config.data",
    "PretrainConfig": "tether.config.sft",
    "PromptDataConfig": "tether.config.data",
    "RLAIFConfig": "tether.config.cai",
    "RLConfig": "tether.config.rl",
    "RewardModelConfig": "tether.config.preference",
    "RewardRoute": "tether.config.rewards",
    "RewardRoutes": "tether.config.rewards",
    "RewardSpec": "tether.config.rewards",
    "RolloutConfig": "tether.config.rl",
    "SFTConfig": "tether.config.sft",
    "SLCAIConfig": "tether.config.cai",
    "SPINConfig": "tether.config.preference",
    "SamplingConfig": "tether.config.sampling",
    "SamplingParams": "tether.config.sampling",
    "ScoredPairsConfig": "tether.config.rewards",
    "ScorerConfig": "tether.config.rewards",
    "SelfDistillConfig": "tether.config.distill",
    "StageConfig": "tether.config.common",
    "StrictModel": "tether.config.base",
    "TaskSource": "tether.config.common",
    "TaskSpec": "tether.config.common",
    "apply_override": "tether.config.base",
    "deep_merge": "tether.config.base",
    "known_name": "tether.config.base",
    "load_yaml": "tether.config.base",
    "parse_overrides": "tether.config.base",
    "parse_value": "tether.config.base",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
