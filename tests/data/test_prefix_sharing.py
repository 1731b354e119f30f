import pytest
import torch

from tether.data.prefix_sharing import (
    attention_pair_cost,
    common_prefix_length,
    layout_cost,
    pack_prefix_groups,
    sharing_pays,
)
from tether.models import build_tiny


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model, _ = build_tiny()
    return model.eval()


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


def test_bad_group_ids_are_refused():
    with pytest.raises(ValueError, match="group ids"):
        pack_prefix_groups([[1, 2]], [0, 1], row_tokens=8, pad_token_id=0)
