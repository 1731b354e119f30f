"""The colocated vLLM engine. Its generation tests need vLLM and a CUDA GPU and are skipped otherwise, with
the reason printed (``pytest -rs``); the LoRA weight merge it pushes is checked on CPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tether.models import apply_lora, build_tiny
from tether.rollout import HFEngine, SamplingParams
from tether.rollout.weights import merged_weights


def needs_vllm_and_gpu():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install 'tether[vllm]'; it needs a CUDA GPU)")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: the vLLM engine runs on GPUs only")


def test_lora_weights_are_pushed_merged_under_the_base_names():
    model, _ = build_tiny("tiny", seed=0)
    names = set(model.state_dict())
    lora = apply_lora(model, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    with torch.no_grad():  # a non-zero adapter, so merging changes the weights
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    pushed = dict(merged_weights(lora))
    assert set(pushed) == names
    again = dict(merged_weights(lora))  # the adapter was unmerged after the copy: the same weights again
    merged = lora.merge_and_unload().state_dict()
    for name in names:
        torch.testing.assert_close(again[name], pushed[name], msg=name)
        torch.testing.assert_close(pushed[name], merged[name], msg=name)


def test_greedy_vllm_matches_hf_engine_and_follows_pushed_weights():
    needs_vllm_and_gpu()
    from tether.rollout.vllm_engine import VLLMEngine

    model, tokenizer = build_tiny("tiny", seed=0)
    model = model.cuda()
    engine = VLLMEngine.colocated(model, tokenizer, gpu_memory_utilization=0.2, enforce_eager=True)
    prompts = [tokenizer("12+30=")["input_ids"], tokenizer("7+5=")["input_ids"]]
    params = SamplingParams(greedy=True, max_new_tokens=12)
    assert engine.generate(prompts, params).completion_ids == HFEngine(model, tokenizer).generate(
        prompts, params).completion_ids
    with torch.no_grad():  # new weights: the next generate pushes them first
        model.lm_head.weight.mul_(-1.0)
    got = engine.generate(prompts, params)
    assert got.completion_ids == HFEngine(model, tokenizer).generate(prompts, params).completion_ids
    assert engine.weight_pushes == 2


def test_sampled_rollouts_follow_the_protocol():
    needs_vllm_and_gpu()
    from tether.rollout.vllm_engine import VLLMEngine

    model, tokenizer = build_tiny("tiny", seed=0)
    engine = VLLMEngine.colocated(model.cuda(), tokenizer, gpu_memory_utilization=0.2, enforce_eager=True)
    rollout = engine.generate([tokenizer("12+30=")["input_ids"]] * 2,
                              SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=1))
    assert len(rollout) == 6 and rollout.prompt_index == [0, 0, 0, 1, 1, 1]
    assert all(len(lp) == len(ids) for lp, ids in zip(rollout.completion_logprobs, rollout.completion_ids,
                                                       strict=True))
    assert set(rollout.finish_reasons) <= {"stop", "length"}
