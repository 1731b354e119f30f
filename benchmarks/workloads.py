"""The benchmark workloads, each written once for tether and once for TRL on identical work.

A workload function takes the saved model directory, a :class:`Spec` and a scratch directory and
returns a :class:`Measurement`: wall seconds of the library's ``train()`` call (setup such as
model loading and dataset tokenisation is excluded on both sides; tether's one-off reference
pass for DPO is included), the units of work done (tokens, pairs, completions) and the loss (or
reward) trajectory, one value per optimiser step.

Both sides: the same weights (loaded from the same directory), the same records, the same batch
size, sequence lengths, the fused AdamW kernel (each library's default: tether's ``optim.fused``,
transformers' ``adamw_torch_fused`` with torch >= 2.8) with the same learning rate, constant schedule, no warm-up, no
weight decay, clipping at 1.0, the same precision (float32, or bf16-mixed: tether's ``train.precision:
bf16-mixed`` against TRL's ``bf16=True``, both bfloat16 autocast over float32 weights; generation in
bfloat16 weights on both sides), the same thread count, no gradient checkpointing, no evaluation, no
checkpointing, one optimiser step per batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from tether.models.loading import load_model
from tether.tasks import get_task, rl_records, sft_records
from tether.tasks.preferences import preference_records

# What wraps every timed region; ``profile_ops.py`` sets it to a profiler so that it sees exactly what is timed.
timed_region: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def synchronize(device: str | torch.device) -> None:
    """Wait for the device's queued kernels, so a wall-clock timer around GPU work measures it (no-op on CPU)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


@contextlib.contextmanager
def timed() -> Iterator[list[float]]:
    """Time the block (inside ``timed_region()``); the seconds are appended to the yielded list."""
    seconds: list[float] = []
    with timed_region():
        start = time.perf_counter()
        yield seconds
        seconds.append(time.perf_counter() - start)


@dataclasses.dataclass(frozen=True)
class Spec:
    """The size of one workload run (shared by the two libraries)."""

    steps: int
    batch: int  # examples / pairs / prompts per optimiser step
    max_length: int = 128  # SFT / DPO sequence length cap
    group: int = 8  # GRPO completions per prompt
    new_tokens: int = 32  # GRPO max completion length, generation new tokens
    beta: float = 0.04  # GRPO KL coefficient; DPO uses 0.1
    lr: float = 1e-4
    precision: str = "fp32"  # or "bf16-mixed": tether train.precision, TRL bf16=True, bfloat16 decoding
    prefix_sharing: bool | str = True  # tether's GRPO prefix_sharing / DPO data.prefix_sharing (TRL: none)


@dataclasses.dataclass
class Measurement:
    seconds: float
    units: dict[str, float]  # e.g. {"tokens": ..., "loss_tokens": ...}
    trajectory: list[float]


def digit_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """A dense, cheap reward that a random model already earns: the fraction of digit characters."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def _task():
    return get_task("arithmetic")


def sft_data(n: int) -> list[dict]:
    return sft_records(_task(), n, seed=0, think=True)


def dpo_data(n: int) -> list[dict]:
    return [{k: r[k] for k in ("prompt", "chosen", "rejected")}
            for r in preference_records(_task(), n, seed=0, kind="correctness")]


def grpo_data(n: int) -> list[dict]:
    return [{"prompt": r["prompt"], "answer": r["answer"]} for r in rl_records(_task(), n, seed=0)]


def _quiet() -> None:
    for name in ("transformers", "trl", "tether", "datasets", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _load(model_dir: Path):
    return load_model(str(model_dir))


# ---- tether ----------------------------------------------------------------------------------------
def _tether_common(spec: Spec, threads: int) -> dict[str, Any]:
    return {
        "optim": {"lr": spec.lr, "schedule": "constant", "weight_decay": 0.0, "max_grad_norm": 1.0},
        # save_every_minutes None: no checkpoint, as TRL's save_strategy="no" (tether's default writes a final
        # checkpoint of weights and optimiser state, 1.4 s on the small model: not training work)
        "train": {"max_steps": spec.steps, "batch_size": spec.batch, "log_every": 1, "progress": False,
                  "threads": threads, "precision": spec.precision, "save_every_minutes": None},
        "report_to": [],
    }


def _metric_column(run_dir: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r and r.get("step", 0) > 0]


def _packed_sum_sq(batch: dict, pad_token_id: int) -> float:
    """Sum of squared sequence lengths in a packed batch (a sequence starts where its position is 0)."""
    total = 0.0
    for ids, positions in zip(batch["input_ids"], batch["position_ids"], strict=True):
        starts = [*(positions == 0).nonzero().squeeze(-1).tolist(), len(positions)]
        for a, b in itertools.pairwise(starts):
            if bool((ids[a:b] != pad_token_id).any()):
                total += (b - a) ** 2
    return total


def tether_sft(model_dir: Path, spec: Spec, scratch: Path, threads: int) -> Measurement:
    from tether.trainers.sft import SFTConfig, SFTTrainer

    model, tokenizer = _load(model_dir)
    cfg = SFTConfig.model_validate({**_tether_common(spec, threads), "data": {
        "task": {"name": "arithmetic"}, "max_length": spec.max_length, "packing": True,
        "pack_length": spec.max_length}})
    trainer = SFTTrainer(cfg, model, tokenizer, scratch, records=sft_data(spec.steps * spec.batch), stage="sft")
    counts = {"tokens": 0.0, "loss_tokens": 0.0, "sum_sq_lengths": 0.0}
    for step in range(spec.steps):
        for batch in trainer.micro_batches_for_step(step):
            counts["tokens"] += int(batch["num_tokens"])
            counts["loss_tokens"] += int(batch["num_loss_tokens"])
            counts["sum_sq_lengths"] += _packed_sum_sq(batch, tokenizer.pad_token_id)
    with timed() as seconds:
        trainer.train()
    trainer.logger.close()
    return Measurement(seconds[0], counts, _metric_column(scratch, "loss"))


def tether_dpo(model_dir: Path, spec: Spec, scratch: Path, threads: int) -> Measurement:
    from tether.trainers.preference import DPOConfig, PreferenceTrainer

    model, tokenizer = _load(model_dir)
    cfg = DPOConfig.model_validate({**_tether_common(spec, threads), "loss": "sigmoid", "beta": 0.1,
                                    "data": {"task": {"name": "arithmetic"}, "max_length": spec.max_length,
                 "prefix_sharing": spec.prefix_sharing}})
    trainer = PreferenceTrainer(cfg, model, tokenizer, scratch, records=dpo_data(spec.steps * spec.batch),
                                eval_records=[], stage="dpo")
    with timed() as seconds:
        trainer.train()  # includes the one reference pass over the data
    trainer.logger.close()
    return Measurement(seconds[0], {"pairs": float(spec.steps * spec.batch)}, _metric_column(scratch, "loss"))


def tether_grpo(model_dir: Path, spec: Spec, scratch: Path, threads: int) -> Measurement:
    from tether.config.rl import GRPOConfig
    from tether.trainers.rl import RLTrainer

    model, tokenizer = _load(model_dir)
    cfg = GRPOConfig.model_validate({
        **_tether_common(spec, threads), "algorithm": "grpo", "kl": {"coef": spec.beta, "estimator": "k3"},
        "data": {"task": {"name": "arithmetic"}},
        "rollout": {"group_size": spec.group, "max_new_tokens": spec.new_tokens, "temperature": 1.0},
        "prefix_sharing": spec.prefix_sharing, "sample_every": 10**9})
    trainer = RLTrainer(cfg, model, tokenizer, scratch, records=grpo_data(spec.steps * spec.batch),
                        reward_functions=[digit_reward], stage="grpo")
    with timed() as seconds:
        trainer.train()
    trainer.logger.close()
    completions = float(spec.steps * spec.batch * spec.group)
    return Measurement(seconds[0], {"completions": completions}, _metric_column(scratch, "reward/mean"))


# ---- TRL ---------------------------------------------------------------------------------------------
def _trl_common(spec: Spec, scratch: Path, threads: int) -> dict[str, Any]:
    return dict(
        output_dir=str(scratch), max_steps=spec.steps, per_device_train_batch_size=spec.batch,
        gradient_accumulation_steps=1, learning_rate=spec.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch_fused", logging_steps=1, save_strategy="no",
        eval_strategy="no", report_to="none", use_cpu=True, bf16=spec.precision == "bf16-mixed", fp16=False,
        disable_tqdm=True,
        gradient_checkpointing=False, dataloader_num_workers=0, seed=0,
    )


class _CountingCollator:
    """Wraps TRL's collator to count the real and the loss-bearing tokens it hands the model."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.tokens = 0
        self.loss_tokens = 0
        self.sum_sq_lengths = 0.0

    def __call__(self, examples):
        batch = self.inner(examples)
        lengths = batch["attention_mask"].sum(1)
        self.tokens += int(lengths.sum())
        self.sum_sq_lengths += float((lengths.double() ** 2).sum())
        self.loss_tokens += int((batch["labels"][:, 1:] != -100).sum())
        return batch


def _trl_train(trainer) -> tuple[float, list[dict]]:
    with timed() as seconds:
        trainer.train()
    return seconds[0], trainer.state.log_history


def trl_sft(model_dir: Path, spec: Spec, scratch: Path, threads: int) -> Measurement:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    _quiet()
    model, tokenizer = _load(model_dir)
    args = SFTConfig(**_trl_common(spec, scratch, threads), max_length=spec.max_length, packing=False,
                     completion_only_loss=True)
    data = Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]}
                              for r in sft_data(spec.steps * spec.batch)])
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    counter = _CountingCollator(trainer.data_collator)
    trainer.data_collator = counter
    seconds, history = _trl_train(trainer)
    return Measurement(seconds, {"tokens": counter.tokens, "loss_tokens": counter.loss_tokens,
                                 "sum_sq_lengths": counter.sum_sq_lengths},
                       [h["loss"] for h in history if "loss" in h])


def trl_dpo(model_dir: Path, spec: Spec, scratch: Path, threads: int) -> Measurement:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    _quiet()
    model, tokenizer = _load(model_dir)
    args = DPOConfig(**_trl_common(spec, scratch, threads), beta=0.1, loss_type=["sigmoid"],
                     max_length=spec.max_length)
    data = Dataset.from_list(dpo_data(spec.steps * spec.batch))
    trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    seconds, history = _trl_train(trainer)
    return Measurement(seconds, {"pairs": float(spec.steps * spec.batch)},
                       [h["loss"] for h in history if "loss" in h])


def trl_grpo(model_dir: Path, spec: Spec, scratch: Path, threads: int) -> Measurement:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    _quiet()
    model, tokenizer = _load(model_dir)
    completions = spec.batch * spec.group
    common = _trl_common(spec, scratch, threads)
    common["per_device_train_batch_size"] = completions
    args = GRPOConfig(**common, num_generations=spec.group, max_completion_length=spec.new_tokens,
                      beta=spec.beta, loss_type="grpo", temperature=1.0, top_k=0, top_p=1.0,
                      num_iterations=1, steps_per_generation=1, log_completions=False)
    data = Dataset.from_list(grpo_data(spec.steps * spec.batch))
    trainer = GRPOTrainer(model=model, reward_funcs=[digit_reward], args=args, train_dataset=data,
                          processing_class=tokenizer)
    seconds, history = _trl_train(trainer)
    return Measurement(seconds, {"completions": float(spec.steps * completions)},
                       [h["reward"] for h in history if "reward" in h])


# ---- generation: the rollout engine against model.generate ---------------------------------------------
def generation(model_dir: Path, spec: Spec, library: str, threads: int, *, ignore_eos: bool,
               repeats: int = 1) -> Measurement:
    """Sampled decoding (temperature 1, no top-k / top-p) of ``spec.batch`` prompts, ``spec.new_tokens`` at most.

    Tokens are counted up to and including each row's first EOS on both sides (``model.generate`` keeps
    decoding finished rows as padding until the last row stops; the engine drops them). With
    ``ignore_eos`` every row decodes all ``spec.new_tokens`` tokens on both sides: the bare decode loops.
    """
    from tether.rollout import HFEngine, SamplingParams

    torch.set_num_threads(threads)
    model, tokenizer = _load(model_dir)
    model.eval()
    bf16 = spec.precision == "bf16-mixed"
    eos = tokenizer.eos_token_id
    prompts = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in grpo_data(spec.batch)]
    if library == "tether":
        engine = HFEngine(model, tokenizer, dtype="bfloat16" if bf16 else None)
        if ignore_eos:
            engine.eos_ids = []

        def go() -> int:
            rollout = engine.generate(prompts, SamplingParams(max_new_tokens=spec.new_tokens, seed=0))
            return sum(len(c) for c in rollout.completion_ids)
    else:  # "hf": model.generate
        model = model.to(torch.bfloat16) if bf16 else model
        enc = tokenizer.pad([{"input_ids": p} for p in prompts], padding_side="left", return_tensors="pt")
        kwargs = dict(do_sample=True, max_new_tokens=spec.new_tokens, top_k=0, top_p=1.0, temperature=1.0,
                      pad_token_id=tokenizer.pad_token_id)
        if ignore_eos:
            kwargs["min_new_tokens"] = spec.new_tokens

        def go() -> int:
            with torch.inference_mode():
                out = model.generate(**enc, **kwargs)
            completion = out[:, enc["input_ids"].shape[1]:]
            is_eos = completion == eos
            first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, completion.shape[1])
            return int(first.sum())
    go()  # warm-up
    with timed() as seconds:
        tokens = sum(go() for _ in range(repeats))
    return Measurement(seconds[0], {"tokens": float(tokens)}, [])


TRAINING = {
    "sft": {"tether": tether_sft, "trl": trl_sft},
    "dpo": {"tether": tether_dpo, "trl": trl_dpo},
    "grpo": {"tether": tether_grpo, "trl": trl_grpo},
}
