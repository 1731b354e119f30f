"""The static-cache decode path against the generic Hugging Face forward, on several architectures."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import tether.models.linear as linear
from tether.models.loading import apply_lora
from tether.models.tiny import build_tiny
from tether.rollout import HFEngine, SamplingParams, projection, static_decoder

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


def _processor(monkeypatch, amd: bool) -> None:
    """Behave as on an AMD processor with AVX-512 (float32 products and decode packs on oneDNN) or an Intel one
    (MKL's kernels and packs)."""
    monkeypatch.setattr(linear, "_onednn_beats_mkl", lambda: amd)
    monkeypatch.setattr(projection, "onednn_packs_float32", lambda: amd)


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


@pytest.mark.parametrize("arch, group", [("tiny", 1), ("llama-gqa", 3), ("qwen2", 1), ("qwen2", 2)])
def test_the_decoders_own_prefill_equals_a_padded_forward(arch, group, tokenizer):
    """The lean prefill (real tokens only, packed) gives a padded forward's last logits, the same keys and
    values at every real column, the same mask and positions, and decode steps with the same logits."""
    model = build_tiny("tiny")[0].eval() if arch == "tiny" else _arch(arch)
    prompts = [p for p in _prompts(tokenizer, 5) for _ in range(group)]
    engine = HFEngine(model, tokenizer)
    with torch.inference_mode():
        logits, cache, mask, position = engine._prefill(prompts, 4, group)
        width = mask.shape[1] - 4
        reference = static_decoder.StaticDecoder(model, cache, mask[:, :width], 4)
        lean_logits, lean, lean_mask, lean_position = engine._prefill(prompts, 4, group, lean=True)
        assert isinstance(lean, static_decoder.StaticDecoder)
        assert torch.equal(lean_mask, mask) and torch.equal(lean_position, position)
        assert torch.allclose(lean_logits, logits, atol=1e-5)
        real = mask[:, :width].bool()[None, :, None, :].expand(*reference.keys.shape[:3], width)  # (L, B, kv, width)
        assert int(real.sum()) < real.numel()  # the prompts differ in length: padding was skipped
        for ours, theirs in ((lean.keys, reference.keys), (lean.values, reference.values)):
            assert torch.allclose(ours[:, :, :, :width][real], theirs[:, :, :, :width][real], atol=1e-5)
        token = torch.full((len(prompts),), 7)
        for step in range(3):
            assert torch.allclose(lean.step(token, position[:, 0] + step),
                                  reference.step(token, position[:, 0] + step), atol=1e-5)


def test_the_lean_prefills_last_layer_projects_and_feeds_forward_only_each_prompts_last_token(tokenizer):
    """Every token's keys and values are cached, but the last layer's output projection and MLP see one row per
    distinct prompt (the rows the logits read); the layers below see every real token."""
    model = build_tiny("tiny")[0].eval()
    prompts = [p for p in _prompts(tokenizer, 5) for _ in range(2)]  # 5 distinct prompts, 2 rows each
    rows: dict[int, int] = {}  # projection id -> rows it multiplied
    call = projection.Projection.__call__
    with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
        patch.setattr(projection.Projection, "__call__", lambda self, x: rows.setdefault(id(self), len(x)) and call(self, x))
        decoder = HFEngine(model, tokenizer)._prefill(prompts, 4, 2, lean=True)[1]
    *lower, last = [[rows[id(p)] for p in (layer.o, layer.gate_up, layer.down)] for layer in decoder.layers]
    assert last == [5, 5, 5]
    assert lower == [[sum(len(p) for p in prompts[::2])] * 3] * (len(decoder.layers) - 1)


def test_a_bfloat16_models_lean_prefill_gives_a_padded_forwards_logits(tokenizer):
    """bfloat16 projections, float32 attention over the float32 cache: a padded bfloat16 forward's logits
    to bfloat16 rounding."""
    model = _arch("llama-gqa").to(torch.bfloat16)
    prompts = _prompts(tokenizer, 5)
    engine = HFEngine(model, tokenizer)
    with torch.inference_mode():
        logits = engine._prefill(prompts, 4, 1)[0]
        lean_logits, lean = engine._prefill(prompts, 4, 1, lean=True)[:2]
    assert lean.keys.dtype is torch.float32 and lean_logits.dtype is torch.float32
    assert (lean_logits - logits).abs().max() < 0.05 * logits.abs().max()


def test_the_lean_prefill_rejects_a_prompt_wider_than_its_buffers(tokenizer):
    model = _arch("llama-gqa")
    decoder = static_decoder.StaticDecoder(model, None, torch.ones((1, 3), dtype=torch.long), 2)
    with pytest.raises(ValueError, match="does not fit 3 columns"):
        decoder.prefill([[1, 2, 3, 4]])


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


def _wide_model():
    """Wide enough (hidden 512) for the decoder to prepack its projections."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=109, hidden_size=512, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("dtype, onednn_float32", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)])
def test_a_prepacked_projection_computes_the_linear_map(dtype, onednn_float32, monkeypatch):
    """float32 packs in MKL's layout (Intel processors) serve one row count, other counts multiply plainly;
    oneDNN's (bfloat16, and float32 where oneDNN beats MKL: AMD processors) serve any."""
    _processor(monkeypatch, amd=onednn_float32)
    torch.manual_seed(0)
    weight, bias, x = (torch.randn(96, 512, dtype=dtype), torch.randn(96, dtype=dtype),
                       torch.randn(5, 512, dtype=dtype))
    if not projection.packing_pays(weight, projection.PACK_MIN_HIDDEN):
        pytest.skip("no MKL / oneDNN packed kernels of this dtype in this build or on this processor")
    layer = projection.Projection(weight, bias)
    assert not layer.serves(5) and torch.equal(layer(x), linear.onednn_linear(x, weight, bias))  # unpacked
    layer.pack(5)
    assert layer.serves(5)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(layer(x).float(), F.linear(x, weight, bias).float(), rtol=tolerance, atol=tolerance)
    fewer = x[:3]
    assert layer.serves(3) == (dtype == torch.bfloat16 or onednn_float32)
    assert torch.allclose(layer(fewer).float(), F.linear(fewer, weight, bias).float(), rtol=tolerance, atol=tolerance)
    layer.unpack()
    assert not layer.serves(5)


@pytest.mark.parametrize("onednn_float32", [False, True])
@pytest.mark.parametrize("width", [128, 512])
def test_an_unpacked_projection_gives_f_linears_product_bitwise(width, onednn_float32, monkeypatch):
    """Unpacked, a projection multiplies as F.linear does (its mm / addmm called directly on a transposed weight
    where oneDNN does not take the product), with and without a bias."""
    _processor(monkeypatch, amd=onednn_float32)
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, width), torch.randn(96), torch.randn(7, width)
    for b in (None, bias):
        layer = projection.Projection(weight, b)
        assert (layer.transposed is None) == linear.onednn_float32_pays(weight)
        assert torch.equal(layer(x), linear.onednn_linear(x, weight, b))
        assert torch.equal(layer(x), F.linear(x, weight, b)) or linear.onednn_float32_pays(weight)


def test_wide_models_decode_through_prepacked_weights_with_the_same_logits(tokenizer, monkeypatch):
    """The decoder packs its projections for the running batch, repacks when rows are dropped, multiplies
    plainly when too few steps remain to pay for a pack, and its logits stay those of plain products (MKL's
    float32 packs, the ones tied to a row count)."""
    _processor(monkeypatch, amd=False)
    model = _wide_model()
    if not projection.packing_pays(model.lm_head.weight, model.config.hidden_size):
        pytest.skip("no MKL packed float32 kernels in this build")
    prompts = _prompts(tokenizer, 10)
    engine = HFEngine(model, tokenizer)
    with torch.inference_mode():
        def decoder(steps):
            _, cache, mask, position = engine._prefill(prompts, steps, 1)
            return static_decoder.StaticDecoder(model, cache, mask[:, : mask.shape[1] - steps], steps), position[:, 0]

        (packed, position), (plain, _) = decoder(20), decoder(20)
        plain.packs = False
        tokens = torch.full((10,), 7)
        assert torch.allclose(packed.step(tokens, position), plain.step(tokens, position), atol=1e-4)
        assert packed.packed_rows == 10 and packed.layers[0].qkv.serves(10)
        keep = torch.tensor([0, 2, 3, 5, 8, 9])
        for d in (packed, plain):
            d.select(keep)
        logits = packed.step(tokens[keep], position[keep] + 1)
        assert packed.packed_rows == 6 and packed.layers[0].down.serves(6) and not packed.layers[0].down.serves(10)
        assert torch.allclose(logits, plain.step(tokens[keep], position[keep] + 1), atol=1e-4)
        short, position = decoder(projection.REPACK_MIN_STEPS - 1)
        short.step(tokens, position)
        assert short.packs and not short.layers[0].qkv.serves(10)  # too few steps to pay for a pack
    greedy = SamplingParams(greedy=True, max_new_tokens=12)
    fast, slow = engine.generate(prompts, greedy), HFEngine(model, tokenizer, static=False).generate(prompts, greedy)
    assert fast.completion_ids == slow.completion_ids


def test_a_rotary_whose_pairs_do_not_share_an_angle_keeps_the_generic_path():
    model = _arch("llama-gqa")
    assert static_decoder.supports(model, 64)
    original = model.model.rotary_emb.forward

    def skewed(x, position_ids):
        cos, sin = original(x, position_ids)
        ramp = torch.linspace(0.5, 1.0, cos.shape[-1])
        return cos * ramp, sin * ramp

    model.model.rotary_emb.forward = skewed
    assert not static_decoder.supports(model, 64)


@pytest.mark.parametrize("onednn_float32", [False, True])
def test_wide_models_keep_their_tokens_when_rows_finish_or_are_refilled(tokenizer, monkeypatch, onednn_float32):
    """With EOS made likely, rows stop at different steps: the chunked decoder drops them and repacks for the
    smaller batch (MKL's float32 packs; oneDNN's serve any row count), the continuous one refills them; both
    give the generic path's greedy tokens."""
    _processor(monkeypatch, amd=onednn_float32)
    model = _wide_model()
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[2] = 0.5  # EOS
    model.lm_head = head
    prompts = _prompts(tokenizer, 12)
    greedy = SamplingParams(greedy=True, max_new_tokens=16)
    generic = HFEngine(model, tokenizer, static=False).generate(prompts, greedy)
    assert len({len(c) for c in generic.completion_ids}) >= 3
    packed_for = []
    original = projection.Projection.pack
    monkeypatch.setattr(projection.Projection, "pack", lambda self, rows: (packed_for.append(rows), original(self, rows)))
    for engine in (HFEngine(model, tokenizer), HFEngine(model, tokenizer, batch_size=5, continuous=True)):
        assert engine.generate(prompts, greedy).completion_ids == generic.completion_ids
    if projection.packing_pays(model.lm_head.weight, model.config.hidden_size):
        # the first batch, the batch after dropping rows (MKL's packs only: oneDNN's serve any row count), the
        # refilled one
        assert ({12, 5} if onednn_float32 else {12, 9, 5}) <= set(packed_for)
        assert onednn_float32 == (9 not in packed_for)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotation_table_holds_the_rotary_modules_own_values(dtype):
    """A step looks its rotations up in a table the rotary module filled once: bitwise the values a call per
    step gives (the module's cos / sin are element-wise in the position), growing when a position passes it."""
    model = _arch("llama-gqa").to(dtype)
    decoder = static_decoder.StaticDecoder(model, None, torch.ones((3, 4), dtype=torch.long), steps=2)
    assert decoder.tabulated
    positions = torch.tensor([0, 5, 3])
    keys, queries = decoder._rotations(positions, 6, dtype)
    assert decoder.rotations[0].shape[0] == 6
    direct_keys, direct_queries = decoder._rotate_positions(positions, dtype)
    assert keys.shape == (3, 1, decoder.head_dim // 2) and keys.dtype == torch.complex64
    assert torch.equal(keys, direct_keys) and torch.equal(queries, direct_queries)
    cos, sin = model.model.rotary_emb(torch.empty((), dtype=dtype), torch.tensor([[5]]))
    half = decoder.head_dim // 2
    assert torch.equal(keys[1, 0].real, cos[0, 0, :half].float())
    assert torch.equal(keys[1, 0].imag, sin[0, 0, :half].float())
    assert torch.equal(queries, keys * decoder.scale)
    far = torch.tensor([40])
    assert torch.equal(decoder._rotations(far, 41, dtype)[0], decoder._rotate_positions(far, dtype)[0])
    assert decoder.rotations[0].shape[0] == 41  # grown to the bound asked for (at least double the old size)


def test_a_length_dependent_rotary_is_computed_per_step(tokenizer):
    """``dynamic`` rotary scaling rescales with the sequence length, so no table: every step calls the module."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=109, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2,
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    model = LlamaForCausalLM(config).eval()
    assert static_decoder.supports(model, 40)
    decoder = static_decoder.StaticDecoder(model, None, torch.ones((1, 4), dtype=torch.long), steps=2)
    assert not decoder.tabulated
    decoder._rotations(torch.tensor([3]), 4, torch.float32)
    assert decoder.rotations is None
    prompts = _prompts(tokenizer, 3)
    params = SamplingParams(greedy=True, max_new_tokens=24)
    fast = HFEngine(model, tokenizer).generate(prompts, params)
    slow = HFEngine(model, tokenizer, static=False).generate(prompts, params)
    assert fast.completion_ids == slow.completion_ids
    for a, b in zip(fast.completion_logprobs, slow.completion_logprobs, strict=True):  # a table: 4.6e-4 apart
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


@pytest.mark.parametrize("shape", [(64, 128), (64, 512), (3, 7, 64), (5, 100)])
def test_the_decoders_rms_norm_is_bitwise_torchs(shape):
    torch.manual_seed(0)
    x, weight = torch.randn(*shape) * 3, torch.randn(shape[-1])
    constants = (torch.tensor(float(shape[-1])), torch.tensor(1e-5))
    expected = F.rms_norm(x, (shape[-1],), weight, 1e-5)
    assert torch.equal(static_decoder.rms_norm(x, weight, 1e-5, constants), expected)
    assert torch.equal(static_decoder.rms_norm(x, weight, 1e-5), expected)  # no constants: F.rms_norm itself
    low = x.bfloat16()  # other dtypes: F.rms_norm
    assert torch.equal(static_decoder.rms_norm(low, weight.bfloat16(), 1e-5, constants),
                       F.rms_norm(low, (shape[-1],), weight.bfloat16(), 1e-5))


def test_a_16_bit_model_on_a_cpu_attends_over_a_float32_cache():
    """bfloat16 products copy a strided key / value window first on a CPU; the cache is float32 there."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert static_decoder.cache_dtype(torch.bfloat16, cpu) is torch.float32
    assert static_decoder.cache_dtype(torch.float16, cpu) is torch.float32
    assert static_decoder.cache_dtype(torch.float32, cpu) is torch.float32
    assert static_decoder.cache_dtype(torch.bfloat16, cuda) is torch.bfloat16


def test_bfloat16_decode_steps_match_a_full_forward(tokenizer):
    """A bfloat16 model's static steps (float32 cache and attention) give the logits of one bfloat16 forward
    to bfloat16 rounding, and are closer to the float32 model's than that forward is."""
    model = _arch("llama-gqa")
    reference = _arch("llama-gqa")  # the same seed: the float32 weights the bfloat16 model rounds
    model = model.to(torch.bfloat16)
    prompt = _prompts(tokenizer, 1)[0]
    engine = HFEngine(model, tokenizer)
    with torch.inference_mode():
        _, cache, mask, position = engine._prefill([prompt], 5, 1)
        decoder = static_decoder.StaticDecoder(model, cache, mask[:, : len(prompt)], 5)
        assert decoder.keys.dtype is torch.float32 and decoder.values.dtype is torch.float32
        tokens = [7, 9, 11]
        steps = torch.stack([decoder.step(torch.tensor([t]), position[:, 0] + i)[0] for i, t in enumerate(tokens)])
        ids = torch.tensor([prompt + tokens])
        full = model(input_ids=ids).logits[0, len(prompt):].float()
        exact = reference(input_ids=ids).logits[0, len(prompt):]
    assert steps.dtype is torch.float32
    assert (steps - full).abs().max() < 0.05 * full.abs().max()
    assert (steps - exact).abs().mean() <= (full - exact).abs().mean() * 1.5


def test_a_wide_bfloat16_model_decodes_where_onednn_has_no_bfloat16_kernels(tokenizer, monkeypatch):
    """bfloat16 projections pack on oneDNN only where its bfloat16 kernels run (an AVX2 processor has none,
    and the pack raised there): the decoder packs exactly then, and its steps give a full forward's logits."""
    model = _wide_model().to(torch.bfloat16)
    packed_for = []
    original = projection.Projection.pack
    monkeypatch.setattr(projection.Projection, "pack", lambda self, rows: (packed_for.append(rows), original(self, rows)))
    prompt = _prompts(tokenizer, 1)[0]
    with torch.inference_mode():
        _, cache, mask, position = HFEngine(model, tokenizer)._prefill([prompt], 12, 1)
        decoder = static_decoder.StaticDecoder(model, cache, mask[:, : len(prompt)], 12)
        tokens = [7, 9, 11]
        steps = torch.stack([decoder.step(torch.tensor([t]), position[:, 0] + i)[0] for i, t in enumerate(tokens)])
        full = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt):].float()
    assert bool(packed_for) == linear.onednn_runs(torch.bfloat16)
    assert (steps - full).abs().max() < 0.05 * full.abs().max()
