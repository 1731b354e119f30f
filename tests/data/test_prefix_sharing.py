import pytest
import torch

import tether.data.prefix_sharing as prefix_sharing
from tether.core.logprobs import entropy_from_logits, selective_log_softmax
from tether.data.prefix_sharing import (
    attention_pair_cost,
    common_prefix_length,
    layout_cost,
    pack_prefix_groups,
    sequence_token_logprobs,
    sharing_pays,
    supports_custom_masks,
)
from tether.models import build_tiny


def one_by_one(model, sequences, first_targets, temperature=1.0):
    """The naive reference: one unpacked forward pass per sequence."""
    logps, entropies = [], []
    for s, f in zip(sequences, first_targets, strict=True):
        ids = torch.tensor([s])
        logits = model(input_ids=ids, use_cache=False).logits
        labels = torch.full_like(ids, -100)
        labels[0, f - 1:-1] = ids[0, f:]
        logps.append(selective_log_softmax(logits, labels, temperature=temperature)[0, f - 1:-1])
        entropies.append(entropy_from_logits(logits, temperature=temperature)[0, f - 1:-1])
    return logps, entropies


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model, _ = build_tiny()
    return model.eval()


@pytest.fixture
def always_share(monkeypatch):
    """Take the shared layout whatever the cost model says, and count that it was taken."""
    calls = []
    original = prefix_sharing.pack_prefix_groups
    monkeypatch.setattr(prefix_sharing, "sharing_pays", lambda *a, **k: True)
    monkeypatch.setattr(prefix_sharing, "pack_prefix_groups", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


def test_common_prefix_leaves_each_sequence_a_token():
    assert common_prefix_length([[1, 2, 3, 4], [1, 2, 5]]) == 2
    assert common_prefix_length([[1, 2, 3], [1, 2, 3, 4]]) == 2  # not all of the shorter one
    assert common_prefix_length([[1, 2], [1, 2]]) == 1
    assert common_prefix_length([[7, 8, 9]]) == 0
    assert common_prefix_length([[1, 2, 3], [1, 2, 4], [1, 9]]) == 1


def test_layout_mask_and_positions_by_hand():
    packed = pack_prefix_groups([[1, 2, 3, 4], [1, 2, 5]], [0, 0], row_tokens=16, pad_token_id=0)
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2]]
    assert packed.columns.tolist() == [[0, 1, 2, 3], [0, 1, 4, -1]]
    assert packed.shared_tokens == 2
    allowed = packed.allowed[0].int().tolist()
    assert allowed == [[1, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0],
                       [1, 1, 1, 0, 0],
                       [1, 1, 1, 1, 0],
                       [1, 1, 0, 0, 1]]  # the second suffix sees the prefix, not the first suffix


def test_pads_and_other_groups_are_invisible():
    packed = pack_prefix_groups([[1, 2, 3], [1, 2, 4], [5, 6, 7, 8, 9, 1, 2, 3]], [0, 0, 1], row_tokens=8,
                                pad_token_id=0)
    for r in range(packed.input_ids.shape[0]):
        allowed = packed.allowed[r]
        assert bool(allowed.diagonal().all())  # every token, pads included, sees itself: no empty softmax row
    # a token of sequence 2 never sees a token of group 0
    r2 = int(packed.rows[2])
    cols2 = packed.columns[2][packed.columns[2] >= 0]
    if int(packed.rows[0]) == r2:
        cols0 = packed.columns[0][packed.columns[0] >= 0]
        assert not bool(packed.allowed[r2][cols2][:, cols0].any())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_log_probs_and_entropy_match_one_forward_per_sequence(model, attn, always_share):
    model.config._attn_implementation = attn
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (5, 9, 3)]
    sequences, groups, first = [], [], []
    for k, p in enumerate(prompts):  # three groups of completions, some sharing more than the prompt
        for c in ([7, 8, 9, 10], [7, 8, 11], [12], [7, 8, 9, 10, 13, 14]):
            sequences.append(p + c)
            groups.append(k)
            first.append(len(p))
    sequences.append([4, 5])  # a group of one
    groups.append(99)
    first.append(1)
    try:
        logps, valid, entropy = sequence_token_logprobs(model, sequences, first_targets=first, groups=groups,
                                                        temperature=0.7, row_tokens=32, pad_token_id=0,
                                                        with_entropy=True)
        plain, plain_valid, _ = sequence_token_logprobs(model, sequences, first_targets=first, groups=None,
                                                        temperature=0.7, row_tokens=32, pad_token_id=0)
    finally:
        model.config._attn_implementation = "sdpa"
    assert always_share == [1]  # the grouped call was laid out as prefix trees, the other was not
    expected, expected_entropy = one_by_one(model, sequences, first, temperature=0.7)
    for i, (e, h) in enumerate(zip(expected, expected_entropy, strict=True)):
        n = len(e)
        assert valid[i].sum() == n and plain_valid[i].sum() == n
        torch.testing.assert_close(logps[i, :n], e, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(plain[i, :n], e, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(entropy[i, :n], h, atol=2e-5, rtol=1e-5)
        assert bool((logps[i, n:] == 0).all())


def test_gradients_match_one_forward_per_sequence(model, always_share):
    sequences = [[3, 4, 5, 6, 7], [3, 4, 5, 9], [3, 4, 8, 8, 8, 8]]
    first = [2, 2, 2]
    weights = torch.tensor([[1.0, -2.0, 0.5], [0.3, 0.2, 0.0], [1.0, 1.0, -1.0]])

    def grads(fn):
        model.zero_grad()
        fn().backward()
        return [p.grad.clone() for p in model.parameters()]

    def shared():
        logps, _, _ = sequence_token_logprobs(model, sequences, first_targets=first, groups=[0, 0, 0],
                                              row_tokens=64, pad_token_id=0)
        return (logps[:, :3] * weights).sum()

    def naive():
        return sum((lp[:3] * w[: len(lp[:3])]).sum() for lp, w in zip(one_by_one(model, sequences, first)[0], weights,
                                                                     strict=True))

    for a, b in zip(grads(shared), grads(naive), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert always_share


def test_layout_cost_by_hand():
    # sizes 5, 3, 2 under a 128-token floor: one row of width 10
    assert layout_cost([5, 3, 2], row_tokens=1024, pair_cost=0.5) == 1 * (10 + 0.5 * 100)
    # 200 tokens each: rows capped at 400, two rows of width 400
    assert layout_cost([200, 200, 200, 200], row_tokens=1024, pair_cost=0.0) == 2 * 400


def test_attention_pair_cost_by_hand(model):
    cfg = model.config  # tiny: hidden 128 (4 heads of 32), 4 layers, untied 100-odd-token embeddings
    weights = sum(p.numel() for p in model.parameters()) - 2 * cfg.vocab_size * cfg.hidden_size
    assert attention_pair_cost(model) == pytest.approx(2 * 128 / (weights / 4))
    per_layer = 4 * 128 * 128 + 3 * 128 * 384 + 2 * 128  # q, k, v, o; gate, up, down; two norms
    assert attention_pair_cost(model) == pytest.approx(2 * 128 / (per_layer + 128 / 4))  # + final norm


def test_sharing_pays_for_long_prefixes_not_for_short_ones_on_a_narrow_model(model):
    g = torch.Generator().manual_seed(0)

    def groups_of(prefix, suffix, members=8, n=8):
        sequences, groups = [], []
        for k in range(n):
            shared = torch.randint(3, 60, (prefix,), generator=g).tolist()
            for _ in range(members):
                sequences.append(shared + torch.randint(3, 60, (suffix,), generator=g).tolist())
                groups.append(k)
        return sequences, groups

    pair = attention_pair_cost(model)
    # a GRPO group on the tiny model: 6 prompt tokens, 32-token completions. Sharing saves 42 tokens a
    # group but makes a 262-token dense block: more attention than it saves
    assert not sharing_pays(*groups_of(6, 32), row_tokens=1024, pair_cost=pair)
    # a DPO pair: a 30-token prompt and answer start, 15-token suffixes
    assert sharing_pays(*groups_of(30, 15, members=2, n=16), row_tokens=1024, pair_cost=pair)
    # on a wide model (attention cheap against the weights) the GRPO group pays too
    assert sharing_pays(*groups_of(6, 32), row_tokens=1024, pair_cost=pair / 4)


def test_only_if_cheaper_asks_the_cost_model(model, monkeypatch):
    calls = []
    original = prefix_sharing.pack_prefix_groups
    monkeypatch.setattr(prefix_sharing, "pack_prefix_groups", lambda *a, **k: calls.append(1) or original(*a, **k))
    long_prefix = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14]]
    layout = dict(first_targets=[1, 1], groups=[0, 0], row_tokens=64, pad_token_id=0)
    sequence_token_logprobs(model, long_prefix, only_if_cheaper=True, **layout)
    assert calls == [1]  # a 10-token prefix of 11-token sequences: sharing pays
    monkeypatch.setattr(prefix_sharing, "sharing_pays", lambda *a, **k: False)
    sequence_token_logprobs(model, long_prefix, only_if_cheaper=True, **layout)
    assert calls == [1]  # the cost model said no: packed side by side
    sequence_token_logprobs(model, long_prefix, **layout)
    assert calls == [1, 1]  # without only_if_cheaper groups always share


def test_models_without_custom_masks_fall_back_to_plain_packing(model, monkeypatch):
    import tether.data.prefix_sharing as prefix_sharing

    assert supports_custom_masks(model)
    model.config._attn_implementation = "flash_attention_2"
    try:
        assert not supports_custom_masks(model)
    finally:
        model.config._attn_implementation = "sdpa"
    monkeypatch.setattr(prefix_sharing, "supports_custom_masks", lambda m: False)
    monkeypatch.setattr(prefix_sharing, "pack_prefix_groups", None)  # never reached
    logps, _, _ = sequence_token_logprobs(model, [[1, 2, 3], [1, 2, 4]], first_targets=[1, 1], groups=[0, 0],
                                              row_tokens=16, pad_token_id=0)
    expected, _ = one_by_one(model, [[1, 2, 3], [1, 2, 4]], [1, 1])
    torch.testing.assert_close(logps[0], expected[0], atol=2e-5, rtol=1e-5)


def test_bad_first_targets_are_refused(model):
    with pytest.raises(ValueError, match="first_targets"):
        sequence_token_logprobs(model, [[1, 2]], first_targets=[0], row_tokens=8, pad_token_id=0)
    with pytest.raises(ValueError, match="group ids"):
        pack_prefix_groups([[1, 2]], [0, 1], row_tokens=8, pad_token_id=0)
