"""Entropy controls and reward aggregation in the RL trainer: the adaptive coefficient moves and resumes, the
collapse warning fires, the high-entropy mask trains on the top fraction, Clip-Cov / KL-Cov and GDPO run."""

import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import test_rl


def digits_and_length(prompts, completions, **columns):
    """A second, dense reward beside the digit fraction: the completion's length."""
    return [float(len(c)) for c in completions]


def test_adaptive_coefficient_rises_while_entropy_is_below_target_and_resumes(tmp_path):
    cfg = test_rl.config(entropy={"coef": 0.0, "adaptive": {"target": 100.0, "lr": 0.002}})
    t = test_rl.trainer(tmp_path, cfg)
    coefs = [float(m["entropy/coef"]) for m in test_rl.run_steps(t, 3)]
    assert coefs == pytest.approx([0.0, 0.002, 0.004])
    state = t.extra_state()
    fresh = test_rl.trainer(tmp_path / "fresh", cfg)
    fresh.load_extra_state(state)
    assert fresh.entropy.coef == pytest.approx(0.006)


def test_collapse_floor_warns(tmp_path, caplog):
    t = test_rl.trainer(tmp_path, test_rl.config(entropy={"floor": 100.0}))
    with caplog.at_level(logging.WARNING):
        m = test_rl.run_steps(t, 1)[0]
    assert m["entropy/collapse"] == 1.0
    assert "entropy collapse" in caplog.text
    t = test_rl.trainer(tmp_path / "low", test_rl.config(entropy={"floor": 1e-6}))
    assert test_rl.run_steps(t, 1)[0]["entropy/collapse"] == 0.0


def test_top_entropy_quantile_trains_on_the_top_fraction(tmp_path):
    t = test_rl.trainer(tmp_path, test_rl.config(top_entropy_quantile=0.2))
    fractions = []
    policy_mask = t.entropy.policy_mask

    def spy(entropy, mask):
        kept = policy_mask(entropy, mask)
        fractions.append(float(kept.sum() / mask.sum()))
        assert set(kept.unique().tolist()) <= {0.0, 1.0} and bool((kept <= mask).all())
        return kept

    t.entropy.policy_mask = spy
    test_rl.run_steps(t, 2)
    assert fractions and all(0.15 <= f <= 0.3 for f in fractions), fractions


@pytest.mark.parametrize("loss", ["clip_cov", "kl_cov"])
def test_covariance_losses_train(tmp_path, loss):
    kwargs = {"clip_fraction": 0.05, "cov_low": 0.0, "cov_high": 100.0} if loss == "clip_cov" else {"kl_fraction": 0.05}
    t = test_rl.trainer(tmp_path, test_rl.config(policy_loss=loss, policy_loss_kwargs=kwargs, num_iterations=2))
    m = test_rl.run_steps(t, 2)[-1]
    key = "policy/cov_clipped_frac" if loss == "clip_cov" else "policy/cov_kl_frac"
    assert 0 < float(m[key]) <= 0.1


def test_gdpo_combines_rewards_per_group(tmp_path):
    t = test_rl.trainer(tmp_path, test_rl.config(reward_aggregation="gdpo"),
                        rewards=(test_rl.digit_fraction, digits_and_length))
    batches = []
    collect = t.collect
    t.collect = lambda: batches.append(collect()) or batches[-1]
    test_rl.run_steps(t, 1)
    scores = batches[0].scores.view(-1, 4)
    # each function normalised within the group and summed: every group's total sums to ~0
    assert scores.sum(1).abs().max() < 1e-4
    with pytest.raises(ValueError, match="valid names"):
        test_rl.config(reward_aggregation="mean")
