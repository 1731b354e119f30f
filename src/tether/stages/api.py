"""The one-call Python API: each ``train_*`` function is one stage, the same thing a recipe stage runs.

Every call takes a config object (or dict), a model (None: ``config.model``; a path or hub id; or a
loaded model with its ``tokenizer``), data (a file, a list of dicts or a ``datasets.Dataset``,
replacing the config's), and an output directory; it writes the stage's model to ``out/<stage>``
and returns the held-out figures. One body (:func:`run_trainer`) does the work for all of them:
validate the config, load the model, build the family's trainer, fit.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from tether.config.agent import AgentConfig, AgentSFTConfig
from tether.config.common import StageConfig
from tether.config.preference import DPOConfig, OnlineDPOConfig, RewardModelConfig, SPINConfig
from tether.config.rl import GRPOConfig, PPOConfig
from tether.config.sft import EvalStageConfig, PretrainConfig, SFTConfig
from tether.data import load_records
from tether.data.pairs import load_pair_records
from tether.data.sources import demonstration_records
from tether.evaluation import evaluate_agent, evaluate_task
from tether.models.loading import resolve_model
from tether.models.reward_model import load_reward_model
from tether.rollout.agent import demonstration_records as agent_demonstrations
from tether.trainers.agent import AgentRLTrainer
from tether.trainers.online_preference import OnlinePreferenceTrainer, SPINTrainer
from tether.trainers.ppo import PPOTrainer
from tether.trainers.preference import PreferenceTrainer
from tether.trainers.reward import RewardModelTrainer
from tether.trainers.rl import RLTrainer
from tether.trainers.sft import SFTTrainer


def coerce(config: StageConfig | dict, cls: type[StageConfig]) -> StageConfig:
    """``config`` validated as ``cls`` (a dict), or as it is (already a ``cls``)."""
    return config if isinstance(config, cls) else cls.model_validate(config)


def run_trainer(trainer_class: type, config_class: type[StageConfig], config: StageConfig | dict, *,
                out: str | Path, model: Any = None, tokenizer: Any = None, resume: bool = False,
                loader: Callable | None = None, inputs: Callable[[Any, Any], dict[str, Any]] | None = None
                ) -> dict[str, float]:
    """The body of every ``train_*`` call: validate ``config`` as ``config_class``, load the model (with
    ``loader``, default the causal-LM loader), build ``trainer_class`` with ``inputs(config, tokenizer)``
    (the data and functions given instead of the config's), train, export, mark the stage done."""
    cfg = coerce(config, config_class)
    model, tokenizer = resolve_model(model, tokenizer, cfg.model, loader=loader)
    extra = inputs(cfg, tokenizer) if inputs is not None else {}
    return trainer_class(cfg, model, tokenizer, out, stage=cfg.name or cfg.type, **extra).fit(resume=resume)


def _records(dataset: Any, format: str | None = None) -> list[dict] | None:
    return None if dataset is None else load_records(dataset, format)


def train_sft(config: SFTConfig | dict, *, out: str | Path, model: Any = None, tokenizer: Any = None,
              dataset: Any = None, resume: bool = False) -> dict[str, float]:
    """Supervised fine-tuning (or pretraining, when ``config.type == "pretrain"``).

    ``dataset`` (a file path, list of dicts or ``datasets.Dataset``) replaces ``config.data``.
    Writes the final model to ``out/<stage>`` and returns the evaluation figures.
    """
    cls = PretrainConfig if isinstance(config, dict) and config.get("type") == "pretrain" else SFTConfig
    return run_trainer(SFTTrainer, cls, config, out=out, model=model, tokenizer=tokenizer, resume=resume,
                       inputs=lambda cfg, tok: {"records": _records(dataset, cfg.data.format)})


def _pair_inputs(dataset: Any, eval_dataset: Any, train_format: Callable[[Any], str | None],
                 eval_format: Callable[[Any], str | None]) -> Callable[[Any, Any], dict[str, Any]]:
    """Trainer inputs from pair files: the records, the held-out records, and the drop counts of both."""

    def inputs(cfg: Any, tokenizer: Any) -> dict[str, Any]:
        records = held = None
        dropped: dict[str, int] = {}
        if dataset is not None:
            records, dropped = load_pair_records(dataset, train_format(cfg))
        if eval_dataset is not None:
            held, eval_dropped = load_pair_records(eval_dataset, eval_format(cfg))
            dropped = {k: dropped.get(k, 0) + v for k, v in eval_dropped.items()}
        return {"records": records, "eval_records": held, "dropped": dropped}

    return inputs


def train_reward_model(config: RewardModelConfig | dict, *, out: str | Path, model: Any = None,
                       tokenizer: Any = None, dataset: Any = None, eval_dataset: Any = None,
                       resume: bool = False) -> dict[str, float]:
    """Train an outcome (pairs, or rankings with ``data.format: ranking``) or process (``config.process``,
    stepwise records) reward model.

    ``model``: None (``config.model``), a path / hub id (an SFT checkpoint gets a new score head),
    or a loaded ``*ForSequenceClassification`` model with its ``tokenizer``. ``dataset`` /
    ``eval_dataset`` (a file, list of dicts or ``datasets.Dataset``) replace ``config.data``.
    Writes the model to ``out/<stage>`` (reload with ``AutoModelForSequenceClassification`` or
    ``RewardModelScorer``) and returns the held-out figures.
    """
    fmt = RewardModelConfig.record_format
    return run_trainer(RewardModelTrainer, RewardModelConfig, config, out=out, model=model, tokenizer=tokenizer,
                       resume=resume, loader=load_reward_model, inputs=_pair_inputs(dataset, eval_dataset, fmt, fmt))


def train_dpo(config: DPOConfig | dict, *, out: str | Path, model: Any = None, tokenizer: Any = None,
              dataset: Any = None, eval_dataset: Any = None, resume: bool = False) -> dict[str, float]:
    """Offline preference optimisation (DPO and relatives, or KTO with ``loss: kto``).

    ``dataset`` / ``eval_dataset``: preference pairs (or unpaired records for KTO) as a file, list of
    dicts or ``datasets.Dataset``, replacing ``config.data``. Pairs whose chosen equals their rejected,
    and records with an empty completion, are dropped and counted. Writes the policy to ``out/<stage>``
    and returns the held-out figures.
    """
    return run_trainer(PreferenceTrainer, DPOConfig, config, out=out, model=model, tokenizer=tokenizer, resume=resume,
                       inputs=_pair_inputs(dataset, eval_dataset, DPOConfig.record_format,
                                           lambda cfg: None if cfg.unpaired else "preference"))


def train_grpo(config: GRPOConfig | dict, *, out: str | Path, model: Any = None, tokenizer: Any = None,
               dataset: Any = None, reward_functions: list | None = None, resume: bool = False) -> dict[str, float]:
    """Critic-free RL (GRPO and relatives, chosen by ``config.algorithm`` / ``advantage``).

    ``dataset``: prompt/answer records (file, list of dicts or ``datasets.Dataset``);
    ``reward_functions``: plain callables ``fn(prompts, completions, **columns) -> list[float | None]``
    (or ``RewardSpec``s), replacing ``config.rewards``.
    """
    return run_trainer(RLTrainer, GRPOConfig, config, out=out, model=model, tokenizer=tokenizer, resume=resume,
                       inputs=lambda cfg, tok: {"records": _records(dataset), "reward_functions": reward_functions})


def train_ppo(config: PPOConfig | dict, *, out: str | Path, model: Any = None, tokenizer: Any = None, critic: Any = None,
              dataset: Any = None, reward_functions: list | None = None, gold_functions: list | None = None,
              resume: bool = False) -> dict[str, float]:
    """PPO-RLHF with a critic (InstructGPT): GAE, per-token KL in the reward, clipped policy and value losses.

    ``critic``: a value / reward / causal-LM model or path (default: ``config.critic``);
    ``dataset``: prompt records (file, list of dicts or ``datasets.Dataset``); ``reward_functions``:
    callables or a ``RewardModelScorer``, replacing ``config.rewards``; ``gold_functions``: rewards
    only logged (``reward/gold``), replacing ``config.gold``.
    """
    return run_trainer(PPOTrainer, PPOConfig, config, out=out, model=model, tokenizer=tokenizer, resume=resume,
                       inputs=lambda cfg, tok: {"records": _records(dataset), "reward_functions": reward_functions,
                                                "gold_functions": gold_functions, "critic": critic})


def train_online_dpo(config: OnlineDPOConfig | dict, *, out: str | Path, model: Any = None, tokenizer: Any = None,
                     dataset: Any = None, reward_functions: list | None = None, judge: Any = None,
                     resume: bool = False) -> dict[str, float]:
    """Online / iterative DPO, OAIF or self-rewarding (chosen by the config).

    ``dataset``: prompt records (``prompt`` and, for verifiers, ``answer``) as a file, list of dicts
    or ``datasets.Dataset``, replacing ``config.data``. ``reward_functions``: plain callables
    ``fn(prompts, completions, **columns) -> list[float | None]`` as the scorer; ``judge``: a
    ``PointwiseJudge`` / ``PairwiseJudge`` as the scorer. Writes the policy to ``out/<stage>`` and each
    round's data to ``out/<stage>/rounds/``; returns the figures.
    """
    return run_trainer(OnlinePreferenceTrainer, OnlineDPOConfig, config, out=out, model=model, tokenizer=tokenizer,
                       resume=resume, inputs=lambda cfg, tok: {"records": _records(dataset),
                                                               "reward_functions": reward_functions, "judge": judge})


def train_spin(config: SPINConfig | dict, *, out: str | Path, model: Any = None, tokenizer: Any = None,
               dataset: Any = None, resume: bool = False) -> dict[str, float]:
    """SPIN iterations from an SFT model on its SFT data.

    ``dataset``: demonstrations (``prompt`` + ``completion``; file, list of dicts or ``datasets.Dataset``)
    replacing ``config.data``. Writes the last iterate to ``out/<stage>`` and each iteration's generations
    and pairs to ``out/<stage>/rounds/``; returns ``round_N/*`` figures per iteration (held-out task
    figures with ``config.eval``; ``before/*`` with ``eval.before``) and the last iterate's."""
    def inputs(cfg: SPINConfig, tokenizer: Any) -> dict[str, Any]:
        return {"records": _records(dataset, "prompt_completion") if dataset is not None
                else demonstration_records(cfg.data)}

    return run_trainer(SPINTrainer, SPINConfig, config, out=out, model=model, tokenizer=tokenizer, resume=resume,
                       inputs=inputs)


def train_agent_sft(config: AgentSFTConfig | dict, *, out: str | Path, model: Any = None, tokenizer: Any = None,
                    dataset: Any = None, resume: bool = False) -> dict[str, float]:
    """SFT warm-up on tool-use demonstrations of ``config.environment`` (or ``dataset``: chat records
    with tool messages). Returns the held-out agent figures when ``config.eval`` is set."""
    def inputs(cfg: AgentSFTConfig, tokenizer: Any) -> dict[str, Any]:
        if dataset is not None:
            records = load_records(dataset)
        elif cfg.data.path is None and cfg.data.mix is None:
            records = agent_demonstrations(cfg.environment, tokenizer, workers=cfg.agent.tool_workers)
        else:
            records = None
        evaluator = partial(evaluate_agent, env=cfg.environment, loop=cfg.agent, eval_cfg=cfg.eval)
        return {"records": records, "evaluator": evaluator}

    return run_trainer(SFTTrainer, AgentSFTConfig, config, out=out, model=model, tokenizer=tokenizer, resume=resume,
                       inputs=inputs)


def train_agent(config: AgentConfig | dict, *, out: str | Path, model: Any = None, tokenizer: Any = None,
                dataset: Any = None, reward_functions: list | None = None, resume: bool = False) -> dict[str, float]:
    """Multi-turn tool-use RL (GRPO family, optional GiGPO) in ``config.environment``.

    ``dataset``: task records ``{"prompt", "answer", ...}`` replacing the environment's task draw;
    ``reward_functions``: callables ``fn(prompts, completions, trajectory, **columns)`` (completions are
    the final answers), replacing ``config.rewards``.
    """
    return run_trainer(AgentRLTrainer, AgentConfig, config, out=out, model=model, tokenizer=tokenizer, resume=resume,
                       inputs=lambda cfg, tok: {"records": _records(dataset), "reward_functions": reward_functions})


def evaluate(config: EvalStageConfig | dict, *, model: Any = None, tokenizer: Any = None) -> dict[str, float]:
    """Evaluate a model on a task's held-out split (greedy accuracy, pass@k)."""
    cfg = coerce(config, EvalStageConfig)
    model, tokenizer = resolve_model(model, tokenizer, cfg.model)
    return evaluate_task(model, tokenizer, cfg.eval)
