"""Cascade attention: the same logits and gradients as the dense prefix-sharing mask and as one forward per
sequence, fewer scored pairs, and the model's own attention restored afterwards."""

import pytest
import torch

import tether.models.logprobs as logprobs_module
from tether.data.pairs import PairExample
from tether.data.prefix_sharing import PrefixPacked, pack_prefix_groups
from tether.data.tokenize import TokenizedExample
from tether.models import build_tiny
from tether.models.attention import attention_implementation
from tether.models.cascade_attention import (
    cascade_attention,
    cascade_forward,
    cascade_layout,
    cascade_pays,
    supports_cascade,
)
from tether.models.logprobs import completion_logprobs, pair_logprobs, token_logprobs


def groups_of_sequences(seed=0):
    """Three prompts with members of different lengths, a pair sharing more than its prompt, and a group of
    one (a segment without a shared prefix)."""
    g = torch.Generator().manual_seed(seed)
    sequences, groups = [], []
    for k, n in enumerate((7, 3, 12)):
        prompt = torch.randint(3, 60, (n,), generator=g).tolist()
        for tail in ([7, 8, 9], [7, 8, 11, 12, 13], [20], [21, 22, 23, 24, 25, 26]):
            sequences.append(prompt + tail)
            groups.append(k)
    sequences.append([4, 5, 6])
    groups.append(99)
    return sequences, groups


@pytest.fixture(scope="module", params=[4, 2], ids=["mha", "gqa"])
def model(request):
    model, _ = build_tiny(seed=1, num_key_value_heads=request.param)
    return model.eval()


def dense_logits(model, packed):
    return model(**packed.model_inputs(model)).logits


def test_logits_match_the_dense_mask(model):
    sequences, groups = groups_of_sequences()
    packed = pack_prefix_groups(sequences, groups, row_tokens=40, pad_token_id=0)
    assert packed.input_ids.shape[0] > 1  # several rows, several segments to a row
    with torch.no_grad():
        cascade = cascade_forward(model, packed).logits
        assert "allowed" not in vars(packed)  # the dense mask is never built for a cascade forward
        dense = dense_logits(model, packed)
    real = packed.input_ids != 0
    torch.testing.assert_close(cascade[real], dense[real], atol=2e-5, rtol=1e-5)
    assert model.config._attn_implementation == "sdpa"


def test_gradients_match_the_dense_mask(model):
    sequences, groups = groups_of_sequences(seed=3)
    packed = pack_prefix_groups(sequences, groups, row_tokens=64, pad_token_id=0)
    weights = torch.randn((*packed.input_ids.shape, model.config.vocab_size), generator=torch.Generator()
                          .manual_seed(0)) * (packed.input_ids != 0)[..., None]

    def grads(forward):
        model.zero_grad()
        (forward(model, packed).log_softmax(-1) * weights).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(grads(lambda m, p: cascade_forward(m, p).logits), grads(dense_logits), strict=True):
        assert (a - b).norm() <= 1e-5 * b.norm()


def test_log_probs_match_one_forward_per_sequence(model):
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10], [9, 10], [9, 10], [11, 12, 13]]
    completions = [[14, 15], [14, 16, 17], [18], [19, 20, 21], [22, 23], [24, 25]]
    cascade, _ = completion_logprobs(model, prompts, completions, temperature=0.8, row_tokens=32, pad_token_id=0,
                                     share_prompts="cascade")
    plain, _ = completion_logprobs(model, prompts, completions, temperature=0.8, row_tokens=32, pad_token_id=0,
                                   share_prompts=False)
    torch.testing.assert_close(cascade, plain, atol=2e-5, rtol=1e-5)


def test_preference_pairs_match_plain_packing(model):
    def example(prompt, answer):
        return TokenizedExample(prompt + answer, [-100] * len(prompt) + answer)

    pairs = [PairExample(example([5, 6, 7], [8, 9]), example([5, 6, 7], [10, 11, 12])),
             PairExample(example([13, 14], [15]), example([13, 14], [16, 17]))]
    cascade = pair_logprobs(model, pairs, row_tokens=32, pad_token_id=0, prefix_sharing="cascade")
    plain = pair_logprobs(model, pairs, row_tokens=32, pad_token_id=0, prefix_sharing=False)
    torch.testing.assert_close(cascade[0], plain[0], atol=2e-5, rtol=1e-5)
    assert torch.equal(cascade[1], plain[1])


def test_the_layout_scores_fewer_pairs_than_the_row_mask():
    sequences = [[1] * 60 + [k + 1] * (4 * k) for k in range(1, 9)]  # one 60-token prompt, eight answers
    packed = pack_prefix_groups(sequences, [0] * 8, row_tokens=256, pad_token_id=0)
    layout = cascade_layout(packed)
    width = packed.input_ids.shape[1]
    assert layout.scored_pairs() < 0.8 * packed.input_ids.shape[0] * width * width  # the dense call scores W^2
    # the prefix once, causally; each answer against the prefix and itself (padding query slots aside)
    assert layout.prefix_mask[:, 0][layout.prefix_valid].sum() == 60 * 61 / 2
    assert layout.suffix_mask[:, 0][layout.suffix_valid].sum() == sum(4 * k * 60 + 4 * k * (4 * k + 1) / 2 for k in range(1, 9))
    # every real token reads its own output slot once; pads read the zero row after all slots
    slots = torch.cat([layout.prefix_valid.view(-1), layout.suffix_valid.view(-1)]).nonzero().view(-1)
    real = packed.input_ids.view(-1) != 0
    assert sorted(layout.order[real].tolist()) == slots.tolist() and len(slots) == 60 + 4 * 36
    assert bool((layout.order[~real] == layout.prefix_valid.numel() + layout.suffix_valid.numel()).all())


def test_without_a_layout_it_is_sdpa(model):
    q, k, v = (torch.randn(1, 4, 6, 8) for _ in range(3))
    kv = model.config.num_key_value_heads
    out, _ = cascade_attention(model.model.layers[0].self_attn, q, k[:, :kv], v[:, :kv], None, scaling=0.3,
                               is_causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k[:, :kv], v[:, :kv], is_causal=True, scale=0.3,
                                                                enable_gqa=kv != 4)
    torch.testing.assert_close(out, expected.transpose(1, 2))


def test_the_attention_is_restored_after_an_error(model):
    with pytest.raises(RuntimeError, match="boom"), attention_implementation(model, "eager"):
        assert model.config._attn_implementation == "eager"
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"


def test_models_without_the_attention_interface_fall_back_to_the_dense_mask(model, monkeypatch):
    assert supports_cascade(model)
    assert not supports_cascade(torch.nn.Linear(2, 2))
    cascades, masks = [], []
    monkeypatch.setattr(logprobs_module, "supports_cascade", lambda m: False)
    monkeypatch.setattr(logprobs_module, "cascade_forward", lambda *a: cascades.append(1))
    original = PrefixPacked.model_inputs
    monkeypatch.setattr(PrefixPacked, "model_inputs", lambda self, m: masks.append(1) or original(self, m))
    sequences, groups = groups_of_sequences()
    logps, _, _ = token_logprobs(model, sequences, first_targets=[2] * len(sequences), groups=groups,
                                 row_tokens=64, pad_token_id=0, prefix_sharing="cascade")
    assert not cascades and masks == [1] and logps.shape[0] == len(sequences)


def test_an_unknown_sharing_mode_is_refused(model):
    with pytest.raises(ValueError, match="prefix_sharing must be"):
        token_logprobs(model, [[3, 4, 5]], first_targets=[1], groups=[0], row_tokens=16, pad_token_id=0,
                       prefix_sharing="dense")


def test_cascade_pays_on_a_cpu_for_groups_of_more_than_two():
    assert cascade_pays(torch.device("cpu"), 8) and cascade_pays("cpu", 2.5)
    assert not cascade_pays("cpu", 2)  # preference pairs: the dense mask is faster (docs/performance.md)
    assert not cascade_pays("cuda", 8) and not cascade_pays("meta", 8)  # no fused kernel: slower on a GPU


@pytest.mark.parametrize(("sharing", "members", "expected"), [
    (True, 4, "cascade"), (True, 2, "mask"), ("mask", 4, "mask"), ("cascade", 2, "cascade"), ("auto", 4, "mask"),
])
def test_the_default_sharing_picks_the_faster_attention(model, monkeypatch, sharing, members, expected):
    routes = []
    original_cascade, original_mask = logprobs_module.cascade_forward, PrefixPacked.model_inputs
    monkeypatch.setattr(logprobs_module, "cascade_forward", lambda *a: routes.append("cascade") or original_cascade(*a))
    monkeypatch.setattr(PrefixPacked, "model_inputs", lambda self, m: routes.append("mask") or original_mask(self, m))
    monkeypatch.setattr(logprobs_module, "sharing_pays", lambda *a, **k: True)
    prompt = [5, 6, 7, 8, 9, 10]
    sequences = [prompt + [11 + k] * (k + 1) for k in range(members)]
    logps, _, _ = token_logprobs(model, sequences, first_targets=[len(prompt)] * members, groups=[0] * members,
                                 row_tokens=64, pad_token_id=0, prefix_sharing=sharing)
    assert routes == [expected]
    plain, _, _ = token_logprobs(model, sequences, first_targets=[len(prompt)] * members, groups=None, row_tokens=64,
                                 pad_token_id=0)
    torch.testing.assert_close(logps, plain, atol=2e-5, rtol=1e-5)


def tiny_gemma2(softcap):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_logit_softcapping=softcap,
                          query_pre_attn_scalar=8, attn_implementation="eager")
    torch.manual_seed(0)
    return Gemma2ForCausalLM(config).eval()


def test_models_whose_attention_is_not_plain_softmax_share_under_the_dense_mask(model):
    gemma = tiny_gemma2(softcap=0.5)  # a small cap, so dropping it would move the logits a lot
    assert not supports_cascade(gemma) and supports_cascade(tiny_gemma2(softcap=None))
    sink = model.model.layers[0].self_attn
    sink.sinks = torch.nn.Parameter(torch.zeros(4))
    try:
        assert not supports_cascade(model)  # attention sinks (gpt-oss)
    finally:
        del sink.sinks
    assert supports_cascade(model)
    prompts = [[5, 6, 7, 8]] * 3 + [[9, 10]] * 3
    completions = [[14, 15], [14, 16, 17], [18], [19, 20, 21], [22, 23], [24]]
    with torch.no_grad():
        shared, _ = completion_logprobs(gemma, prompts, completions, temperature=1.0, row_tokens=32,
                                        pad_token_id=0, share_prompts="cascade")
        plain, _ = completion_logprobs(gemma, prompts, completions, temperature=1.0, row_tokens=32,
                                       pad_token_id=0, share_prompts=False)
    torch.testing.assert_close(shared, plain, atol=2e-5, rtol=1e-5)


def test_cascade_attention_refuses_soft_capping_it_would_drop(model):
    sequences, groups = groups_of_sequences()
    layout = cascade_layout(pack_prefix_groups(sequences, groups, row_tokens=64, pad_token_id=0))
    q = torch.randn(1, 4, layout.shape[0] * layout.shape[1], 8)
    with pytest.raises(ValueError, match="prefix_sharing: mask"):
        cascade_attention(model.model.layers[0].self_attn, q, q, q, None, cascade=layout, softcap=30.0)
