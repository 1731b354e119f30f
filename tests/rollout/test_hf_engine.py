"""HFEngine against ``model.generate`` and against a from-scratch forward pass, on the tiny model."""

from __future__ import annotations

import pytest
import torch

import tether.rollout.hf_engine as hf_engine
import tether.rollout.static_decoder as static_decoder
from tether.models.tiny import build_tiny
from tether.rollout import GenerationEngine, HFEngine, Rollout, SamplingParams

EOS = 2
TEXTS = ["hello", "what is 2+2?", "a", "The quick brown fox jumps"]


pytestmark = pytest.mark.usefixtures("one_thread")  # the shared fixture in conftest.py


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    model, tokenizer = build_tiny("tiny", seed=0)
    model.eval()
    return model, tokenizer


def encode(tokenizer, texts=TEXTS) -> list[list[int]]:
    return [[1, *tokenizer.encode(t, add_special_tokens=False)] for t in texts]


def set_eos_bias(model, bias: float) -> None:
    """Give the (bias-free) Llama lm_head a bias on EOS, to force or forbid stopping."""
    old = model.lm_head
    new = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        new.weight.copy_(old.weight)
        new.bias.zero_()
        new.bias[EOS] = bias
    model.lm_head = new


def hf_greedy(model, tokenizer, prompts, max_new_tokens) -> list[list[int]]:
    """model.generate greedy, each row cut after its first EOS (generate pads finished rows)."""
    enc = tokenizer.pad([{"input_ids": p} for p in prompts], padding_side="left", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens)
    rows = []
    for row in out[:, enc["input_ids"].shape[1] :].tolist():
        rows.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return rows


def recomputed_logprobs(model, prompt, completion, temperature) -> torch.Tensor:
    """log_softmax(logits / T) of each completion token from one unpadded forward pass."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


# -- agreement with model.generate ---------------------------------------------------------------


def test_greedy_matches_model_generate_with_left_padding(tiny):
    model, tokenizer = tiny
    prompts = encode(tokenizer)
    assert len({len(p) for p in prompts}) == len(prompts)  # really padded
    rollout = HFEngine(model, tokenizer).generate(prompts, SamplingParams(greedy=True, max_new_tokens=24))
    expected = hf_greedy(model, tokenizer, prompts, 24)
    assert rollout.completion_ids == expected
    assert max(len(c) for c in expected) == 24


def test_greedy_matches_generate_in_chunks_and_with_temperature_zero(tiny):
    model, tokenizer = tiny
    prompts = encode(tokenizer)
    expected = hf_greedy(model, tokenizer, prompts, 12)
    chunked = HFEngine(model, tokenizer, batch_size=3).generate(
        prompts, SamplingParams(greedy=True, max_new_tokens=12)
    )
    zero_t = HFEngine(model, tokenizer).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    assert chunked.completion_ids == expected
    assert zero_t.completion_ids == expected


@pytest.mark.parametrize("static", [True, False])
def test_greedy_matches_generate_when_rows_stop_at_different_steps(tiny, monkeypatch, static):
    """EOS-biased model: rows finish at different steps, so finished rows are dropped from the batch
    (compaction) and the survivors must still decode exactly as model.generate does; on both the
    static-cache decode path and the generic one."""
    model, tokenizer = tiny
    set_eos_bias(model, 0.5)  # found by trying: 0 never stops within 20 tokens, 1.0 stops every row at once
    prompts = encode(tokenizer, [f"{i} + {i * 7} = ?" + "x" * (i % 5) for i in range(12)])
    expected = hf_greedy(model, tokenizer, prompts, 20)
    lengths = {len(r) for r in expected}
    assert len(lengths) >= 3 and 20 in lengths  # a real mix of early stops and full-length rows
    compactions = []
    original = hf_engine.HFEngine._forward
    original_step = static_decoder.StaticDecoder.step

    def counting_forward(self, input_ids, mask, position_ids, cache):
        compactions.append(input_ids.shape[0])
        return original(self, input_ids, mask, position_ids, cache)

    def counting_step(self, tokens, positions):
        compactions.append(tokens.shape[0])
        return original_step(self, tokens, positions)

    monkeypatch.setattr(hf_engine.HFEngine, "_forward", counting_forward)
    monkeypatch.setattr(static_decoder.StaticDecoder, "step", counting_step)
    rollout = HFEngine(model, tokenizer, static=static).generate(
        prompts, SamplingParams(greedy=True, max_new_tokens=20))
    assert rollout.completion_ids == expected
    assert min(compactions) < len(prompts)  # the batch really shrank
    for ids, reason in zip(rollout.completion_ids, rollout.finish_reasons, strict=True):
        assert reason == ("stop" if ids[-1] == EOS else "length")


def test_preallocated_cache_with_groups_and_compaction_matches_generate(tiny, monkeypatch):
    model, tokenizer = tiny
    set_eos_bias(model, 0.5)
    monkeypatch.setattr(hf_engine, "PREALLOCATE_MIN_NEW_TOKENS", 1)
    swapped, batch_sizes = [], []
    preallocate, forward = hf_engine.preallocate_cache, hf_engine.HFEngine._forward

    def recording_preallocate(cache, extra_tokens):
        swapped.append(preallocate(cache, extra_tokens))
        return swapped[-1]

    def recording_forward(self, input_ids, mask, position_ids, cache):
        batch_sizes.append(input_ids.shape[0])
        return forward(self, input_ids, mask, position_ids, cache)

    monkeypatch.setattr(hf_engine, "preallocate_cache", recording_preallocate)
    monkeypatch.setattr(hf_engine.HFEngine, "_forward", recording_forward)
    prompts = encode(tokenizer, [f"{i} + {i * 7} = ?" + "x" * (i % 5) for i in range(6)])
    expected = hf_greedy(model, tokenizer, prompts, 20)
    assert len({len(r) for r in expected}) >= 3
    rollout = HFEngine(model, tokenizer, static=False).generate(
        prompts, SamplingParams(n=2, greedy=True, max_new_tokens=20)
    )
    assert rollout.completion_ids == [row for row in expected for _ in range(2)]
    assert swapped == [model.config.num_hidden_layers]
    assert batch_sizes[0] == 6 and batch_sizes[1] == 12  # prefill once per prompt, then n rows each
    assert min(batch_sizes[1:]) < 12  # and finished rows were dropped


def test_engine_uses_the_live_weights(tiny):
    model, tokenizer = tiny
    prompts = encode(tokenizer)
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(greedy=True, max_new_tokens=8)
    before = engine.generate(prompts, params).completion_ids
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)
    after = engine.generate(prompts, params).completion_ids
    assert after != before
    assert after == hf_greedy(model, tokenizer, prompts, 8)


# -- log-probs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 10, 0.9)])
def test_sampled_logprobs_match_a_full_forward_pass(tiny, temperature, top_k, top_p):
    model, tokenizer = tiny
    prompts = encode(tokenizer)
    params = SamplingParams(n=2, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=16, seed=3)
    rollout = HFEngine(model, tokenizer).generate(prompts, params)
    for prompt, comp, lps in zip(
        rollout.prompt_ids, rollout.completion_ids, rollout.completion_logprobs, strict=True
    ):
        assert len(lps) == len(comp)
        expected = recomputed_logprobs(model, prompt, comp, temperature)
        torch.testing.assert_close(torch.tensor(lps), expected, atol=1e-4, rtol=0)


def test_greedy_logprobs_are_log_softmax_of_the_argmax(tiny):
    model, tokenizer = tiny
    prompts = encode(tokenizer)
    rollout = HFEngine(model, tokenizer).generate(
        prompts, SamplingParams(greedy=True, temperature=0.5, max_new_tokens=10)
    )
    for prompt, comp, lps in zip(
        rollout.prompt_ids, rollout.completion_ids, rollout.completion_logprobs, strict=True
    ):
        torch.testing.assert_close(
            torch.tensor(lps), recomputed_logprobs(model, prompt, comp, 1.0), atol=1e-4, rtol=0
        )


# -- sampling ------------------------------------------------------------------------------------


def test_n_samples_are_contiguous_per_prompt(tiny):
    model, tokenizer = tiny
    prompts = encode(tokenizer, TEXTS[:3])
    for batch_size in (None, 4):  # 4 is not a multiple of n: groups split across chunks
        rollout = HFEngine(model, tokenizer, batch_size=batch_size).generate(
            prompts, SamplingParams(n=3, max_new_tokens=6, seed=0)
        )
        assert len(rollout) == 9
        assert rollout.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        assert rollout.prompt_ids == [p for p in prompts for _ in range(3)]
        assert len(set(map(tuple, rollout.completion_ids[:3]))) > 1  # samples of one prompt differ


def test_same_seed_same_samples_different_seed_different_samples(tiny):
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer)
    prompts = encode(tokenizer)
    a = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=12, seed=7))
    b = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=12, seed=7))
    c = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=12, seed=8))
    assert a.completion_ids == b.completion_ids
    assert a.completion_logprobs == b.completion_logprobs
    assert a.completion_ids != c.completion_ids


def test_top_k_one_equals_greedy(tiny):
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer)
    prompts = encode(tokenizer)
    greedy = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=12))
    top1 = engine.generate(prompts, SamplingParams(top_k=1, max_new_tokens=12, seed=1))
    assert top1.completion_ids == greedy.completion_ids


def test_top_k_and_top_p_restrict_the_sampled_tokens():
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0, -2.0]]).repeat(500, 1)
    gen = torch.Generator().manual_seed(0)
    tokens, _ = hf_engine.sample_tokens(logits, SamplingParams(top_k=2), gen)
    assert set(tokens.tolist()) == {0, 1}
    # softmax: 0.705, 0.259, ... -> top_p 0.5 keeps only token 0, top_p 0.8 keeps tokens 0 and 1
    tokens, _ = hf_engine.sample_tokens(logits, SamplingParams(top_p=0.5), gen)
    assert set(tokens.tolist()) == {0}
    tokens, _ = hf_engine.sample_tokens(logits, SamplingParams(top_p=0.8), gen)
    assert set(tokens.tolist()) == {0, 1}


# -- stopping ------------------------------------------------------------------------------------


def test_finish_reason_length_when_max_new_tokens_is_hit(tiny):
    model, tokenizer = tiny
    set_eos_bias(model, -100.0)
    rollout = HFEngine(model, tokenizer).generate(
        encode(tokenizer), SamplingParams(n=2, max_new_tokens=9, seed=0)
    )
    assert rollout.finish_reasons == ["length"] * 8
    assert all(len(c) == 9 and EOS not in c for c in rollout.completion_ids)


def test_finish_reason_stop_on_eos(tiny):
    model, tokenizer = tiny
    set_eos_bias(model, 100.0)
    rollout = HFEngine(model, tokenizer).generate(encode(tokenizer), SamplingParams(max_new_tokens=9, seed=0))
    assert rollout.finish_reasons == ["stop"] * 4
    assert rollout.completion_ids == [[EOS]] * 4
    assert rollout.texts == [""] * 4


def test_rows_stop_on_eos_at_different_steps_while_sampling(tiny):
    model, tokenizer = tiny
    set_eos_bias(model, 3.0)
    prompts = encode(tokenizer)
    rollout = HFEngine(model, tokenizer).generate(prompts, SamplingParams(n=8, max_new_tokens=16, seed=0))
    reasons = set(rollout.finish_reasons)
    assert reasons == {"stop", "length"}
    for ids, lps, reason in zip(
        rollout.completion_ids, rollout.completion_logprobs, rollout.finish_reasons, strict=True
    ):
        assert len(lps) == len(ids)
        assert EOS not in ids[:-1]  # nothing is sampled after EOS
        assert (reason == "stop") == (ids[-1] == EOS)
        if reason == "length":
            assert len(ids) == 16
    for prompt, comp, lps in zip(
        rollout.prompt_ids, rollout.completion_ids, rollout.completion_logprobs, strict=True
    ):
        torch.testing.assert_close(
            torch.tensor(lps), recomputed_logprobs(model, prompt, comp, 1.0), atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("cut", [(4, 6), (7, 8), (2, 5)])
def test_stop_strings_cut_the_completion(tiny, cut):
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer)
    prompts = encode(tokenizer)
    full = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=20))
    text = full.texts[1]
    stop = text[cut[0] : cut[1]]
    rollout = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=20, stop=[stop]))
    expected_text = text[: text.find(stop) + len(stop)]
    assert rollout.texts[1] == expected_text
    assert rollout.finish_reasons[1] == "stop"
    ids = rollout.completion_ids[1]
    assert ids == full.completion_ids[1][: len(ids)]  # token ids: a prefix of the uncut run
    assert tokenizer.decode(ids, skip_special_tokens=True) == expected_text  # one char per token here
    for i, t in enumerate(full.texts):  # the other rows: cut where the stop string first ends, if anywhere
        if stop in t:
            assert rollout.texts[i] == t[: t.find(stop) + len(stop)] and rollout.finish_reasons[i] == "stop"
        else:
            assert rollout.texts[i] == t and rollout.finish_reasons[i] == full.finish_reasons[i]


def test_stop_string_ending_in_whitespace_and_several_stop_strings(tiny):
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer)
    prompts = encode(tokenizer)
    full = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=20))
    text = full.texts[0]
    stops = [text[5:7] + " ", text[3:5]]  # the first never matches (no space in this text)
    assert stops[0] not in text
    rollout = engine.generate(prompts[:1], SamplingParams(greedy=True, max_new_tokens=20, stop=stops))
    assert rollout.texts[0] == text[: text.find(stops[1]) + 2]
    assert rollout.finish_reasons == ["stop"]



# -- stop strings with a byte-level BPE tokenizer (tokens of several characters, characters of several tokens) --


def byte_tokens(tokenizer, text: str) -> list[int]:
    """``text``'s UTF-8 bytes as single byte-level tokens (GPT-2's byte-to-character map)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)}
    extra = iter(range(256, 512))
    char = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    return [tokenizer.convert_tokens_to_ids(char[b]) for b in text.encode()]


def first_stop_step(engine, ids: list[int], stop: list[str]) -> int | None:
    """The step at which the engine's stop check fires as ``ids`` are sampled one per step (None: never)."""
    tokens = torch.tensor([ids])
    candidates = engine._stop_filter(stop, len(engine.tokenizer), tokens.device)
    for step, token in enumerate(ids):
        if engine._match_stop(tokens, torch.tensor([0]), torch.tensor([step]), torch.tensor([token]),
                              torch.tensor([False]), candidates, stop)[0]:
            return step
    return None


def test_a_stop_string_fires_on_the_bpe_token_that_completes_it(bpe_tokenizer):
    """The token that completes a stop string may carry more characters (":\n" after "Observation"), end a
    string in its middle ("café" for "caf"), or be the last byte of a character split over several byte
    tokens ("。" as three): each fires on exactly that token, never earlier."""
    model, tokenizer = build_tiny("tiny", tokenizer=bpe_tokenizer)
    engine = HFEngine(model, tokenizer)
    encode_ = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    react = encode_("Action: finish[3]\nObservation:\n 36")
    pieces = [tokenizer.decode([i]) for i in react]
    assert "Observation" in pieces and ":\n" in pieces  # the merged token is real in this vocabulary
    assert first_stop_step(engine, react, ["Observation:"]) == pieces.index(":\n")
    cafe = encode_("x") + encode_("café")
    assert [tokenizer.decode([i]) for i in cafe] == ["x", "café"]
    assert first_stop_step(engine, cafe, ["caf"]) == len(cafe) - 1
    split = encode_("x") + byte_tokens(tokenizer, "。") + encode_("y")
    assert tokenizer.decode(split) == "x。y" and len(split) == 5
    assert first_stop_step(engine, split, ["。"]) == 3
    assert first_stop_step(engine, split, ["x。y"]) == 4
    assert first_stop_step(engine, react, ["Observation:\n 37"]) is None


@pytest.mark.parametrize("static", [True, False])
def test_sampled_stop_strings_with_a_bpe_tokenizer_cut_the_text_and_keep_the_tokens(bpe_tokenizer, static):
    """A model on the BPE vocabulary samples freely; stop strings taken from its completion (one ending
    inside a multi-character token, one spanning a token boundary) end the same sample at the first token
    whose text completes them: the token ids are that prefix of the free run's, whole, and the text is cut
    right after the stop string."""
    model, tokenizer = build_tiny("tiny", seed=1, tokenizer=bpe_tokenizer)
    model.eval()
    engine = HFEngine(model, tokenizer, static=static)
    prompt = [[tokenizer.bos_token_id, *tokenizer.encode("Question: 12*3=\n", add_special_tokens=False)]]
    free = engine.generate(prompt, SamplingParams(max_new_tokens=24, seed=3))
    ids = free.completion_ids[0]
    pieces = [tokenizer.decode([i]) for i in ids]

    def plain(text: str) -> bool:
        return text.isprintable() and "\ufffd" not in text

    wide = next(k for k, piece in enumerate(pieces) if k and len(piece) >= 3 and plain(piece + pieces[k - 1]))
    stops = [pieces[wide][:-1], pieces[wide - 1][-1] + pieces[wide][:2]]  # ends inside a token; spans two
    for stop in stops:
        cut = engine.generate(prompt, SamplingParams(max_new_tokens=24, seed=3, stop=[stop]))
        kept = cut.completion_ids[0]
        assert kept == ids[: len(kept)] and cut.finish_reasons == ["stop"]
        assert stop in tokenizer.decode(kept) and stop not in tokenizer.decode(kept[:-1])
        text = tokenizer.decode(kept)
        assert cut.texts[0] == text[: text.find(stop) + len(stop)]


# -- engine state and containers -----------------------------------------------------------------


@pytest.mark.parametrize("training", [True, False])
def test_train_eval_mode_is_restored(tiny, training):
    model, tokenizer = tiny
    model.train(training)
    HFEngine(model, tokenizer).generate(encode(tokenizer), SamplingParams(max_new_tokens=3, seed=0))
    assert model.training is training
    assert all(m.training is training for m in model.modules())


def test_train_mode_is_restored_when_generation_fails(tiny, monkeypatch):
    model, tokenizer = tiny
    model.train()
    engine = HFEngine(model, tokenizer)
    seen = []

    def boom(*args, **kwargs):
        seen.append(model.training)
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "_generate_batch", boom)
    with pytest.raises(RuntimeError, match="boom"):
        engine.generate(encode(tokenizer), SamplingParams(max_new_tokens=3))
    assert seen == [False] and model.training


def test_mixed_module_modes_are_restored(tiny):
    model, tokenizer = tiny
    model.train()
    model.model.layers[0].eval()  # e.g. a frozen block
    before = {name: m.training for name, m in model.named_modules()}
    HFEngine(model, tokenizer).generate(encode(tokenizer), SamplingParams(max_new_tokens=3, seed=0))
    assert {name: m.training for name, m in model.named_modules()} == before


def test_rollout_to_padded(tiny):
    model, tokenizer = tiny
    set_eos_bias(model, 3.0)
    engine = HFEngine(model, tokenizer)
    rollout = engine.generate(encode(tokenizer), SamplingParams(n=2, max_new_tokens=10, seed=0))
    assert isinstance(engine, GenerationEngine) and isinstance(rollout, Rollout)
    padded = rollout.to_padded(pad_id=0)
    n, t = padded["completion_ids"].shape
    assert n == len(rollout) == 8 and t == max(len(c) for c in rollout.completion_ids)
    for i, (ids, lps, prompt) in enumerate(
        zip(rollout.completion_ids, rollout.completion_logprobs, rollout.prompt_ids, strict=True)
    ):
        k = len(ids)
        assert padded["completion_ids"][i, :k].tolist() == ids
        assert padded["completion_mask"][i].tolist() == [1] * k + [0] * (t - k)
        assert padded["completion_ids"][i, k:].eq(0).all()
        torch.testing.assert_close(padded["logprobs"][i, :k], torch.tensor(lps))
        assert padded["logprobs"][i, k:].eq(0).all()
        p = padded["prompt_ids"].shape[1]
        assert padded["prompt_ids"][i, p - len(prompt) :].tolist() == prompt
        assert padded["prompt_mask"][i].sum() == len(prompt)


def test_generate_rejects_empty_prompts(tiny):
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer)
    with pytest.raises(ValueError, match="at least one prompt"):
        engine.generate([], SamplingParams())
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 5], []], SamplingParams())
    with pytest.raises(ValueError, match="batch_size"):
        HFEngine(model, tokenizer, batch_size=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be >= 1"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"stop": "###"}, "list of strings"),
        ({"stop": [""]}, "non-empty strings"),
    ],
)
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_greedy_flag():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(greedy=True, temperature=0.8).is_greedy
    assert not SamplingParams().is_greedy


@pytest.mark.parametrize("shape", [(64, 108), (1, 5), (33, 1000)])
def test_the_exponential_race_draws_multinomials_tokens_from_the_same_stream(shape):
    """The sampler's draw is torch.multinomial's own algorithm: the same tokens and the generator left in the
    same state, step after step, including rows with zero-probability entries."""
    from tether.rollout.base import exponential_race

    torch.manual_seed(0)
    ours, theirs = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for step in range(12):
        probs = torch.softmax(torch.randn(*shape) * 3, -1)
        if step % 4 == 0:
            probs[:, : shape[1] // 2] = 0
        expected = torch.multinomial(probs, 1, generator=theirs).squeeze(-1)
        assert torch.equal(exponential_race(probs, ours), expected)
    assert torch.equal(ours.get_state(), theirs.get_state())


def test_the_exponential_race_refuses_a_diverged_distribution():
    from tether.rollout.base import exponential_race

    for bad in (float("nan"), float("inf")):
        probs = torch.full((2, 4), 0.25)
        probs[1, 2] = bad
        with pytest.raises(RuntimeError, match="inf"):
            exponential_race(probs)
