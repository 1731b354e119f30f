"""Continuous batching (``HFEngine(continuous=True)``): a finished row takes the next waiting sample, and every
sample decodes exactly as it does alone."""

from __future__ import annotations

import itertools

import pytest
import torch

import tether.rollout.continuous as continuous
import tether.rollout.static_decoder as static_decoder
from tether.models.tiny import build_tiny
from tether.rollout import HFEngine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # the shared fixture in conftest.py

EOS = 2


@pytest.fixture(scope="module")
def ragged():
    """The tiny model with a bias on EOS, so rows stop at many different steps."""
    torch.manual_seed(0)
    model, tokenizer = build_tiny("tiny", seed=0)
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[EOS] = 0.5
    model.lm_head = head
    model.eval()
    prompts = [[1, *tokenizer.encode(f"{i} + {i * 7} = ?" + "x" * (i % 5), add_special_tokens=False)]
               for i in range(30)]
    return model, tokenizer, prompts


def _record(monkeypatch, owner, name, calls):
    original = getattr(owner, name)

    def recording(self, *args, **kwargs):
        calls.append((name, getattr(self, "length", None)))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, recording)


@pytest.mark.parametrize("batch_size", [4, 7])
def test_greedy_continuous_gives_every_sample_its_own_tokens_and_logprobs(ragged, monkeypatch, batch_size):
    model, tokenizer, prompts = ragged
    params = SamplingParams(greedy=True, max_new_tokens=20)
    alone = HFEngine(model, tokenizer).generate(prompts, params)
    assert len({len(c) for c in alone.completion_ids}) >= 4  # rows really stop at different steps
    calls = []
    _record(monkeypatch, static_decoder.StaticDecoder, "insert", calls)
    _record(monkeypatch, static_decoder.StaticDecoder, "step", calls)
    rollout = HFEngine(model, tokenizer, batch_size=batch_size, continuous=True).generate(prompts, params)
    assert rollout.completion_ids == alone.completion_ids
    assert rollout.finish_reasons == alone.finish_reasons
    for a, b in zip(rollout.completion_logprobs, alone.completion_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    assert sum(name == "insert" for name, _ in calls) >= 2  # finished rows were refilled
    lengths = [length for name, length in calls if name == "step"]
    assert any(b < a for a, b in itertools.pairwise(lengths))  # and the buffers made room
    # fewer decode steps than chunk after chunk, each running to its longest row
    chunked = sum(max(len(c) for c in alone.completion_ids[i : i + batch_size]) - 1
                  for i in range(0, len(prompts), batch_size))
    assert len(lengths) < chunked


def test_refilled_samples_stop_on_stop_strings_as_they_do_alone(ragged):
    model, tokenizer, prompts = ragged
    full = HFEngine(model, tokenizer).generate(prompts, SamplingParams(greedy=True, max_new_tokens=20))
    stop = next(t for t in full.texts if len(t) > 8)[5:7]
    params = SamplingParams(greedy=True, max_new_tokens=20, stop=[stop])
    alone = HFEngine(model, tokenizer).generate(prompts, params)
    assert "stop" in alone.finish_reasons
    rollout = HFEngine(model, tokenizer, batch_size=5, continuous=True).generate(prompts, params)
    assert rollout.texts == alone.texts
    assert rollout.completion_ids == alone.completion_ids
    assert rollout.finish_reasons == alone.finish_reasons


def test_sampled_continuous_is_seeded_grouped_and_its_logprobs_are_the_models(ragged):
    model, tokenizer, prompts = ragged
    engine = HFEngine(model, tokenizer, batch_size=8, continuous=True)
    params = SamplingParams(n=3, max_new_tokens=12, seed=3)
    first, again = engine.generate(prompts[:10], params), engine.generate(prompts[:10], params)
    assert first.completion_ids == again.completion_ids
    assert first.prompt_index == [i for i in range(10) for _ in range(3)]
    for prompt, completion, logprobs in zip(first.prompt_ids, first.completion_ids, first.completion_logprobs,
                                            strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)


def test_progress_is_reported_and_small_calls_keep_the_chunked_path(ragged):
    model, tokenizer, prompts = ragged
    reports = []
    engine = HFEngine(model, tokenizer, batch_size=4, continuous=True, on_batch=reports.append)
    engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=10))
    assert reports[-1] == len(prompts) and reports == sorted(reports) and len(reports) >= 2
    params = SamplingParams(greedy=True, max_new_tokens=10)
    assert not engine._continuous(prompts[:4], list(range(4)), 4, params)  # fits one batch
    assert not HFEngine(model, tokenizer, batch_size=4, continuous=True, static=False)._continuous(
        prompts, list(range(len(prompts))), 4, params)  # no static decoder: chunks
    generic = HFEngine(model, tokenizer, batch_size=4, continuous=True, static=False).generate(prompts, params)
    assert generic.completion_ids == HFEngine(model, tokenizer).generate(prompts, params).completion_ids


def test_an_inserted_sequence_decodes_as_it_does_alone(ragged):
    """StaticDecoder.insert: a sequence put into a used row, after its old columns, gives the logits of a
    decoder that holds it alone."""
    model, tokenizer, prompts = ragged
    engine = HFEngine(model, tokenizer)
    short, long = prompts[0], prompts[9]
    with torch.inference_mode():
        _, cache, mask, position = engine._prefill([long, short], 8, 1)
        width = mask.shape[1] - 8
        shared = static_decoder.StaticDecoder(model, cache, mask[:, :width], 8, capacity=width + 16)
        tokens = torch.tensor([5, 6])
        for _ in range(3):
            shared.step(tokens, position[:, 0])
            position += 1
        logits, keys, values, new_mask, new_position = continuous._prefill(engine, [long], 8)
        shared.insert(torch.tensor([1]), keys, values, new_mask)
        _, cache_alone, mask_alone, position_alone = engine._prefill([long], 8, 1)
        alone = static_decoder.StaticDecoder(model, cache_alone, mask_alone[:, : len(long)], 8)
        fed = torch.tensor([7, logits.argmax(-1).item()])
        together = shared.step(fed, torch.tensor([int(position[0, 0]), int(new_position[0])]))
        by_itself = alone.step(fed[1:], position_alone[:, 0])
    torch.testing.assert_close(together[1:], by_itself, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="does not fit"):
        static_decoder.StaticDecoder(model, cache_alone, mask_alone[:, : len(long)], 8).insert(
            torch.tensor([0]), keys, values, torch.ones((1, 100), dtype=torch.long))
