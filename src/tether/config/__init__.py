"""Typed configuration, one place for every config type: pydantic models validated with clear messages.

``base`` (strict models, YAML and overrides), ``common`` (the blocks every stage shares: model,
optimiser, loop, task, evaluation), ``sampling`` (the one ``SamplingConfig``), ``data`` (where records
come from), ``rewards`` (reward specs, judges, the scorer, pairs, filters), and one module per family
of stage configs. ``core`` is the only part of tether a config imports (for registry names).
"""

from tether.config.agent import (
    AgentConfig,
    AgentEvalConfig,
    AgentLoopConfig,
    AgentSFTConfig,
    EnvironmentConfig,
    GiGPOConfig,
)
from tether.config.base import (
    ConfigError,
    StrictModel,
    apply_override,
    deep_merge,
    known_name,
    load_yaml,
    parse_overrides,
    parse_value,
)
from tether.config.cai import AILabelsConfig, CorpusConfig, RLAIFConfig, SLCAIConfig
from tether.config.common import (
    EvalConfig,
    LoopConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    StageConfig,
    TaskSource,
    TaskSpec,
)
from tether.config.data import (
    DataConfig,
    PairDataConfig,
    PreferenceDataConfig,
    PreferenceTaskSource,
    PromptDataConfig,
)
from tether.config.distill import (
    BestOfNConfig,
    CorpusSamplingConfig,
    EngineConfig,
    FilterStageConfig,
    GenerateConfig,
    SelfDistillConfig,
)
from tether.config.preference import (
    DPOConfig,
    JudgeDataConfig,
    OnlineDPOConfig,
    PreferenceLossConfig,
    RewardModelConfig,
    SPINConfig,
)
from tether.config.rewards import (
    FilterConfig,
    JudgeConfig,
    PairConfig,
    RewardSpec,
    ScoredPairsConfig,
    ScorerConfig,
)
from tether.config.rl import (
    ClipConfig,
    CriticConfig,
    GRPOConfig,
    KLConfig,
    PPOConfig,
    RLConfig,
    RolloutConfig,
)
from tether.config.rlhf import GoldDataConfig, OverOptimizationConfig
from tether.config.sampling import SamplingConfig, SamplingParams
from tether.config.sft import EvalStageConfig, PretrainConfig, SFTConfig

__all__ = [
    "AILabelsConfig",
    "AgentConfig",
    "AgentEvalConfig",
    "AgentLoopConfig",
    "AgentSFTConfig",
    "BestOfNConfig",
    "ClipConfig",
    "ConfigError",
    "CorpusConfig",
    "CorpusSamplingConfig",
    "CriticConfig",
    "DPOConfig",
    "DataConfig",
    "EngineConfig",
    "EnvironmentConfig",
    "EvalConfig",
    "EvalStageConfig",
    "FilterConfig",
    "FilterStageConfig",
    "GRPOConfig",
    "GenerateConfig",
    "GiGPOConfig",
    "GoldDataConfig",
    "JudgeConfig",
    "JudgeDataConfig",
    "KLConfig",
    "LoopConfig",
    "LoraConfig",
    "ModelConfig",
    "OnlineDPOConfig",
    "OptimConfig",
    "OverOptimizationConfig",
    "PPOConfig",
    "PairConfig",
    "PairDataConfig",
    "PreferenceDataConfig",
    "PreferenceLossConfig",
    "PreferenceTaskSource",
    "PretrainConfig",
    "PromptDataConfig",
    "RLAIFConfig",
    "RLConfig",
    "RewardModelConfig",
    "RewardSpec",
    "RolloutConfig",
    "SFTConfig",
    "SLCAIConfig",
    "SPINConfig",
    "SamplingConfig",
    "SamplingParams",
    "ScoredPairsConfig",
    "ScorerConfig",
    "SelfDistillConfig",
    "StageConfig",
    "StrictModel",
    "TaskSource",
    "TaskSpec",
    "apply_override",
    "deep_merge",
    "known_name",
    "load_yaml",
    "parse_overrides",
    "parse_value",
]
