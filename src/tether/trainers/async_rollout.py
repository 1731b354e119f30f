"""Asynchronous RL with bounded staleness that stays a pure function of the seed.

With ``async: {max_staleness: K}`` (K >= 1; GRPO family, PPO and the agent trainer) a rollout producer in its own process (torch multiprocessing,
``spawn``) generates while the learner trains. The schedule is fixed in advance, never decided by
timing: the batch of step s is sampled by policy version ``v(s) = max(0, s - K)`` (version v = the
weights after v updates), from the prompts the learner drew for step s, with step s's sampling seed.
The learner sends, in one ordered queue, the weights of each new version and the generate request of
the step that version serves (after the update of step s: version s + 1, then the request of step
s + 1 + K), so the producer, which handles its queue in order, always holds exactly ``v(s)`` when it
samples step s, and the learner takes the batches in step order. Staleness is bounded by this pacing
(the producer can run at most K steps ahead), not by dropping slow rollouts, and a run with K = 1 is
bitwise the same run every time. ``max_staleness: 0`` is the synchronous loop.

What the producer runs is a picklable sampler spec (:class:`EngineSampler`: the stage's engine, ``hf``,
``vllm`` or ``ray``, built in the producer on its own copy of the weights; the agent trainer's
:class:`~tether.trainers.agent.EpisodeSampler`: the multi-turn loop with its environment and tools), so
the learner's side is the same for every trainer.

Off-policy samples are corrected by the rollout-correction machinery: every sample carries the
producer's log-probs, which are the behaviour policy; the proximal policy is the learner's current one
(the old-policy pass, recomputed); ``rollout_correction`` truncates the importance weights (the config
refuses async without a correction mode).

Resume: a checkpoint after step s keeps the prompts of the requested steps s .. s + K and the weights of
versions s - K .. s - 1 (CPU copies; version s is the checkpointed model), so a resumed run re-sends the
same requests and gets the same batches. Under torchrun (DDP) each rank runs its own producer on its own
prompts; the checkpoint is rank 0's, so each rank recomputes its requested prompts from the prompt cursor. Logged: ``async/staleness_mean``, ``async/staleness_max``,
``async/generation_busy`` (the producer's sampling time over the step's wall time), ``async/training_busy``
(the learner's time not spent waiting for a batch), ``async/wait_s``.
"""

from __future__ import annotations

import io
import os
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tether.config.base import ConfigError

_POLL_S = 1.0  # how often a waiting producer checks that the learner is alive


def _to_bytes(value: Any) -> bytes:
    """``value`` (a model, a state dict) serialised whole. Weights cross to the producer as bytes, not as
    shared-memory tensor handles: those ride on a helper thread of the sending process, which a process
    forked after one was started (a test harness, a job runner) cannot use."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    """What :func:`_to_bytes` wrote, on the CPU (a policy trained on an accelerator samples there too)."""
    return torch.load(io.BytesIO(data), weights_only=False, map_location="cpu")


class Sampler(Protocol):
    """What the producer process runs: ``build(model, tokenizer)`` once, in the producer, gives the function
    that turns one request's payload and sampling parameters into its rollout."""

    def build(self, model: torch.nn.Module, tokenizer: Any) -> Callable[[Any, Any], Any]: ...


@dataclass(frozen=True)
class EngineSampler:
    """One ``generate`` call of the stage's engine per request (payload: the prompts' token ids)."""

    engine: str = "hf"
    batch_size: int | None = None
    workers: int = 2
    options: dict[str, Any] = field(default_factory=dict)
    worker_model: dict[str, Any] | None = None

    @classmethod
    def of(cls, config: Any) -> EngineSampler:
        """The engine an RL stage's ``config`` names (``rollout.engine`` and its settings; Ray workers load
        ``model``), sampling in ``train.sampler_dtype`` unless ``rollout.engine_options`` names a ``dtype``."""
        r = config.rollout
        options = dict(r.engine_options)
        if config.train.sampler_dtype is not None:
            options.setdefault("dtype", config.train.sampler_dtype)
        return cls(r.engine, r.engine_batch_size, r.workers, options,
                   config.model.model_dump(exclude={"lora", "device"}))

    def build_engine(self, model: torch.nn.Module, tokenizer: Any) -> Any:
        """The engine, sampling from ``model`` (the producer's copy of the weights)."""
        from tether.rollout.engines import build_engine

        return build_engine(self.engine, model, tokenizer, batch_size=self.batch_size, workers=self.workers,
                            options=self.options, worker_model=self.worker_model)

    def build(self, model: torch.nn.Module, tokenizer: Any) -> Callable[[Any, Any], Any]:
        return self.build_engine(model, tokenizer).generate


def _producer_main(model_bytes: bytes, tokenizer: Any, sampler: Sampler, threads: int, requests: Any,
                   results: Any, parent: int) -> None:
    """The producer process: apply weight updates and sample requests strictly in queue order."""
    torch.set_num_threads(threads)
    model = _from_bytes(model_bytes).eval()
    sample = sampler.build(model, tokenizer)
    version = None
    while True:
        try:
            kind, payload = requests.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:  # the learner died (SIGKILL): do not linger
                return
            continue
        try:
            if kind == "stop":
                return
            if kind == "weights":
                version, state = payload
                model.load_state_dict(_from_bytes(state))
            elif kind == "generate":
                step, wanted, request, params = payload
                if wanted != version:
                    raise RuntimeError(f"step {step} needs policy version {wanted}, the producer holds {version}")
                start = time.perf_counter()
                with torch.no_grad():
                    rollout = sample(request, params)
                results.put(("rollout", (step, version, rollout, time.perf_counter() - start)))
        except Exception:  # reported to the learner, which raises it
            results.put(("error", traceback.format_exc()))
            return


def _cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


class AsyncRollouts:
    """The learner's side: the producer process, the requests in flight, the last K versions' weights.

    ``draw(step)`` picks a step's prompt indices (advancing the learner's prompt order; called once per
    step, in step order); ``request_of(step, indices)`` gives the sampler's payload for them (prompt ids,
    or the agent's task records) and the step's sampling parameters (a pure function, so a resumed run
    rebuilds a request from its indices).
    """

    def __init__(self, policy: torch.nn.Module, tokenizer: Any, *, sampler: Sampler, max_staleness: int,
                 threads: int, max_steps: int, draw: Callable[[int], list[int]],
                 request_of: Callable[[int, list[int]], tuple[Any, Any]]) -> None:
        self.policy, self.k, self.max_steps = policy, max_staleness, max_steps
        self.draw, self.request_of = draw, request_of
        context = torch.multiprocessing.get_context("spawn")
        self.requests, self.results = context.Queue(), context.Queue()
        self.process = context.Process(target=_producer_main, daemon=True, args=(
            _to_bytes(policy), tokenizer, sampler, threads, self.requests,
            self.results, os.getpid()))
        self.pending: dict[int, list[int]] = {}  # step -> its prompt indices, requested, not yet taken
        self.versions: dict[int, dict[str, torch.Tensor]] = {}  # version -> weights, the last K + 1 kept
        self.started = False

    def version_of(self, step: int) -> int:
        return max(0, step - self.k)

    def start(self, step: int, restored: dict[str, Any] | None = None) -> None:
        """Start the producer before step ``step`` (0, or a resumed step with ``restored`` = :meth:`state`)."""
        self.process.start()
        self.started = True
        if restored:
            self.versions = {int(v): w for v, w in restored["versions"].items()}
            self.pending = {int(s): list(i) for s, i in restored["pending"].items()}
        self.versions[step] = _cpu_state(self.policy)
        if restored is None:  # a fresh start: the first K + 1 steps all use version 0
            self.pending = {s: self.draw(s) for s in range(step, min(step + self.k + 1, self.max_steps))}
        sent: int | None = None
        for s in sorted(self.pending):
            if self.version_of(s) != sent:
                sent = self.version_of(s)
                self.requests.put(("weights", (sent, _to_bytes(self.versions[sent]))))
            self._send(s)
        self._keep_last_versions(step)

    def _send(self, step: int) -> None:
        request, params = self.request_of(step, self.pending[step])
        self.requests.put(("generate", (step, self.version_of(step), request, params)))

    def take(self, step: int) -> tuple[list[int], Any, dict[str, float]]:
        """Step ``step``'s prompt indices, its rollout (sampled by version ``v(step)``) and the async figures."""
        start = time.perf_counter()
        while True:
            try:
                kind, payload = self.results.get(timeout=_POLL_S)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError("the rollout producer process died; see its output above (a script that "
                                       "runs async RL must start it under `if __name__ == '__main__':`, as "
                                       "spawn-based multiprocessing requires)") from None
                continue
            if kind == "error":
                raise RuntimeError(f"the rollout producer failed:\n{payload}")
            got, version, rollout, seconds = payload
            if got != step:
                raise RuntimeError(f"the producer sent step {got}'s rollout while step {step} was expected")
            break
        staleness = float(step - version)
        return self.pending.pop(step), rollout, {"async/staleness_mean": staleness, "async/staleness_max": staleness,
                                                 "async/wait_s": time.perf_counter() - start,
                                                 "async/generation_s": seconds}

    def published(self, step: int) -> None:
        """After step ``step``'s update: send version ``step + 1`` and the request of the step it serves."""
        version = step + 1
        self.versions[version] = _cpu_state(self.policy)
        target = version + self.k
        if target < self.max_steps:
            self.requests.put(("weights", (version, _to_bytes(self.versions[version]))))
            self.pending[target] = self.draw(target)
            self._send(target)
        self._keep_last_versions(version)

    def _keep_last_versions(self, current: int) -> None:
        for v in [v for v in self.versions if v < current - self.k]:
            del self.versions[v]

    def state(self, current: int) -> dict[str, Any]:
        """What a checkpoint after ``current`` updates needs: the requested steps' prompts and the weights of
        versions ``current - K`` .. ``current - 1`` (``current`` is the checkpointed model)."""
        return {"pending": {s: list(i) for s, i in self.pending.items()},
                "versions": {v: w for v, w in self.versions.items() if v < current}}

    def close(self) -> None:
        """Stop the producer (after the last step, or when the trainer is done)."""
        if self.started and self.process.is_alive():
            self.requests.put(("stop", None))
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()
        self.started = False


class AsyncSteps:
    """The RL trainers' asynchronous collection (mixed into :class:`~tether.trainers.rl.RLTrainer`, which owns
    ``config``, ``policy``, ``next_prompts``, ``sampling_params`` and ``score``). A trainer whose samples are
    not one ``generate`` call overrides :meth:`async_sampler` and :meth:`sampling_request`."""

    async_rollouts: AsyncRollouts | None = None
    async_restored: dict[str, Any] | None = None
    _last_take: float | None = None
    prompt_cursor: int
    prompts_at: Callable[[int, int], list[int]]

    def async_sampler(self) -> Sampler:
        """What the producer runs: the stage's engine, built there on the producer's copy of the weights."""
        return EngineSampler.of(self.config)

    def sampling_request(self, indices: list[int]) -> Any:
        """The sampler's payload for these prompts: their token ids."""
        return [self.prompt_ids[i] for i in indices]

    def async_take(self) -> tuple[list[int], Any, dict[str, float]]:
        """Step ``self.step``'s prompt indices, what the sampler made of them and the async figures, from the
        producer (started on first use, from a checkpoint's state on resume)."""
        cfg = self.config
        if self.async_rollouts is None:
            from tether.trainers.parallel import is_sharded, unwrap

            if is_sharded(self.model):
                raise ConfigError("async under torchrun needs train.strategy ddp: each rank's producer holds the "
                                  "whole weights, which fsdp2 shards")
            self.async_rollouts = AsyncRollouts(
                unwrap(self.policy), self.tokenizer, sampler=self.async_sampler(),
                max_staleness=cfg.async_rollout.max_staleness, threads=cfg.async_rollout.threads,
                max_steps=cfg.train.max_steps, draw=lambda step: self.next_prompts(cfg.train.batch_size),
                request_of=lambda step, indices: (self.sampling_request(indices), self.sampling_params(0, step=step)))
            self.async_rollouts.start(self.step, self.restored_requests())
        indices, sampled, figures = self.async_rollouts.take(self.step)
        now = time.perf_counter()
        if self._last_take is not None:
            interval = now - self._last_take
            figures["async/generation_busy"] = min(1.0, figures["async/generation_s"] / interval)
            figures["async/training_busy"] = max(0.0, 1.0 - figures["async/wait_s"] / interval)
        self._last_take = now
        return indices, sampled, figures

    def restored_requests(self) -> dict[str, Any] | None:
        """A checkpoint's async state with this rank's prompts. The checkpoint (written by rank 0) names rank 0's;
        the requested steps are the last draws before the restored ``prompt_cursor``, one batch of every rank
        each, so every rank recomputes its own. Rank 0 checks them against the checkpoint's."""
        restored = self.async_restored
        if not restored:
            return restored
        steps, width = sorted(int(s) for s in restored["pending"]), self.config.train.batch_size
        stride = width * self.dist.world_size
        pending = {s: self.prompts_at(self.prompt_cursor - (len(steps) - i) * stride, width)
                   for i, s in enumerate(steps)}
        if self.dist.is_main and pending != {int(s): list(v) for s, v in restored["pending"].items()}:
            raise RuntimeError("the checkpoint's async requests do not follow from its prompt cursor; resume from "
                               "an earlier checkpoint")
        return {**restored, "pending": pending}

    def async_collect(self) -> tuple[list[int], Any, torch.Tensor, dict[str, Any]]:
        """Step ``self.step``'s prompt indices, rollout, rewards and figures (the async ones added)."""
        indices, rollout, figures = self.async_take()
        rewards, metrics = self.score(indices, rollout)
        metrics.update(figures)
        return indices, rollout, rewards, metrics

    def async_published(self) -> None:
        """After the update of step ``self.step``: the new weights to the producer; stopped after the last."""
        if self.async_rollouts is None:
            return
        self.async_rollouts.published(self.step)
        if self.step + 1 >= self.config.train.max_steps:
            self.async_rollouts.close()

    def async_state(self) -> dict[str, Any] | None:
        return self.async_rollouts.state(self.step) if self.async_rollouts is not None else self.async_restored
