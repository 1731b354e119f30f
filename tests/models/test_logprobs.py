"""The one log-prob entry point: packed (and prefix-shared) forward passes against one forward per sequence."""

import pytest
import torch

import tether.models.logprobs as logprobs_module
from tether.core.logprobs import entropy_from_logits, selective_log_softmax
from tether.data.prefix_sharing import supports_custom_masks
from tether.models import build_tiny
from tether.models.logprobs import token_logprobs


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
    original = logprobs_module.pack_prefix_groups
    monkeypatch.setattr(logprobs_module, "sharing_pays", lambda *a, **k: True)
    monkeypatch.setattr(logprobs_module, "pack_prefix_groups", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


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
        logps, valid, entropy = token_logprobs(model, sequences, first_targets=first, groups=groups,
                                                        temperature=0.7, row_tokens=32, pad_token_id=0,
                                                        with_entropy=True)
        plain, plain_valid, _ = token_logprobs(model, sequences, first_targets=first, groups=None,
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
        logps, _, _ = token_logprobs(model, sequences, first_targets=first, groups=[0, 0, 0],
                                              row_tokens=64, pad_token_id=0)
        return (logps[:, :3] * weights).sum()

    def naive():
        return sum((lp[:3] * w[: len(lp[:3])]).sum() for lp, w in zip(one_by_one(model, sequences, first)[0], weights,
                                                                     strict=True))

    for a, b in zip(grads(shared), grads(naive), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert always_share


def test_auto_sharing_asks_the_cost_model(model, monkeypatch):
    calls = []
    original = logprobs_module.pack_prefix_groups
    monkeypatch.setattr(logprobs_module, "pack_prefix_groups", lambda *a, **k: calls.append(1) or original(*a, **k))
    long_prefix = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14]]
    layout = dict(first_targets=[1, 1], groups=[0, 0], row_tokens=64, pad_token_id=0)
    token_logprobs(model, long_prefix, prefix_sharing="auto", **layout)
    assert calls == [1]  # a 10-token prefix of 11-token sequences: sharing pays
    monkeypatch.setattr(logprobs_module, "sharing_pays", lambda *a, **k: False)
    token_logprobs(model, long_prefix, prefix_sharing="auto", **layout)
    assert calls == [1]  # the cost model said no: packed side by side
    token_logprobs(model, long_prefix, **layout)
    assert calls == [1, 1]  # prefix_sharing=True: groups always share


def test_models_without_custom_masks_fall_back_to_plain_packing(model, monkeypatch):
    assert supports_custom_masks(model)
    model.config._attn_implementation = "flash_attention_2"
    try:
        assert not supports_custom_masks(model)
    finally:
        model.config._attn_implementation = "sdpa"
    monkeypatch.setattr(logprobs_module, "supports_custom_masks", lambda m: False)
    monkeypatch.setattr(logprobs_module, "pack_prefix_groups", None)  # never reached
    logps, _, _ = token_logprobs(model, [[1, 2, 3], [1, 2, 4]], first_targets=[1, 1], groups=[0, 0],
                                              row_tokens=16, pad_token_id=0)
    expected, _ = one_by_one(model, [[1, 2, 3], [1, 2, 4]], [1, 1])
    torch.testing.assert_close(logps[0], expected[0], atol=2e-5, rtol=1e-5)


def test_bad_first_targets_are_refused(model):
    with pytest.raises(ValueError, match="first_targets"):
        token_logprobs(model, [[1, 2]], first_targets=[0], row_tokens=8, pad_token_id=0)


@pytest.mark.parametrize("shared", [False, True])
def test_sequential_kl_matches_one_forward_per_sequence(shared, always_share):
    """TDPO's Σ_t KL(π_ref ‖ π) over loss tokens, packed (a pair's prefix shared or not), equals the sum
    of full-vocabulary KLs from one forward per sequence and per model; gradients reach the policy only."""
    from tether.data.tokenize import TokenizedExample
    from tether.models.logprobs import example_sequential_kl

    torch.manual_seed(1)
    policy, _ = build_tiny()
    reference, _ = build_tiny(seed=7)
    reference.eval()
    prompt = [5, 9, 11, 4]
    completions = [[7, 8, 3, 2], [7, 6, 2], [12, 13, 14, 2]]
    examples = [TokenizedExample(prompt + c, [-100] * len(prompt) + c) for c in completions]
    tok, mask, kl = example_sequential_kl(policy, reference, examples, row_tokens=64, pad_token_id=0,
                                          groups=[0, 0, 0] if shared else None)
    naive = []
    for e in examples:
        ids = torch.tensor([e.input_ids])
        pol = torch.log_softmax(policy(input_ids=ids, use_cache=False).logits.float(), -1)[0, len(prompt) - 1:-1]
        with torch.no_grad():
            ref = torch.log_softmax(reference(input_ids=ids, use_cache=False).logits.float(), -1)[0, len(prompt) - 1:-1]
        naive.append((ref.exp() * (ref - pol)).sum())
        target = torch.tensor(e.input_ids[len(prompt):])
        row = examples.index(e)
        torch.testing.assert_close(tok[row, : len(target)], pol.gather(-1, target[:, None])[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kl, torch.stack(naive), rtol=1e-5, atol=1e-5)
    assert mask.sum(-1).tolist() == [4, 3, 4] and bool((kl > 0).all())
    kl.sum().backward()
    assert all(p.grad is None for p in reference.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())
    if shared:
        assert always_share
