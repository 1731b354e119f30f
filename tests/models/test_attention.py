"""The attention kernel of a bf16-mixed training forward: matrix products with a softmax in bfloat16
(``tether_matmul``) on a CPU inside the training autocast (with or without gradients, so a frozen pass
computes what the training forward computes), SDPA otherwise; the same values to bfloat16 rounding either
way, and the model's own setting restored."""

import pytest
import torch
import torch.nn.functional as F

from tether.data.packing import pack_sequences
from tether.data.prefix_sharing import pack_prefix_groups, supports_custom_masks
from tether.models import build_tiny, cascade_attention
from tether.models.attention import (
    MATMUL_ATTENTION,
    matmul_attention,
    matmul_attention_pays,
    training_autocast,
)
from tether.models.cascade_attention import cascade_forward

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_matmul_attention_pays_only_on_a_cpu_in_16_bits_with_gradients_or_in_the_training_forward():
    assert matmul_attention_pays(CPU, torch.bfloat16) and matmul_attention_pays(CPU, torch.float16)
    assert not matmul_attention_pays(CPU, torch.float32)
    assert not matmul_attention_pays(CUDA, torch.bfloat16)
    with torch.no_grad():
        assert not matmul_attention_pays(CPU, torch.bfloat16)  # a bfloat16 model decoding: SDPA
        with training_autocast(build_tiny(seed=0)[0], CPU):
            assert matmul_attention_pays(CPU, torch.bfloat16)  # a frozen pass: the training forward's kernel
        assert not matmul_attention_pays(CPU, torch.bfloat16)


def attention_inside(model, **grad):
    with torch.set_grad_enabled(grad.get("enabled", True)), training_autocast(model, CPU):
        return getattr(model, "module", model).config._attn_implementation


def test_training_autocast_runs_matmul_attention_while_gradients_are_taken_and_restores_sdpa():
    model, _ = build_tiny(seed=0)
    assert model.config._attn_implementation == "sdpa"
    assert attention_inside(model) == MATMUL_ATTENTION
    assert attention_inside(model, enabled=False) == MATMUL_ATTENTION  # frozen passes: the same kernel
    assert model.config._attn_implementation == "sdpa"

    class Wrapped(torch.nn.Module):  # DistributedDataParallel's layout: the model in .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert attention_inside(Wrapped(model)) == MATMUL_ATTENTION
    policy, critic = build_tiny(seed=0)[0], build_tiny(seed=1)[0]  # an actor-critic: two models, both switched
    with training_autocast(torch.nn.ModuleDict({"policy": policy, "critic": critic}), CPU):
        assert {policy.config._attn_implementation, critic.config._attn_implementation} == {MATMUL_ATTENTION}
    assert {policy.config._attn_implementation, critic.config._attn_implementation} == {"sdpa"}
    model.config._attn_implementation = "flash_attention_2"  # a user's choice is left alone
    assert attention_inside(model) == "flash_attention_2"


def test_a_frozen_pass_in_the_training_autocast_gives_the_training_forward_s_logits_bit_for_bit():
    model, _ = build_tiny(seed=0)
    ids = torch.randint(3, 60, (4, 24), generator=torch.Generator().manual_seed(0))

    def logits(grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(grad), training_autocast(model, CPU):
            return model(ids).logits.detach()

    assert torch.equal(logits(False), logits(True))


def test_matmul_attention_under_autocast_gives_sdpa_s_logits_and_gradients_to_bfloat16_rounding():
    model, _ = build_tiny(seed=0)
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (9, 17, 5, 30, 12)]
    packed = pack_sequences(sequences, row_tokens=40, pad_token_id=0)

    def run(switch: bool):
        model.zero_grad()
        context = training_autocast(model, CPU) if switch else torch.autocast("cpu", dtype=torch.bfloat16)
        with context:
            implementation = model.config._attn_implementation
            logits = model(**packed.model_inputs()).logits.float()
        logits.log_softmax(-1).mean().backward()
        return implementation, logits.detach(), [p.grad.clone() for p in model.parameters()]

    eager, sdpa = run(True), run(False)
    assert (eager[0], sdpa[0]) == (MATMUL_ATTENTION, "sdpa")
    real = packed.input_ids != 0
    torch.testing.assert_close(eager[1][real], sdpa[1][real], atol=5e-2, rtol=5e-2)
    for a, b in zip(eager[2], sdpa[2], strict=True):
        assert (a - b).norm() <= 5e-2 * b.norm() + 1e-6


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("additive", [False, True])
def test_matmul_attention_equals_sdpa(kv_heads, additive):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 5, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(3, kv_heads, 7, 8, generator=g, requires_grad=True) for _ in range(2))
    mask = torch.rand(3, 1, 5, 7, generator=g) > 0.3
    mask[..., 0] = True  # every query sees a key
    given = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min) if additive else mask
    ours, weights = matmul_attention(q, k, v, given, scale=0.3)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=kv_heads != 4)
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 4, 5))
    assert not weights.masked_select(~mask).any()
    grads = torch.autograd.grad(ours.square().sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad(reference.square().sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_matmul_attention_softmax_stays_bfloat16_and_rounds_like_eager_s_float32_softmax():
    """Under autocast the probabilities are bfloat16 with no float32 round trip, and they are the float32
    softmax's probabilities rounded once (transformers' ``eager``: a float32 softmax, then a cast)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g) for _ in range(3))
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    additive = torch.zeros(1, 1, 16, 16).masked_fill(~causal, torch.finfo(torch.float32).min)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, weights = matmul_attention(q, k, v, additive)
        scores = (q * 8 ** -0.5) @ k.transpose(-1, -2)
        eager = (scores.float() + additive).softmax(-1).to(torch.bfloat16)
    assert out.dtype == weights.dtype == torch.bfloat16
    assert (weights.float() - eager.float()).abs().max() <= 2 ** -8 * eager.float().abs().max()
    assert weights.isfinite().all() and not weights.masked_select(~causal).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_that_sees_no_key_gets_finite_weights(dtype):
    """float32's lowest value rounds to -inf in bfloat16; the mask is clamped first, so a fully masked row
    (padding) gets uniform weights as in ``eager``, not NaN."""
    q, k, v = (torch.randn(1, 2, 3, 4, dtype=dtype) for _ in range(3))
    additive = torch.zeros(1, 1, 3, 3)
    additive[0, 0, 1] = torch.finfo(torch.float32).min
    boolean = additive == 0
    for mask in (additive, boolean):
        out, weights = matmul_attention(q, k, v, mask)
        assert out.isfinite().all()
        torch.testing.assert_close(weights[0, :, 1].float(), torch.full((2, 3), 1 / 3), atol=1e-2, rtol=0)


def test_a_model_on_matmul_attention_equals_sdpa_on_padded_and_packed_inputs():
    """Registered with transformers' full additive mask: padding (a 2-D mask) and packed rows (position ids)
    reach it; a skipped mask would let packed sequences attend to each other."""
    model, _ = build_tiny(seed=0)
    g = torch.Generator().manual_seed(2)
    packed = pack_sequences([torch.randint(3, 60, (n,), generator=g).tolist() for n in (9, 17, 5, 30, 12)],
                            row_tokens=40, pad_token_id=0)
    ids = torch.randint(3, 60, (2, 12), generator=g)
    padded = {"input_ids": ids, "attention_mask": (torch.arange(12) >= torch.tensor([[0], [5]])).long()}  # left padding

    def logits(name: str, inputs: dict) -> torch.Tensor:
        model.config._attn_implementation = name
        with torch.no_grad():
            return model(**inputs).logits

    for inputs, real in ((packed.model_inputs(), packed.input_ids != 0), (padded, padded["attention_mask"] == 1)):
        torch.testing.assert_close(logits(MATMUL_ATTENTION, inputs)[real], logits("sdpa", inputs)[real],
                                   atol=1e-5, rtol=1e-4)


def test_cascade_in_bf16_training_takes_the_matmul_path_and_matches_the_dense_mask():
    model, _ = build_tiny(seed=1)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 60, (9,), generator=g).tolist()
    sequences = [prompt + torch.randint(3, 60, (n,), generator=g).tolist() for n in (4, 11, 7)]
    packed = pack_prefix_groups(sequences, [0, 0, 0], row_tokens=64, pad_token_id=0)
    calls = []
    original = cascade_attention._matmul_sdpa

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    cascade_attention._matmul_sdpa = counted
    try:
        with training_autocast(model, CPU):
            cascade = cascade_forward(model, packed).logits.float()
            dense = model(**packed.model_inputs(model)).logits.float()
    finally:
        cascade_attention._matmul_sdpa = original
    assert calls  # bf16 with gradients on a CPU: matrix products, not SDPA
    real = packed.input_ids != 0
    torch.testing.assert_close(cascade[real], dense[real], atol=5e-2, rtol=5e-2)


def test_prefix_sharing_keeps_its_mask_while_training_attention_is_switched():
    """Log-probs are computed inside the training forward's autocast: the switched kernel must still count
    as one that takes prefix sharing's 4-D mask, or bf16-mixed would silently fall back to plain packing."""
    model, _ = build_tiny(seed=0)
    with training_autocast(model, CPU):
        assert model.config._attn_implementation == MATMUL_ATTENTION
        assert supports_custom_masks(model)
