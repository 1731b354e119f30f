"""Rollout workers on Ray: a :class:`~tether.rollout.GenerationEngine` whose prompts are decoded by N actors.

Each actor builds its own engine once, from ``factory`` (a picklable zero-argument callable; the
default :class:`HFWorker` loads a model with ``tether.models.load_model`` and wraps it in an
:class:`~tether.rollout.HFEngine`). ``generate`` cuts the prompts into contiguous shards, one per
actor, and concatenates the rollouts in order. With ``source`` (the trainer's live model) the
current weights are put in Ray's object store once per ``generate`` and loaded by every actor
first, so the workers sample from the policy being trained.

How it departs from one in-process engine: a shard's ``seed`` is ``params.seed`` plus the index of
its first prompt, so the samples depend on the number of workers (greedy decoding does not).
Optional extra ``tether[ray]``; tested on a local Ray instance with 2 CPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from tether.rollout.base import Rollout, SamplingParams
from tether.rollout.weights import merged_weights
from tether.runtime.ray import ensure_ray, shards


@dataclass
class HFWorker:
    """Builds an :class:`HFEngine` inside a worker: ``load_model(name_or_path, **model)`` then
    ``HFEngine(model, tokenizer, **engine)``; ``threads`` torch threads per worker."""

    name_or_path: str
    model: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    threads: int = 1

    def __call__(self) -> Any:
        from tether.models.loading import load_model
        from tether.rollout.hf_engine import HFEngine

        torch.set_num_threads(self.threads)
        model, tokenizer = load_model(self.name_or_path, **self.model)
        return HFEngine(model.eval(), tokenizer, **self.engine)


class _RolloutActor:
    def __init__(self, factory: Callable[[], Any]) -> None:
        self.engine = factory()

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        model = self.engine.model
        device = next(model.parameters()).device
        missing, unexpected = model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False)
        tied = set(getattr(model, "_tied_weights_keys", None) or [])
        if unexpected or [k for k in missing if k not in tied]:
            raise ValueError(f"pushed weights do not fit the worker's model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        return self.engine.generate(prompts, params)


class RayEngine:
    """Prompts decoded by ``num_workers`` Ray actors (see the module docstring).

    ``num_cpus`` / ``num_gpus``: what each actor reserves. ``address``: a Ray cluster to join;
    default a local instance (or the one already running).
    """

    def __init__(self, factory: Callable[[], Any], *, num_workers: int = 2, source: torch.nn.Module | None = None,
                 num_cpus: float = 1, num_gpus: float = 0, address: str | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.ray = ensure_ray(address)
        self.source = source
        actor = self.ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(_RolloutActor)
        self.actors = [actor.remote(factory) for _ in range(num_workers)]

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Every worker's model takes these weights (put in the object store once)."""
        ref = self.ray.put({k: v.detach().cpu() for k, v in state.items()})
        self.ray.get([a.load_weights.remote(ref) for a in self.actors])

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        if self.source is not None:  # the live policy (a LoRA adapter merged), unwrapped from DDP
            source = self.source.module if isinstance(self.source, torch.nn.parallel.DistributedDataParallel) \
                else self.source
            self.load_weights(dict(merged_weights(source)))
        ranges = shards(len(prompts), len(self.actors))
        refs = [actor.generate.remote(prompts[s:e], params if params.seed is None else replace(params, seed=params.seed + s))
                for actor, (s, e) in zip(self.actors, ranges, strict=False)]
        return Rollout.concat(self.ray.get(refs))

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
