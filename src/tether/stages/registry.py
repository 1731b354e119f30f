"""The stage table: every stage type a recipe (or ``tether <type> --config``) can run, in one explicit place.

An entry names the stage's config class, the function that runs it (``run(config, run_dir, resume) ->
results``) and a one-line description (``tether recipes`` and the docs list them). A new stage type is
one line here; nothing registers itself by being imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.config.agent import AgentConfig, AgentEpisodesConfig, AgentEvalStageConfig, AgentSFTConfig
from tether.config.cai import AILabelsConfig, RLAIFConfig, SLCAIConfig
from tether.config.common import StageConfig
from tether.config.compare import CompareConfig
from tether.config.distill import (
    BestOfNConfig,
    FilterStageConfig,
    GenerateConfig,
    SelfDistillConfig,
    StepLabelsConfig,
)
from tether.config.preference import (
    DPOConfig,
    JudgeDataConfig,
    JudgeEvalConfig,
    OnlineDPOConfig,
    RewardModelConfig,
    SPINConfig,
)
from tether.config.rl import GRPOConfig, PPOConfig
from tether.config.rlhf import GoldDataConfig, OverOptimizationConfig
from tether.config.sft import EvalStageConfig, PretrainConfig, SFTConfig
from tether.core.registry import Registry
from tether.stages import agent_episodes, api, cai, compare, distill, judge_data, rlhf
from tether.trainers.checkpoint import mark_done

StageRun = Callable[[Any, Path, bool], dict[str, Any]]


@dataclass(frozen=True)
class StageType:
    config_class: type[StageConfig]
    run: StageRun
    description: str = ""
    trains_model: bool = True  # False: it samples, labels, scores or plots; its train.max_steps means nothing
    # a figure the stage draws from its results, redrawn over seeds: (aggregated figures, DIR) -> written path
    plot_over_seeds: Callable[[dict[str, dict[str, Any]], Path], Path | None] | None = None


def trains(train: Callable[..., dict[str, float]]) -> StageRun:
    """A public ``train_*`` function as a stage: the stage's model goes to ``run_dir/<stage>``."""

    def run(cfg: StageConfig, run_dir: Path, resume: bool) -> dict[str, float]:
        return train(cfg, out=run_dir, resume=resume)

    run.__doc__ = f"The stage of :func:`{train.__module__}.{train.__name__}`."
    return run


def run_eval(cfg: EvalStageConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    """Evaluate ``cfg.model`` on ``cfg.eval``; the figures are the stage's results."""
    results = api.evaluate(cfg)
    stage_dir = run_dir / (cfg.name or "eval")
    stage_dir.mkdir(parents=True, exist_ok=True)
    mark_done(stage_dir, {"stage": cfg.name, "type": "eval", "results": results})
    return results


STAGES: dict[str, StageType] = {
    "pretrain": StageType(PretrainConfig, trains(api.train_sft), "next-token prediction on raw text"),
    "sft": StageType(SFTConfig, trains(api.train_sft), "supervised fine-tuning with prompt tokens masked"),
    "eval": StageType(EvalStageConfig, run_eval, "held-out task evaluation of a model", trains_model=False),
    "rm": StageType(RewardModelConfig, trains(api.train_reward_model),
                    "reward model: Bradley-Terry on pairs, or a process RM on labelled steps"),
    "dpo": StageType(DPOConfig, trains(api.train_dpo),
                     "offline preference optimisation: DPO, IPO, cDPO, hinge, RPO, SimPO, ORPO, SPPO, KTO, WPO"),
    "grpo": StageType(GRPOConfig, trains(api.train_grpo),
                      "critic-free RL: GRPO, Dr. GRPO, RLOO, REINFORCE(++), ReMax, DAPO, GSPO, CISPO, GMPO, SAPO, "
                      "DPPO"),
    "ppo": StageType(PPOConfig, trains(api.train_ppo),
                     "PPO-RLHF with a critic (InstructGPT): GAE, KL in the reward, value loss"),
    "online_dpo": StageType(OnlineDPOConfig, trains(api.train_online_dpo),
                            "online / iterative DPO: rounds of sample -> score (verifier, RM or judge) -> pair -> "
                            "preference loss; OAIF; self-rewarding"),
    "spin": StageType(SPINConfig, trains(api.train_spin),
                      "SPIN: DPO iterations, chosen = SFT demonstration, rejected = own generation, "
                      "reference = previous iterate"),
    "judge_data": StageType(JudgeDataConfig, judge_data.run_judge_data,
                            "synthetic judge training data (known verdicts) for an SFT stage", trains_model=False),
    "judge_eval": StageType(JudgeEvalConfig, judge_data.run_judge_eval,
                            "a judge's held-out verdict accuracy and position consistency (synthetic and "
                            "on-policy pairs)", trains_model=False),
    "agent_sft": StageType(AgentSFTConfig, trains(api.train_agent_sft),
                           "SFT on tool-use demonstrations, observation tokens masked"),
    "agent": StageType(AgentConfig, trains(api.train_agent),
                       "multi-turn tool-use RL (GRPO family, GiGPO), observation tokens masked"),
    "agent_episodes": StageType(AgentEpisodesConfig, agent_episodes.run_agent_episodes,
                                "sample K episodes per task; pair successes with failures of a task (DMPO's data)",
                                trains_model=False),
    "agent_eval": StageType(AgentEvalStageConfig, agent_episodes.run_agent_eval,
                            "held-out episodes of a model (greedy and sampled success, tool calls)",
                            trains_model=False),
    "gold_data": StageType(GoldDataConfig, rlhf.run_gold_data,
                           "demonstrations and comparisons labelled by a hidden gold reward", trains_model=False),
    "overoptimization": StageType(OverOptimizationConfig, rlhf.run_overoptimization,
                                  "reward over-optimisation: PPO at several KL coefficients, gold and proxy reward "
                                  "against KL", plot_over_seeds=rlhf.plot_overoptimization_over_seeds),
    "sl_cai": StageType(SLCAIConfig, cai.run_sl_cai,
                        "SL-CAI: answer -> critique -> revise (N rounds) against a constitution -> SFT on the "
                        "revisions"),
    "ai_labels": StageType(AILabelsConfig, cai.run_ai_labels,
                           "RLAIF labels: 2 samples per prompt, a pairwise judge against a sampled principle, both "
                           "orders; judge bias figures", trains_model=False),
    "rlaif": StageType(RLAIFConfig, cai.run_rlaif,
                       "RL-CAI / RLAIF: PPO or online DPO against the AI-labelled preference model"),
    "generate": StageType(GenerateConfig, distill.run_generate, "sample K completions per prompt into a corpus "
                                                                 "(resumable)", trains_model=False),
    "filter": StageType(FilterStageConfig, distill.run_filter,
                        "keep the samples of a corpus worth learning from (verifier, RM, ...)", trains_model=False),
    "step_labels": StageType(StepLabelsConfig, distill.run_step_labels,
                             "label each step of sampled traces against the task's reference traces (a PRM's "
                             "data from the policy's own samples)", trains_model=False),
    "self_distill": StageType(SelfDistillConfig, distill.run_self_distill,
                              "STaR / ReST / RAFT: rounds of generate -> filter -> SFT"),
    "best_of_n": StageType(BestOfNConfig, distill.run_best_of_n_stage,
                           "held-out best-of-n accuracy against n, per scorer, with a plot", trains_model=False),
    "compare": StageType(CompareConfig, compare.run_compare,
                         "a figure of earlier stages' metrics over steps side by side (over seeds: the mean)",
                         trains_model=False),
}

STAGE_TYPES: Registry[StageType] = Registry("stage type")
for _name, _stage in STAGES.items():
    STAGE_TYPES.register(_name)(_stage)
