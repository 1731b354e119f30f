"""The static-cache decode path against the generic Hugging Face forward, on several architectures."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tether.models.loading import apply_lora
from tether.models.tiny import build_tiny
from tether.rollout import HFEngine, SamplingParams, static_decoder

pytestmark = pytest.mark.usefixtures("one_thread")  # the shared fixture in conftest.py


def _arch(name: str):
    torch.manual_seed(0)
    common = dict(vocab_size=109, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if name == "llama-gqa":
        return LlamaForCausalLM(LlamaConfig(**common, attention_bias=False)).eval()
    if name == "llama-bias":
        return LlamaForCausalLM(LlamaConfig(**common, attention_bias=True)).eval()
    if name == "qwen2":  # q / k / v biases, no o bias
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    raise ValueError(name)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny("tiny")[1]


def _prompts(tokenizer, n=6):
    return [[1, *tokenizer.encode(f"{i} + {i * 3} = ?" + "x" * (i % 4), add_special_tokens=False)]
            for i in range(n)]


@pytest.mark.parametrize("arch", ["tiny", "llama-gqa", "qwen2"])
def test_static_path_gives_the_generic_paths_tokens_and_logprobs(arch, tokenizer):
    model = build_tiny("tiny")[0].eval() if arch == "tiny" else _arch(arch)
    assert static_decoder.supports(model, 64)
    prompts = _prompts(tokenizer)
    for params in (SamplingParams(greedy=True, max_new_tokens=16), SamplingParams(n=3, max_new_tokens=16, seed=5)):
        fast = HFEngine(model, tokenizer).generate(prompts, params)
        slow = HFEngine(model, tokenizer, static=False).generate(prompts, params)
        assert fast.completion_ids == slow.completion_ids
        for a, b in zip(fast.completion_logprobs, slow.completion_logprobs, strict=True):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


def test_decode_step_logits_match_a_full_forward(tokenizer):
    """Each static step's logits equal the model's logits at that position from one unpadded forward."""
    model = _arch("llama-gqa")
    prompt = _prompts(tokenizer, 1)[0]
    engine = HFEngine(model, tokenizer)
    with torch.inference_mode():
        _, cache, mask, position = engine._prefill([prompt], 5, 1)
        decoder = static_decoder.StaticDecoder(model, cache, mask[:, : len(prompt)], 5)
        tokens = [7, 9, 11]
        step_logits = [decoder.step(torch.tensor([t]), position[:, 0] + i) for i, t in enumerate(tokens)]
        full = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt):]
    for i, logits in enumerate(step_logits):
        assert torch.allclose(logits[0], full[i], atol=1e-4)


def test_unsupported_models_keep_the_generic_path(tokenizer):
    model = build_tiny("tiny")[0]
    assert static_decoder.supports(model, 128)
    assert not static_decoder.supports(apply_lora(model, {"r": 2, "target_modules": "all-linear"}), 128)
    assert not static_decoder.supports(_arch("llama-bias"), 128)  # o_proj bias: not reproduced
    windowed = _arch("qwen2")
    windowed.config.use_sliding_window, windowed.config.sliding_window = True, 16
    assert not static_decoder.supports(windowed, 32) and static_decoder.supports(windowed, 16)
