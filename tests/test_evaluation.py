"""Held-out figures carry n, Wilson intervals and, evaluated before and after, a paired gain."""

import json

import pytest

from tether.core.statistics import paired_bootstrap_interval, wilson_interval
from tether.evaluation import Figures, paired_gains, pass_at_k, with_intervals
from tether.models import build_tiny
from tether.tasks import get_task, sft_records
from tether.trainers.sft import SFTConfig, SFTTrainer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_with_intervals_adds_n_and_wilson_bounds():
    outcomes = {"accuracy": [1.0] * 8 + [0.0] * 2, "pass@4": [1.0] * 10}
    figures = with_intervals({"accuracy": 0.8, "pass@4": 1.0}, outcomes)
    assert isinstance(figures, Figures) and figures.outcomes == outcomes
    assert figures["n"] == 10.0
    assert figures["accuracy_ci95_low"] == pytest.approx(0.49016, abs=1e-4)  # by hand in test_statistics
    assert figures["accuracy_ci95_high"] == pytest.approx(0.94332, abs=1e-4)
    assert (figures["pass@4_ci95_low"], figures["pass@4_ci95_high"]) == wilson_interval(10, 10)


def test_paired_gains_only_for_rates_on_the_same_problems():
    before = {"accuracy": [0, 1, 0, 0], "pass@4": [1, 1]}
    after = {"accuracy": [1, 1, 0, 1], "pass@4": [1, 1, 1], "success": [1, 1, 1, 1]}
    gains = paired_gains(before, after)
    assert set(gains) == {"gain/accuracy", "gain/accuracy_ci95_low", "gain/accuracy_ci95_high"}
    assert gains["gain/accuracy"] == pytest.approx(0.5)
    assert (gains["gain/accuracy"], gains["gain/accuracy_ci95_low"], gains["gain/accuracy_ci95_high"]) == \
        paired_bootstrap_interval(before["accuracy"], after["accuracy"])


def test_pass_at_k_with_k_equal_n_is_a_per_problem_outcome():
    assert [pass_at_k(4, c, 4) for c in range(5)] == [0.0, 1.0, 1.0, 1.0, 1.0]


def test_a_stage_evaluated_before_and_after_reports_n_intervals_and_its_paired_gain(tmp_path):
    cfg = SFTConfig(name="sft", data={"task": {"name": "arithmetic", "n": 64}, "pack_length": 128},
                    train={"max_steps": 8, "batch_size": 8, "log_every": 1, "progress": False},
                    optim={"lr": 3e-3, "schedule": "constant"}, report_to=[],
                    eval={"n": 24, "max_new_tokens": 8, "before": True})
    model, tokenizer = build_tiny("tiny", seed=0)
    records = sft_records(get_task("arithmetic", digits=2), 64, seed=0)
    trainer = SFTTrainer(cfg, model, tokenizer, tmp_path, records=records)
    results = trainer.train()
    assert results["n"] == results["before/n"] == 24.0
    for prefix in ("", "before/"):
        low, high = results[f"{prefix}accuracy_ci95_low"], results[f"{prefix}accuracy_ci95_high"]
        assert low <= results[f"{prefix}accuracy"] <= high and high - low > 0
    assert results["gain/accuracy"] == pytest.approx(results["accuracy"] - results["before/accuracy"])
    assert results["gain/accuracy_ci95_low"] <= results["gain/accuracy"] <= results["gain/accuracy_ci95_high"]
    before = json.loads((trainer.stage_dir / "eval_before.json").read_text())
    assert len(before["accuracy"]) == 24 and sum(before["accuracy"]) / 24 == results["before/accuracy"]
