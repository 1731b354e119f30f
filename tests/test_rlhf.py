"""The synthetic InstructGPT pipeline's stages: gold-labelled data files, and the over-optimisation sweep
(one PPO run per beta, figures per beta, the plot) on the random tiny model."""

import json
import math

import pytest

from tether.pipeline import run_recipe
from tether.rlhf import GoldDataConfig, OverOptimizationConfig, gold_data, plot_overoptimization


def test_gold_data_writes_demonstrations_and_comparisons(tmp_path):
    results = gold_data(GoldDataConfig(sft_n=40, noise=0.5, pairs_n=30, eval_pairs_n=10), tmp_path)
    assert results["demonstrations"] == 40 and results["pairs"] == 30 and results["eval_pairs"] == 10
    pairs = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    assert all(p["gold_chosen"] > p["gold_rejected"] for p in pairs)
    assert len((tmp_path / "sft.jsonl").read_text().splitlines()) == 40


def test_sweep_runs_ppo_per_beta_and_plots_gold_and_proxy_against_kl(tmp_path):
    ppo = {"model": {"name_or_path": "tether/tiny"}, "data": {"task": {"n": 16}},
           "rollout": {"max_new_tokens": 6}, "rewards": [{"name": "tether.tasks.gold:gold_reward"}],
           "gold": {"name": "tether.tasks.gold:gold_reward"}, "critic": {"init": "policy"}, "ppo_epochs": 1,
           "row_tokens": 32, "train": {"max_steps": 1, "batch_size": 2, "progress": False, "log_every": 1},
           "eval": {"n": 2, "max_new_tokens": 6}, "report_to": []}
    recipe = {"name": "sweep", "stages": [{"name": "over", "type": "overoptimization", "betas": [0.5, 0.0],
                                           "best_of_n": [1, 3], **ppo}]}
    results = run_recipe(recipe, tmp_path, report=False)["over"]
    assert {"beta=0.5/gold", "beta=0/proxy", "beta=0/kl", "start/gold", "peak_beta"} <= set(results)
    assert results["bon/n=1/kl"] == 0.0 and results["bon/n=3/kl"] == pytest.approx(math.log(3) - 2 / 3)
    assert results["bon/n=3/proxy"] >= results["bon/n=1/proxy"]  # the best of 3 by the proxy, on the same samples
    assert (tmp_path / "overoptimization.png").stat().st_size > 1000
    assert (tmp_path / "over-beta0.5" / "stage.json").exists() and (tmp_path / "over" / "stage.json").exists()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"over-beta0.5", "over-beta0"} <= {r["stage"] for r in rows if "reward/gold" in r}


def test_sweep_needs_a_gold_reward_and_an_evaluation():
    with pytest.raises(ValueError, match="needs 'eval'"):
        OverOptimizationConfig(rewards=[{"name": "length", "kwargs": {"target": 3}}])


def test_plot_marks_every_beta_and_the_start(tmp_path):
    results = {"start/gold": 0.5, "start/proxy": 0.0}
    for beta, kl, gold, proxy in ((0.3, 1.0, 0.6, 1.0), (0.1, 3.0, 0.65, 2.0), (0.0, 9.0, 0.3, 3.0)):
        results.update({f"beta={beta:g}/kl": kl, f"beta={beta:g}/gold": gold, f"beta={beta:g}/proxy": proxy})
    for n, kl, gold, proxy in ((1, 0.0, 0.5, 0.0), (4, 0.64, 0.55, 1.5)):
        results.update({f"bon/n={n}/kl": kl, f"bon/n={n}/gold": gold, f"bon/n={n}/proxy": proxy})
    path = plot_overoptimization(results, [0.3, 0.1, 0.0], [1, 4], tmp_path / "plot.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
