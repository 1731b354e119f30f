"""Reward scoring spread over Ray actors: slow verifiers, sandboxed code tests or judges scale out.

:class:`RayRewardComposer` is a drop-in for :class:`~tether.rewards.RewardComposer`: the same specs,
the same ``score(prompts, completions, columns) -> RewardResult``, the same combination rule, the
same errors. A batch is cut into contiguous shards, one per actor; each actor holds its own
``RewardComposer`` built from the specs (registered names and import paths are resolved in the
actor; a Python callable travels by Ray's cloudpickle, by value when it is a lambda or defined in
``__main__``, by reference otherwise, so its module must be importable on the workers). The shards'
results are concatenated in order, so the rewards equal the in-process ones exactly (tested).

Ray is an optional extra (``pip install "tether[ray]"``). Without an ``address`` and with no Ray
running, ``ray.init`` starts a local instance; pass ``address="auto"`` (or set ``RAY_ADDRESS``) to
join a cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from tether.config.rewards import RewardSpec
from tether.rewards.combine import RewardComposer, RewardFunctionError, RewardResult
from tether.runtime.ray import ensure_ray, shards


class _ScoringActor:
    """One Ray actor: a ``RewardComposer`` of its own, made by ``factory(specs, on_error=...)``."""

    def __init__(self, specs: list[RewardSpec], on_error: str, factory: Callable[..., Any]) -> None:
        self.composer = factory(specs, on_error=on_error)

    def score(self, prompts: list[str], completions: list[str], columns: dict[str, list]
              ) -> RewardResult | dict[str, Any]:
        try:
            return self.composer.score(prompts, completions, columns)
        except RewardFunctionError as err:  # its keyword-only fields do not survive pickling: send them
            return {"message": str(err), "function": err.function, "index": err.index, "prompt": err.prompt,
                    "completion": err.completion}


def merge_results(results: Sequence[RewardResult]) -> RewardResult:
    """Results of consecutive shards as one result over the whole batch."""
    labels = list(results[0].per_function)
    return RewardResult(
        total=torch.cat([r.total for r in results]),
        per_function={k: torch.cat([r.per_function[k] for r in results]) for k in labels},
        valid=torch.cat([r.valid for r in results]),
        errors={k: sum(r.errors[k] for r in results) for k in labels},
        nonfinite={k: sum(r.nonfinite[k] for r in results) for k in labels},
        timeouts={k: sum(r.timeouts.get(k, 0) for r in results) for k in labels},
        weights=results[0].weights,
    )


class RayRewardComposer:
    """A :class:`RewardComposer` whose batches are scored by ``num_workers`` Ray actors.

    ``num_cpus``: CPUs each actor reserves (its verifier's or sandbox's parallelism). ``address``:
    a Ray cluster to join; default a local instance (or the one already running). ``factory``: how an
    actor builds its composer from the specs (``tether.scoring.local_reward_composer`` builds judges too).
    """

    def __init__(self, specs: Sequence[RewardSpec | dict], *, on_error: Literal["raise", "zero"] = "raise",
                 num_workers: int = 2, num_cpus: float = 1, address: str | None = None,
                 factory: Callable[..., Any] = RewardComposer) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        local = RewardComposer(specs, on_error=on_error)  # validates the specs here, before any actor starts
        self.specs, self.labels, self.on_error, self.factory = local.specs, local.labels, on_error, factory
        self.ray = ensure_ray(address)
        actor = self.ray.remote(num_cpus=num_cpus)(_ScoringActor)
        self.actors = [actor.remote(self.specs, on_error, factory) for _ in range(num_workers)]

    def score(self, prompts: list[str], completions: list[str], columns: dict[str, Sequence] | None = None
              ) -> RewardResult:
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"got {len(prompts)} prompts for {n} completions")
        columns = {k: list(v) for k, v in (columns or {}).items()}
        if n == 0:
            return self.factory(self.specs, on_error=self.on_error).score(prompts, completions, columns)
        ranges = shards(n, len(self.actors))
        refs = [a.score.remote(prompts[s:e], completions[s:e], {k: v[s:e] for k, v in columns.items()})
                for a, (s, e) in zip(self.actors, ranges, strict=False)]
        results = []
        for ref, (start, _) in zip(refs, ranges, strict=False):
            try:
                result = self.ray.get(ref)
            except self.ray.exceptions.RayTaskError as err:  # a protocol or column error: the cause itself
                cause = getattr(err, "cause", None)
                raise (cause if isinstance(cause, Exception) else err) from err
            if isinstance(result, dict):  # a RewardFunctionError in that shard; its sample number -> the batch's
                index = None if result["index"] is None else result["index"] + start
                raise RewardFunctionError(result["message"], function=result["function"], index=index,
                                          prompt=result["prompt"], completion=result["completion"])
            results.append(result)
        return merge_results(results)

    def close(self) -> None:
        """End the actors (a composer is not usable afterwards)."""
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
