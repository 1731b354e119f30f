"""The blocks every stage shares: model, optimiser, training loop, task, evaluation, and ``StageConfig``.

A stage names its task once (``task: {name, options}``); every task source and evaluation block
inside the stage that does not name a task of its own takes the stage's (see :class:`StageConfig`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from tether.config.base import StrictModel
from tether.core.likelihood_metrics import LIKELIHOOD_METRICS
from tether.core.text_metrics import TEXT_METRICS


class LoraConfig(StrictModel):
    """A LoRA adapter (Hu et al. 2021) through peft: only the adapter's weights are trained."""

    r: int = Field(8, ge=1, description="rank of the low-rank update")
    lora_alpha: int = Field(16, ge=1, description="scaling numerator: the update is scaled by lora_alpha / r")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input")
    target_modules: str | list[str] = Field("all-linear", description="modules that get an adapter: 'all-linear' "
                                                                        "or a list of module names")


class ModelConfig(StrictModel):
    """Which model to start from: a local path, a hub id, ``tether/tiny`` / ``tether/small``
    (built offline from ``seed``), or ``@stage`` for the output of an earlier pipeline stage."""

    name_or_path: str = Field("tether/tiny", description="a local directory, a hub id, tether/tiny, tether/small "
                                                         "or @stage (an earlier stage's output)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("float32", description="weights' dtype")
    device: str = Field("cpu", description="cpu, cuda, cuda:N or auto (CUDA when available); under torchrun a "
                                           "bare cuda is the rank's GPU")
    seed: int = Field(0, description="initialises a built-in model's weights (and any new head)")
    lora: LoraConfig | None = Field(None, description="train a LoRA adapter instead of every weight")
    trust_remote_code: bool = Field(False, description="allow a hub model's own Python code")
    attn_implementation: str | None = Field(None, description="transformers attention kernel (sdpa, eager, "
                                                              "flash_attention_2); None: the library's default")
    config_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="built-in models only: LlamaConfig fields replacing the size's own, e.g. "
                    "{num_hidden_layers: 2} for a shallower student")


class OptimConfig(StrictModel):
    """AdamW with weight decay on matrices only, and a learning-rate schedule."""

    lr: float = Field(1e-4, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay on matrices (not on norms, biases)")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's moment decay rates")
    eps: float = Field(1e-8, gt=0, description="AdamW's denominator epsilon")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="decay after warm-up")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up steps (wins over warmup_ratio when > 0)")
    warmup_ratio: float = Field(0.0, ge=0, le=1, description="warm-up as a share of all updates")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine: the final rate as a share of lr")
    max_grad_norm: float | None = Field(1.0, gt=0, description="clip the global gradient norm to this; None: off")
    fused: bool = Field(True, description="the fused AdamW kernel (CPU or CUDA, unsharded weights; transformers' "
                                          "default too): 4-7x faster optimiser steps on CPU than the multi-tensor "
                                          "AdamW that false selects, whose rounding differs in the last bit")


class LoopConfig(StrictModel):
    """The shared training loop: length, batching, accumulation, cadence of eval / checkpoints / logs."""

    max_steps: int = Field(100, ge=1, description="optimiser steps (RL: rollout steps) in the stage")
    batch_size: int = Field(16, ge=1, description="examples (or prompts, for RL) per micro-batch")
    grad_accum: int = Field(1, ge=1, description="micro-batches accumulated into one optimiser step")
    log_every: int = Field(10, ge=1, description="write metrics every this many steps (and at the last)")
    eval_every: int | None = Field(None, ge=1, description="evaluate every this many steps; None: at the end only")
    save_every: int | None = Field(None, ge=1, description="checkpoint every this many steps; None: by time "
                                                            "only (save_every_minutes)")
    save_every_minutes: float | None = Field(10.0, gt=0, description="checkpoint when this many minutes have "
                                             "passed since the last one (and at the end of training, before the "
                                             "final evaluation); None: off")
    keep_checkpoints: int = Field(2, ge=1, description="newest checkpoints kept on disk")
    max_bad_steps: int = Field(5, ge=1, description="non-finite steps in a row (each skipped) that stop the run")
    seed: int = Field(0, description="data order, sampling and minibatch shuffles")
    threads: int = Field(1, ge=1, description="torch intra-op CPU threads, set by every stage (never inherited from "
                                              "the caller); more than 1 is not bitwise reproducible across "
                                              "processes on CPU unless --deterministic")
    progress: bool = Field(True, description="show a progress bar")
    strategy: Literal["ddp", "fsdp2"] = Field(
        "ddp", description="under torchrun: ddp (whole model per rank) or fsdp2 (sharded per decoder layer, "
                           "sharded DCP checkpoints; also in one process)")
    precision: Literal["fp32", "bf16-mixed"] = Field(
        "fp32", description="bf16-mixed: forward and backward autocast to bfloat16 (CPU and CUDA); weights, "
                            "gradients, optimizer state and log-prob / loss reductions stay float32; the "
                            "rollout engine then samples in bfloat16 unless its options name a dtype")

    dropout: Literal["auto", "keep", "off"] = Field(
        "auto", description="the model's dropout in training: auto turns it off where the loss compares the "
                            "policy's log-probs with a pass of the same weights in eval mode (preference, RL, "
                            "PPO, online and distillation stages: with dropout a policy equal to its reference "
                            "scores nonzero and an on-policy ratio is not 1) and keeps it in SFT and "
                            "reward-model training; keep / off force it")

    @property
    def sampler_dtype(self) -> str | None:
        """The dtype a training stage's rollout engine samples in unless its options name one: ``bfloat16``
        under ``bf16-mixed``, whose matrix products run in bfloat16 (as a bf16 trainer's sampler does in TRL,
        whose ``generate`` runs under the same autocast), else None (the model's own)."""
        return "bfloat16" if self.precision == "bf16-mixed" else None


class TaskSpec(StrictModel):
    """Which built-in task (``tether.tasks``): its registered name and constructor options."""

    name: str = Field("arithmetic", description="a registered task: arithmetic, multiplication, code, secret, ...")
    options: dict[str, Any] = Field(default_factory=dict, description="the task's constructor options, e.g. "
                                                                      "{digits: 3, operators: '+'}")


class TaskSource(TaskSpec):
    """Records generated by a built-in task. ``name`` / ``options`` left unset take the stage's ``task``."""

    n: int = Field(1000, ge=1, description="records drawn")
    seed: int = Field(0, description="which records are drawn")
    think: bool = Field(True, description="demonstrations carry the worked steps in <think>...</think>")
    chat: bool = Field(False, description="records as chat messages instead of prompt / completion text")


class EvalConfig(StrictModel):
    """Held-out task evaluation: greedy accuracy, and pass@k when ``samples`` > 1. ``task`` / ``options``
    left unset take the stage's ``task``."""

    task: str = Field("arithmetic", description="the task whose held-out split is evaluated")
    options: dict[str, Any] = Field(default_factory=dict, description="the task's constructor options")
    n: int = Field(200, ge=1, description="held-out problems")
    seed: int = Field(0, description="which held-out problems (and pass@k samples)")
    max_new_tokens: int = Field(64, ge=1, description="tokens generated per answer")
    samples: int = Field(1, ge=1, description="k for pass@k (sampled at temperature)")
    temperature: float = Field(1.0, ge=0, description="pass@k sampling temperature (0: greedy; the greedy accuracy "
                                                      "is always computed too)")
    batch_size: int = Field(64, ge=1, description="prompts decoded together")
    chat: bool = Field(False, description="wrap prompts in the chat template")
    prompt_template: str = Field("{prompt}", description="how a problem becomes the prompt, e.g. '{prompt}<think>'")
    before: bool = Field(False, description="also evaluate the starting model (figures prefixed before/)")
    metrics: list[str] = Field(default_factory=list, description="extra figures: text metrics of the greedy "
                               "completions (distinct, length_by_outcome, reflection, language_consistency) and "
                               "likelihood metrics "
                               "(perplexity; likelihood_reward_agreement, with samples > 1)")
    perplexity_data: str | None = Field(None, description="held-out texts for the perplexity metric: a .jsonl / "
                                        ".json / .parquet file of prompt+completion, messages or text records; "
                                        "unset: the evaluated problems with their reference completions")

    held_out: ClassVar[bool] = True

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, value: list[str]) -> list[str]:
        unknown = [m for m in value if m not in TEXT_METRICS and m not in LIKELIHOOD_METRICS]
        if unknown:
            valid = sorted([*TEXT_METRICS.names(), *LIKELIHOOD_METRICS.names()])
            raise ValueError(f"unknown metric {unknown[0]!r}; valid: {', '.join(valid)}")
        return value  # its seed picks the held-out problems: a recipe's seed leaves it alone

    @model_validator(mode="after")
    def _samples_for_metrics(self) -> EvalConfig:
        for name in self.metrics:
            if name in LIKELIHOOD_METRICS and "samples" in LIKELIHOOD_METRICS.needs(name) and self.samples < 2:
                raise ValueError(f"metric {name!r} ranks several sampled completions per prompt; set samples "
                                 f"to 2 or more (tether eval -k 4), got {self.samples}")
        return self


class StageConfig(StrictModel):
    """Fields every stage has. Concrete stages subclass this.

    ``task`` names the stage's task once: every task source and evaluation block below that sets
    no task of its own (no ``name`` / ``task`` key) takes this one, with its options unless the
    block sets its own; reward functions that take a ``task`` get it too.
    """

    name: str = Field("", description="the stage's name: its folder in the run directory and its @reference")
    type: str = Field("", description="the stage type (tether recipes / the stage table)")
    task: TaskSpec | None = Field(None, description="the stage's task, inherited by its data, evaluation and "
                                                    "task-aware rewards")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the model the stage starts from")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="optimiser and learning-rate schedule")
    train: LoopConfig = Field(default_factory=LoopConfig, description="the training loop")
    eval: EvalConfig | None = Field(None, description="held-out evaluation after training (and before, with "
                                                      "eval.before)")
    report_to: list[Literal["tensorboard", "wandb"]] = Field(default_factory=lambda: ["tensorboard"],
                                                             description="metric sinks beside metrics.jsonl")

    @model_validator(mode="after")
    def _inherit_task(self) -> StageConfig:
        stage_task = self.task
        if stage_task is None or "name" not in stage_task.model_fields_set:
            return self
        for block in nested_models(self):
            if block is stage_task:
                continue
            if isinstance(block, TaskSpec) and "name" not in block.model_fields_set:
                block.name = stage_task.name
                if "options" not in block.model_fields_set:
                    block.options = dict(stage_task.options)
            elif isinstance(block, EvalConfig) and "task" not in block.model_fields_set:
                block.task = stage_task.name
                if "options" not in block.model_fields_set:
                    block.options = dict(stage_task.options)
        return self

    def with_seed(self, seed: int) -> StageConfig:
        """A copy with every ``seed`` in it (model initialisation and new heads, data draws and order, sampling,
        minibatch shuffles, judge sampling) shifted by a recipe's ``seed``; the held-out evaluation's seeds are
        kept, so that every seed of a recipe is measured on the same problems. ``seed`` 0 changes nothing."""
        if seed == 0:
            return self
        shifted = self.model_copy(deep=True)
        for block in (shifted, *nested_models(shifted)):  # the stage's own fields too (e.g. gold_data's seed)
            if not getattr(block, "held_out", False) and isinstance(getattr(block, "seed", None), int):
                block.seed += seed
        return shifted

    def reward_defaults(self) -> dict[str, Any]:
        """Keyword defaults for reward functions that take a task (``accuracy``, ``worked_solution``): the
        stage's task, when it names one."""
        if self.task is None or "name" not in self.task.model_fields_set:
            return {}
        return {"task": self.task.name, "task_options": dict(self.task.options)}


def nested_models(model: BaseModel) -> Iterator[BaseModel]:
    """Every config object inside ``model`` (fields, and lists / dicts of them), depth first."""
    for name in type(model).model_fields:
        value = getattr(model, name)
        values = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
        for item in values:
            if isinstance(item, BaseModel):
                yield item
                yield from nested_models(item)
