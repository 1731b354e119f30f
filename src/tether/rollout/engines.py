"""Which generation engine a trainer samples with, by name: ``hf`` (in process), ``vllm`` (colocated on the
GPU) or ``ray`` (rollout workers on a Ray cluster). The optional engines import their extra only when chosen.
:class:`TextFunctionEngine` turns a plain text function into an engine (a rule-based judge served over HTTP)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tether.rollout.base import Rollout, SamplingParams

ENGINES = ("hf", "vllm", "ray")


def build_engine(kind: str, model: torch.nn.Module, tokenizer: Any, *, batch_size: int | None = None,
                 workers: int = 2, worker_model: dict[str, Any] | None = None,
                 options: dict[str, Any] | None = None) -> Any:
    """An engine that samples from the live ``model``.

    ``hf``: :class:`HFEngine` on the model itself. ``vllm``: :class:`VLLMEngine.colocated` (``options``
    are ``vllm.LLM`` arguments, e.g. ``gpu_memory_utilization``). ``ray``: ``workers`` Ray actors, each
    loading ``worker_model`` (``load_model`` arguments: ``name_or_path``, ``seed``, ...) once, then taking
    the live weights before every batch (``options``: ``num_cpus``, ``num_gpus``, ``address``, ``threads``,
    ``dtype``: the workers' sampling dtype).
    """
    options = dict(options or {})
    if kind == "hf":
        from tether.rollout.hf_engine import HFEngine

        return HFEngine(model, tokenizer, batch_size=batch_size, **options)
    if kind == "vllm":
        from tether.rollout.vllm_engine import VLLMEngine

        return VLLMEngine.colocated(model, tokenizer, **options)
    if kind == "ray":
        from tether.rollout.ray_engine import HFWorker, RayEngine

        spec = dict(worker_model or {})
        if "name_or_path" not in spec:
            raise ValueError("the ray engine needs worker_model['name_or_path'] to build each worker's model")
        engine = {"batch_size": batch_size}
        if "dtype" in options:
            engine["dtype"] = options.pop("dtype")
        factory = HFWorker(spec.pop("name_or_path"), model=spec, engine=engine,
                           threads=int(options.pop("threads", 1)))
        return RayEngine(factory, num_workers=workers, source=model, **options)
    raise ValueError(f"unknown rollout engine {kind!r}; valid: {', '.join(ENGINES)}")


class TextFunctionEngine:
    """``fn(prompt texts) -> one reply each`` as a generation engine: each prompt's ``n`` samples are its one
    deterministic reply, re-tokenised, with log-probs 0. So ``tether.serve.create_app(engine=...)`` serves a
    Python function (``tether.tasks.secret.rule_judge``, say) over HTTP like a model."""

    def __init__(self, fn: Callable[[Sequence[str]], list[str]], tokenizer: Any) -> None:
        self.fn, self.tokenizer = fn, tokenizer

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        texts = self.fn([self.tokenizer.decode(p, skip_special_tokens=True) for p in prompts])
        texts = [t for t in texts for _ in range(params.n)]
        index = [i for i in range(len(prompts)) for _ in range(params.n)]
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        return Rollout([list(prompts[i]) for i in index], ids, [[0.0] * len(i) for i in ids],
                       ["stop"] * len(ids), index, texts)
