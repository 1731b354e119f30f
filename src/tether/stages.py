"""Stage types the pipeline can run, and the public one-call API behind each.

Each ``run_*`` function is what ``tether <command> --config FILE`` calls and what a
recipe stage of that type runs; each ``train_*`` / ``evaluate`` function is the same thing
for a notebook: a config object (or dict), a model (path or loaded object), data (a file,
a list of dicts or a ``datasets.Dataset``), and an output directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from tether.config import EvalConfig, StageConfig
from tether.models.loading import resolve_model
from tether.pipeline import register_stage
from tether.trainers.checkpoint import mark_done
from tether.trainers.sft import PretrainConfig, SFTConfig, SFTTrainer


def _coerce(config: StageConfig | dict, cls: type[StageConfig]) -> StageConfig:
    return config if isinstance(config, cls) else cls.model_validate(config)


def train_sft(config: SFTConfig | dict, *, out: str | Path, model: Any = None, tokenizer: Any = None,
              dataset: Any = None, resume: bool = False) -> dict[str, float]:
    """Supervised fine-tuning (or pretraining, when ``config.type == "pretrain"``).

    ``dataset`` (a file path, list of dicts or ``datasets.Dataset``) replaces ``config.data``.
    Writes the final model to ``out/<stage>`` and returns the evaluation figures.
    """
    cfg = _coerce(config, PretrainConfig if isinstance(config, dict) and config.get("type") == "pretrain"
                  else SFTConfig)
    model, tokenizer = resolve_model(model, tokenizer, cfg.model)
    records = None
    if dataset is not None:
        from tether.data import load_records

        records = load_records(dataset, cfg.data.format)
    trainer = SFTTrainer(cfg, model, tokenizer, out, records=records, stage=cfg.name or cfg.type)
    return trainer.fit(resume=resume)


@register_stage("pretrain", PretrainConfig, "next-token prediction on raw text")
def run_pretrain(cfg: PretrainConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    return train_sft(cfg, out=run_dir, resume=resume)


@register_stage("sft", SFTConfig, "supervised fine-tuning with prompt tokens masked")
def run_sft(cfg: SFTConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    return train_sft(cfg, out=run_dir, resume=resume)


class EvalStageConfig(StageConfig):
    eval: EvalConfig = Field(default_factory=EvalConfig)


def evaluate(config: EvalStageConfig | dict, *, model: Any = None, tokenizer: Any = None) -> dict[str, float]:
    """Evaluate a model on a task's held-out split (greedy accuracy, pass@k)."""
    from tether.evaluation import evaluate_task

    cfg = _coerce(config, EvalStageConfig)
    model, tokenizer = resolve_model(model, tokenizer, cfg.model)
    return evaluate_task(model, tokenizer, cfg.eval)


@register_stage("eval", EvalStageConfig, "held-out task evaluation of a model")
def run_eval(cfg: EvalStageConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    results = evaluate(cfg)
    stage_dir = run_dir / (cfg.name or "eval")
    stage_dir.mkdir(parents=True, exist_ok=True)
    mark_done(stage_dir, {"stage": cfg.name, "type": "eval", "results": results})
    return results


def train_grpo(config: Any, *, out: str | Path, model: Any = None, tokenizer: Any = None, dataset: Any = None,
               reward_functions: list | None = None, resume: bool = False) -> dict[str, float]:
    """Critic-free RL (GRPO and relatives, chosen by ``config.algorithm`` / ``advantage``).

    ``dataset``: prompt/answer records (file, list of dicts or ``datasets.Dataset``);
    ``reward_functions``: plain callables ``fn(prompts, completions, **columns) -> list[float | None]``
    (or ``RewardSpec``s), replacing ``config.rewards``.
    """
    from tether.trainers.rl import GRPOConfig, RLTrainer

    cfg = _coerce(config, GRPOConfig)
    model, tokenizer = resolve_model(model, tokenizer, cfg.model)
    records = None
    if dataset is not None:
        from tether.data import load_records

        records = load_records(dataset)
    trainer = RLTrainer(cfg, model, tokenizer, out, records=records, reward_functions=reward_functions,
                        stage=cfg.name or cfg.type)
    return trainer.fit(resume=resume)


def _register_rl() -> None:
    from tether.trainers.rl import GRPOConfig

    @register_stage("grpo", GRPOConfig, "critic-free RL: GRPO, Dr. GRPO, RLOO, REINFORCE(++), ReMax, DAPO")
    def run_grpo(cfg: GRPOConfig, run_dir: Path, resume: bool) -> dict[str, float]:
        return train_grpo(cfg, out=run_dir, resume=resume)


def train_ppo(config: Any, *, out: str | Path, model: Any = None, tokenizer: Any = None, critic: Any = None,
              dataset: Any = None, reward_functions: list | None = None, gold_functions: list | None = None,
              resume: bool = False) -> dict[str, float]:
    """PPO-RLHF with a critic (InstructGPT): GAE, per-token KL in the reward, clipped policy and value losses.

    ``critic``: a value / reward / causal-LM model or path (default: ``config.critic``);
    ``dataset``: prompt records (file, list of dicts or ``datasets.Dataset``); ``reward_functions``:
    callables or a ``RewardModelScorer``, replacing ``config.rewards``; ``gold_functions``: rewards
    only logged (``reward/gold``), replacing ``config.gold``.
    """
    from tether.trainers.ppo import PPOConfig, PPOTrainer

    cfg = _coerce(config, PPOConfig)
    model, tokenizer = resolve_model(model, tokenizer, cfg.model)
    records = None
    if dataset is not None:
        from tether.data import load_records

        records = load_records(dataset)
    trainer = PPOTrainer(cfg, model, tokenizer, out, critic=critic, records=records,
                         reward_functions=reward_functions, gold_functions=gold_functions, stage=cfg.name or cfg.type)
    return trainer.fit(resume=resume)


def _register_ppo() -> None:
    from tether.trainers.ppo import PPOConfig

    @register_stage("ppo", PPOConfig, "PPO-RLHF with a critic (InstructGPT): GAE, KL in the reward, value loss")
    def run_ppo(cfg: PPOConfig, run_dir: Path, resume: bool) -> dict[str, float]:
        return train_ppo(cfg, out=run_dir, resume=resume)


_register_rl()
_register_ppo()

from tether import rlhf as _rlhf  # noqa: E402,F401  (registers gold_data, overoptimization)
from tether.trainers import agent as _agent  # noqa: E402,F401  (registers agent_sft, agent)
from tether.trainers import cai as _cai  # noqa: E402,F401  (registers sl_cai, ai_labels, rlaif)
from tether.trainers import distill as _distill  # noqa: E402,F401  (generate, filter, self_distill, best_of_n)
from tether.trainers import online_preference as _online_preference  # noqa: E402,F401  (registers online_dpo, judge_data)
from tether.trainers import preference as _preference  # noqa: E402,F401  (registers the dpo stage)
from tether.trainers import reward as _reward  # noqa: E402,F401  (registers the rm stage)
from tether.trainers import spin as _spin  # noqa: E402,F401  (registers the spin stage)
