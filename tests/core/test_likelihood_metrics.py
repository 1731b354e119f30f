"""Likelihood metrics: perplexity and likelihood-vs-reward agreement, by hand and against a naive loop."""

import math

import pytest
import torch

from tether.core.likelihood_metrics import (
    LIKELIHOOD_METRICS,
    SequenceLikelihoods,
    pairwise_concordance,
    perplexity,
)


def test_perplexity_is_token_weighted_by_hand():
    """Sequence 1: two tokens at p = 1/2 (NLL 2 ln 2); sequence 2: one token at p = 1/8 (NLL 3 ln 2).
    Pooled: exp(5 ln 2 / 3) = 2^(5/3) ~ 3.17; the mean of per-sequence perplexities would be (2 + 8) / 2 = 5."""
    nll = torch.tensor([2 * math.log(2), 3 * math.log(2)])
    tokens = torch.tensor([2, 1])
    assert perplexity(nll, tokens).item() == pytest.approx(2 ** (5 / 3))
    assert perplexity(torch.tensor([0.0]), torch.tensor([4])).item() == pytest.approx(1.0)  # certain: ppl 1
    with pytest.raises(ValueError, match="at least one scored token"):
        perplexity(torch.tensor([0.0]), torch.tensor([0]))


def test_pairwise_concordance_by_hand():
    """Prompt 0: rewards 1, 0, 0 -> pairs (a>b) and (a>c); (b, c) tie in reward and is left out.
    Scores 0.5, 0.2, 0.7: (a, b) concordant, (a, c) discordant. Prompt 1: rewards 1, 2 with tied
    scores 3, 3 -> half credit. Prompt 2: a NaN reward -> no pair. (1 + 0 + 0.5) / 3 = 0.5.
    The cross-prompt pair (score 0.7 vs 3) never counts."""
    scores = torch.tensor([0.5, 0.2, 0.7, 3.0, 3.0, 1.0, 2.0])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, float("nan"), 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    value, pairs = pairwise_concordance(scores, rewards, groups)
    assert value.item() == pytest.approx(0.5) and pairs.item() == 3
    perfect, _ = pairwise_concordance(torch.tensor([3.0, 2.0, 1.0]), torch.tensor([1.0, 0.5, 0.0]), torch.zeros(3))
    reversed_, _ = pairwise_concordance(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 0.5, 0.0]), torch.zeros(3))
    assert perfect.item() == 1.0 and reversed_.item() == 0.0
    none, zero = pairwise_concordance(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0]), torch.tensor([0, 0]))
    assert math.isnan(none.item()) and zero.item() == 0
    with pytest.raises(ValueError, match="1-D of one length"):
        pairwise_concordance(torch.zeros(3), torch.zeros(2), torch.zeros(3))


def naive_concordance(scores, rewards, groups):
    credit, pairs = 0.0, 0
    for i in range(len(scores)):
        for j in range(len(scores)):
            if groups[i] == groups[j] and rewards[i] > rewards[j]:
                pairs += 1
                credit += 1.0 if scores[i] > scores[j] else 0.5 if scores[i] == scores[j] else 0.0
    return (credit / pairs if pairs else float("nan")), pairs


def test_pairwise_concordance_matches_a_loop():
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        scores = torch.randint(0, 4, (24,), generator=gen).float()  # ties in score too
        rewards = torch.randint(0, 3, (24,), generator=gen).float()
        groups = torch.arange(6).repeat_interleave(4)
        value, pairs = pairwise_concordance(scores, rewards, groups)
        expected, expected_pairs = naive_concordance(scores.tolist(), rewards.tolist(), groups.tolist())
        assert pairs.item() == expected_pairs and value.item() == pytest.approx(expected)


def test_agreement_ranks_by_the_mean_log_prob_and_reports_the_summed_ranking_beside_it():
    """One prompt: a long completion (10 tokens, sum -5, mean -0.5) with reward 1 and a short one
    (2 tokens, sum -2, mean -1) with reward 0. Per token the long one is likelier (agreement 1); summed,
    the short one is (agreement 0)."""
    samples = SequenceLikelihoods(torch.tensor([-5.0, -2.0]), torch.tensor([10, 2]), torch.tensor([1.0, 0.0]),
                                  torch.tensor([0, 0]))
    out = LIKELIHOOD_METRICS.get("likelihood_reward_agreement")(samples=samples)
    assert {k: float(v) for k, v in out.items()} == {"likelihood_reward_agreement": 1.0,
                                                     "likelihood_reward_agreement/summed": 0.0,
                                                     "likelihood_reward_agreement/pairs": 1.0}
    with pytest.raises(ValueError, match=r"eval\.samples > 1"):
        LIKELIHOOD_METRICS.get("likelihood_reward_agreement")(samples=SequenceLikelihoods(torch.zeros(2), torch.ones(2)))
    reference = SequenceLikelihoods(torch.tensor([-2 * math.log(2)]), torch.tensor([2]))
    out = LIKELIHOOD_METRICS.get("perplexity")(reference=reference)
    assert float(out["perplexity"]) == pytest.approx(2.0) and float(out["perplexity/tokens"]) == 2.0


def test_each_metric_declares_the_inputs_it_reads_and_the_config_checks_them():
    from tether.config.common import EvalConfig

    assert LIKELIHOOD_METRICS.needs("perplexity") == {"reference"}
    assert LIKELIHOOD_METRICS.needs("likelihood_reward_agreement") == {"samples"}
    assert EvalConfig(metrics=["perplexity", "distinct"]).metrics == ["perplexity", "distinct"]
    with pytest.raises(ValueError, match="set samples to 2 or more"):
        EvalConfig(metrics=["likelihood_reward_agreement"])
    assert EvalConfig(metrics=["likelihood_reward_agreement"], samples=4).samples == 4
