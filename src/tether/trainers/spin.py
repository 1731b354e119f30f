"""SPIN: self-play fine-tuning, DPO rounds whose rejected responses are the model's own generations.

Chen et al. 2024, "Self-Play Fine-Tuning Converts Weak Language Models to Strong Language Models".
Iteration t: the current model p_θt answers the SFT prompts; each pair is (the SFT demonstration as
chosen, the model's generation as rejected); θ_{t+1} minimises the logistic loss of Eq. 4.7,
``log(1 + exp(-λ [log p_θ(y|x)/p_θt(y|x) - log p_θ(y'|x)/p_θt(y'|x)]))``, which is DPO's sigmoid
loss with β = λ and the *previous iterate* θt as reference. No judge and no reward: the SFT data is
the only signal, and the game ends when the model's generations are indistinguishable from it.

Built on :class:`~tether.trainers.online_preference.OnlinePreferenceTrainer` (a round there is an
iteration here): ``reference: round`` makes each round's reference log-probs the policy's own at the
round's start, i.e. θt. How it departs from the paper: each iteration uses ``prompts_per_round``
prompts (the paper regenerates for all of them), the policy is trained on from θt rather than
re-initialised, any ``PREFERENCE_LOSSES`` loss can replace the logistic one (``loss: rpo`` adds the
chosen NLL, which the tiny models need; see the recipe), and a generation that equals its
demonstration makes no pair (its log-ratio difference would be zero); their share is logged as
``round/match_rate``, which approaches 1 as the model converges to the data.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from tether.config import TaskSource
from tether.pipeline import register_stage
from tether.trainers.online_preference import OnlineDPOConfig, OnlinePreferenceTrainer, OnlineRolloutConfig
from tether.trainers.parallel import full_parameters
from tether.trainers.rl import RLDataConfig

NOT_FOR_SPIN = ("scorer", "pairs", "self_rewarding", "mode", "audit")


class SPINRolloutConfig(OnlineRolloutConfig):
    samples: int = Field(1, ge=1, description="generations per prompt, each paired with the demonstration")
    temperature: float = Field(1.0, ge=0, description="0: greedy, the model's most likely answer")


class SPINConfig(OnlineDPOConfig):
    """SPIN. ``data``: SFT demonstrations (``prompt`` + ``completion`` file, or a task with ``think``);
    ``rounds``: SPIN iterations; ``loss`` / ``beta``: the preference loss and λ."""

    type: Literal["spin"] = "spin"
    data: RLDataConfig = Field(default_factory=lambda: RLDataConfig(task=TaskSource()))
    rollout: SPINRolloutConfig = Field(default_factory=SPINRolloutConfig)
    reference: Literal["initial", "round"] = Field("round", description="round: the previous iterate (SPIN)")

    @model_validator(mode="after")
    def _spin_only(self) -> SPINConfig:
        unused = sorted(set(NOT_FOR_SPIN) & self.model_fields_set)
        if unused:
            raise ValueError(f"spin takes no {', '.join(unused)}: chosen is the SFT demonstration and rejected the "
                             "model's generation, with no scorer")
        if self.data.chat:
            raise ValueError("spin works on prompt / completion text; data.chat is not supported")
        return self


def spin_records(data: RLDataConfig) -> list[dict]:
    """The SFT demonstrations SPIN plays against: ``{"prompt", "completion"}`` records."""
    if data.path is not None:
        from tether.data import load_records

        return load_records(data.path, "prompt_completion")
    from tether.tasks import get_task, sft_records

    source = data.task
    return sft_records(get_task(source.name, **source.options), source.n, seed=source.seed, think=source.think)


def spin_pairs(prompts: list[str], demos: list[str], generations: list[str]) -> tuple[list[dict], int]:
    """SPIN pairs: (prompt, chosen = demonstration, rejected = generation) for every generation that differs
    from its demonstration (whitespace-stripped); returns the pairs and how many generations matched."""
    pairs, matched = [], 0
    for k, (prompt, demo, text) in enumerate(zip(prompts, demos, generations, strict=True)):
        if text.strip() == demo.strip():
            matched += 1
            continue
        pairs.append({"sample": k, "prompt": prompt, "chosen": demo, "rejected": text})
    return pairs, matched


class SPINTrainer(OnlinePreferenceTrainer):
    """Online preference rounds whose pairs are (demonstration, own generation)."""

    def collect(self, r: int) -> tuple[list[dict], list[dict], dict[str, float]]:
        indices = self.round_prompts(r)
        start = time.perf_counter()
        with full_parameters(self.model):
            rollout = self.engine.generate([self.prompt_ids[i] for i in indices], self.sampling_params(r))
        prompt_of = [indices[g] for g in rollout.prompt_index]
        demos = [self.records[i]["completion"] for i in prompt_of]
        pairs, matched = spin_pairs([self.prompts[i] for i in prompt_of], demos, rollout.texts)
        for pair in pairs:
            pair["prompt_id"] = prompt_of[pair["sample"]]
        samples = [{"prompt_id": i, "completion": t, "matches_demo": t.strip() == d.strip(), "finish_reason": f}
                   for i, t, d, f in zip(prompt_of, rollout.texts, demos, rollout.finish_reasons, strict=True)]
        figures = {"round/samples": len(samples), "round/pairs": len(pairs), "round/match_rate": matched / len(samples),
                   "round/prompts": len(indices), "round/generation_time": time.perf_counter() - start}
        return samples, pairs, figures

    def start_round(self, r: int) -> None:
        super().start_round(r)
        done = self.round_dir(r) / "round.json"
        if done.exists():
            self.results[f"round_{r + 1}/match_rate"] = json.loads(done.read_text())["figures"]["round/match_rate"]


def train_spin(config: SPINConfig | dict, *, out: str | Path, model: Any = None, tokenizer: Any = None,
               dataset: Any = None, resume: bool = False) -> dict[str, float]:
    """SPIN iterations from an SFT model on its SFT data.

    ``dataset``: demonstrations (``prompt`` + ``completion``; file, list of dicts or ``datasets.Dataset``)
    replacing ``config.data``. Writes the last iterate to ``out/<stage>`` and each iteration's generations
    and pairs to ``out/<stage>/rounds/``; returns ``round_N/*`` figures per iteration (held-out task
    figures with ``config.eval``; ``before/*`` with ``eval.before``) and the last iterate's."""
    from tether.models.loading import resolve_model

    cfg = config if isinstance(config, SPINConfig) else SPINConfig.model_validate(config)
    model, tokenizer = resolve_model(model, tokenizer, cfg.model)
    if dataset is not None:
        from tether.data import load_records

        records = load_records(dataset, "prompt_completion")
    else:
        records = spin_records(cfg.data)
    trainer = SPINTrainer(cfg, model, tokenizer, out, records=records, stage=cfg.name or cfg.type)
    return trainer.fit(resume=resume)


@register_stage("spin", SPINConfig, "SPIN: DPO iterations, chosen = SFT demonstration, rejected = own generation, "
                                    "reference = previous iterate")
def run_spin(cfg: SPINConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    return train_spin(cfg, out=run_dir, resume=resume)
