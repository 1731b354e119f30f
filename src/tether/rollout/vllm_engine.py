"""vLLM as a rollout engine on GPUs, colocated with the trainer (the optional extra ``tether[vllm]``).

``VLLMEngine`` wraps a ``vllm.LLM`` living in the trainer's process (on the trainer's GPU, taking
``gpu_memory_utilization`` of it) behind the :class:`~tether.rollout.GenerationEngine` protocol:
token-id prompts go in as ``{"prompt_token_ids": ...}``, and the sampled token ids, their log-probs
(``SamplingParams(logprobs=0)``: the sampled token's) and the finish reason come back as a
:class:`~tether.rollout.Rollout`. With ``source`` (the live policy) the engine pushes the policy's
weights into vLLM's model before each ``generate`` (``model.load_weights`` on the in-process model
runner, as TRL's colocate mode does) and resets the prefix cache, so every rollout batch samples from
the current weights; a LoRA policy is pushed as merged weights (``merge_adapter``, copy, ``unmerge``).

For a vLLM server on other GPUs use :class:`~tether.rollout.OpenAIEngine` against its
OpenAI-compatible endpoint (weights are then the server's; there is no push).

How it departs from :class:`~tether.rollout.HFEngine`, honestly: vLLM's sampler and kernels are its
own, so samples differ from HFEngine's for the same seed; the returned log-probs follow vLLM's
``logprobs_mode`` (``processed_logprobs`` is asked for when the vLLM version has it: after the
temperature, and after top-k / top-p truncation when those are on, where tether's protocol is before
truncation); RL trainers recompute old log-probs from the policy anyway. A sample's ``seed`` is
``params.seed`` plus its prompt's position, so samples do not depend on how prompts are batched.
Tested only where vLLM and a GPU are present (tests/rollout/test_vllm_engine.py skips otherwise).
"""

from __future__ import annotations

import inspect
import tempfile
from pathlib import Path
from typing import Any

import torch

from tether.rollout.base import Rollout, SamplingParams
from tether.rollout.weights import merged_weights


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as err:
        raise ImportError("the vLLM engine needs the optional extra (and a GPU): pip install 'tether[vllm]'") from err
    return vllm


def vllm_sampling_params(params: SamplingParams, *, seed: int | None) -> Any:
    """tether's :class:`SamplingParams` as vLLM's (greedy as temperature 0; stop strings kept in the text)."""
    vllm = import_vllm()
    return vllm.SamplingParams(
        n=params.n, temperature=0.0 if params.is_greedy else params.temperature, top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1, max_tokens=params.max_new_tokens, stop=list(params.stop),
        include_stop_str_in_output=True, seed=seed, logprobs=0,
    )


class VLLMEngine:
    """A colocated ``vllm.LLM`` as a :class:`GenerationEngine` (see the module docstring).

    ``llm``: a ``vllm.LLM``. ``source``: the trainer's live model, pushed before each ``generate``.
    Build both from a live model with :meth:`colocated`.
    """

    def __init__(self, llm: Any, tokenizer: Any, *, source: torch.nn.Module | None = None) -> None:
        self.llm, self.tokenizer, self.source = llm, tokenizer, source
        self.weight_pushes = 0

    @classmethod
    def colocated(cls, model: torch.nn.Module, tokenizer: Any, *, gpu_memory_utilization: float = 0.3,
                  **llm_kwargs: Any) -> VLLMEngine:
        """A ``vllm.LLM`` of the same architecture on this process's GPU, built from ``model``'s config
        (saved to a temporary folder, ``load_format="dummy"``: the weights are pushed before each
        ``generate``). Under torchrun each rank gets its own (``distributed_executor_backend=
        "external_launcher"``, seeded by rank)."""
        vllm = import_vllm()
        import torch.distributed as dist

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        folder = Path(tempfile.mkdtemp(prefix="tether-vllm-"))
        base.config.save_pretrained(folder)  # the architecture only: weights come by push_weights
        tokenizer.save_pretrained(folder)
        kwargs: dict[str, Any] = {"model": str(folder), "load_format": "dummy",
                                  "gpu_memory_utilization": gpu_memory_utilization,
                                  "dtype": str(next(base.parameters()).dtype).removeprefix("torch.")}
        accepted = inspect.signature(vllm.EngineArgs).parameters
        if "logprobs_mode" in accepted:
            kwargs["logprobs_mode"] = "processed_logprobs"
        if dist.is_available() and dist.is_initialized():
            kwargs.update(distributed_executor_backend="external_launcher", seed=dist.get_rank())
        kwargs.update(llm_kwargs)
        return cls(vllm.LLM(**kwargs), tokenizer, source=model)

    def push_weights(self) -> None:
        """Copy ``source``'s current weights into vLLM's model (in place, no reload)."""
        runner_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        runner_model.load_weights(merged_weights(self.source))
        if hasattr(self.llm, "reset_prefix_cache"):  # cached prefixes were computed with the old weights
            self.llm.reset_prefix_cache()
        self.weight_pushes += 1

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        if self.source is not None:
            self.push_weights()
        requests = [{"prompt_token_ids": [int(x) for x in p]} for p in prompts]
        sampling = [vllm_sampling_params(params, seed=None if params.seed is None else params.seed + i)
                    for i in range(len(prompts))]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        fields: dict[str, list] = {k: [] for k in ("prompt_ids", "completion_ids", "completion_logprobs",
                                                   "finish_reasons", "prompt_index", "texts")}
        for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
            for sample in out.outputs:
                ids = list(sample.token_ids)
                logprobs = [step[token].logprob for step, token in zip(sample.logprobs or [], ids, strict=False)]
                fields["prompt_ids"].append(list(prompt))
                fields["completion_ids"].append(ids)
                fields["completion_logprobs"].append(logprobs + [float("nan")] * (len(ids) - len(logprobs)))
                fields["finish_reasons"].append("length" if sample.finish_reason == "length" else "stop")
                fields["prompt_index"].append(i)
                fields["texts"].append(sample.text)
        return Rollout(**fields)
