"""Which generation engine a trainer samples with, by name: ``hf`` (in process), ``vllm`` (colocated on the
GPU) or ``ray`` (rollout workers on a Ray cluster). The optional engines import their extra only when chosen."""

from __future__ import annotations

from typing import Any

import torch

ENGINES = ("hf", "vllm", "ray")


def build_engine(kind: str, model: torch.nn.Module, tokenizer: Any, *, batch_size: int | None = None,
                 workers: int = 2, worker_model: dict[str, Any] | None = None,
                 options: dict[str, Any] | None = None) -> Any:
    """An engine that samples from the live ``model``.

    ``hf``: :class:`HFEngine` on the model itself. ``vllm``: :class:`VLLMEngine.colocated` (``options``
    are ``vllm.LLM`` arguments, e.g. ``gpu_memory_utilization``). ``ray``: ``workers`` Ray actors, each
    loading ``worker_model`` (``load_model`` arguments: ``name_or_path``, ``seed``, ...) once, then taking
    the live weights before every batch (``options``: ``num_cpus``, ``num_gpus``, ``address``, ``threads``).
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
        factory = HFWorker(spec.pop("name_or_path"), model=spec, engine={"batch_size": batch_size},
                           threads=int(options.pop("threads", 1)))
        return RayEngine(factory, num_workers=workers, source=model, **options)
    raise ValueError(f"unknown rollout engine {kind!r}; valid: {', '.join(ENGINES)}")
