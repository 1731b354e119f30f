"""Pairs of successful vs failed agent episodes of one prompt (DMPO's data), on synthetic calculator
episodes; the tokenised pairs carry loss on the assistant turns only, one run of loss tokens per turn."""

import pytest

from tether.data import DataError
from tether.data.episode_pairs import episode_pairs
from tether.data.pairs import tokenize_pairs
from tether.models import build_tiny


def episode(a, b, *, right=True, detour=False):
    """A calculator episode for ``a*b=``: right (call, result, finish) or wrong (a wrong call, or a detour
    through a malformed action first)."""
    product = a * b if right else a + b
    turns = []
    if detour:
        turns += [{"role": "assistant", "content": f"Action: calc({a}*{b})"},
                  {"role": "tool", "content": "malformed action"}]
    expression = f"{a}*{b}" if right else f"{a}+{b}"
    turns += [{"role": "assistant", "content": f"Action: calculator[{expression}]"},
              {"role": "tool", "content": str(product)},
              {"role": "assistant", "content": f"Action: finish[{product}]"}]
    return {"prompt": [{"role": "user", "content": f"{a}*{b}="}], "completion": turns, "outcome": float(right)}


def test_pairs_success_with_failure_per_prompt_and_counts_the_rest():
    episodes = [episode(12, 3), episode(12, 3, right=False), episode(12, 3, right=False, detour=True),
                episode(12, 3),                               # 2 successes, 2 failures: 2 pairs
                episode(7, 8), episode(7, 8),                 # no failure
                episode(4, 5, right=False),                   # no success
                episode(6, 6), episode(6, 6, right=False)]    # 1 pair
    pairs, stats = episode_pairs(episodes, seed=1)
    assert stats == {"episodes": 9, "prompts": 4, "pairs": 3, "no_success": 1, "no_failure": 1, "identical": 0}
    assert [p["prompt"][0]["content"] for p in pairs] == ["12*3=", "12*3=", "6*6="]
    for pair in pairs:
        assert pair["chosen_outcome"] == 1.0 and pair["rejected_outcome"] == 0.0
        assert pair["chosen"][-1]["content"].endswith(f"[{eval(pair['prompt'][0]['content'][:-1])}]")
        assert pair["rejected"][0]["role"] == "assistant"
    # disjoint: the two 12*3 failures are each used once
    assert len({str(p["rejected"]) for p in pairs[:2]}) == 2
    assert episode_pairs(episodes, seed=1) == (pairs, stats)  # seeded
    assert episode_pairs(episodes, success_threshold=0.0)[1]["pairs"] == 0  # everything succeeds


def test_tokenised_pairs_mask_observations_one_run_per_assistant_turn():
    _, tok = build_tiny()
    pairs, _ = episode_pairs([episode(12, 3), episode(12, 3, right=False, detour=True)])
    (example,), _ = tokenize_pairs(pairs, tok, max_length=256)
    for side, turns, answer in ((example.chosen, 2, "finish[36]"), (example.rejected, 3, "finish[15]")):
        loss = [label != -100 for label in side.labels]
        runs = sum(1 for i, on in enumerate(loss) if on and (i == 0 or not loss[i - 1]))
        assert runs == turns
        trained = tok.decode([t for t, on in zip(side.input_ids, loss, strict=True) if on])
        assert trained.count("Action:") == turns and answer in trained and "<|tool|>" not in trained
    masked = tok.decode([t for t, label in zip(example.rejected.input_ids, example.rejected.labels, strict=True)
                         if label == -100])
    assert "malformed action" in masked and "<|tool|>15" in masked


def test_bad_episodes_are_one_line_errors():
    with pytest.raises(DataError, match="episode 2: needs fields prompt, completion, outcome"):
        episode_pairs([episode(1, 2), {"prompt": "x", "completion": []}])
    with pytest.raises(DataError, match="field 'outcome': expected a number"):
        episode_pairs([{**episode(1, 2), "outcome": "yes"}])
