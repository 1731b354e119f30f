"""The synthetic InstructGPT pipeline's stages: gold-labelled data files, and the over-optimisation sweep
(one PPO run per beta, figures per beta, the plot) on the random tiny model."""

import json
import math

import pytest

from tether.config.rlhf import GoldDataConfig, OverOptimizationConfig
from tether.stages.pipeline import run_recipe
from tether.stages.rlhf import gold_data, plot_overoptimization


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


def test_the_figures_leave_the_user_s_matplotlib_backend_alone(tmp_path):
    """Drawn on a bare Figure with the Agg canvas: a notebook's or a GUI's backend is not switched."""
    import matplotlib

    from tether.best_of_n import plot_best_of_n

    before = matplotlib.get_backend()
    matplotlib.use("pdf")
    try:
        results = {"start/gold": 0.5, "start/proxy": 0.0, "beta=0/kl": 1.0, "beta=0/gold": 0.4, "beta=0/proxy": 2.0}
        plot_overoptimization(results, [0.0], [], tmp_path / "over.png")
        plot_best_of_n({"best_of_1/verifier": 0.3, "best_of_4/verifier": 0.5}, tmp_path / "bon.png")
        assert matplotlib.get_backend() == "pdf"
        assert (tmp_path / "over.png").read_bytes()[:4] == (tmp_path / "bon.png").read_bytes()[:4] == b"\x89PNG"
    finally:
        matplotlib.use(before)


def test_the_figure_over_seeds_draws_the_means_with_their_spread(tmp_path, monkeypatch):
    from tether.core.statistics import seed_summary as summary
    from tether.stages import rlhf
    from tether.stages.seeds import _plot_over_seeds

    figures = {"start/gold": summary([0.5, 0.7]), "start/proxy": summary([1.0, 1.0]), "peak_beta": summary([0.3, 0.3])}
    for key in ("beta=0.3", "beta=0", "bon/n=1", "bon/n=4"):
        figures.update({f"{key}/kl": summary([1.0, 3.0]), f"{key}/gold": summary([0.6, 0.8]),
                        f"{key}/proxy": summary([2.0, 2.0])})
    drawn = {}
    real = rlhf.plot_overoptimization
    monkeypatch.setattr(rlhf, "plot_overoptimization", lambda results, betas, ns, path, **kw: drawn.update(
        results=results, betas=betas, ns=ns, **kw) or real(results, betas, ns, path, **kw))
    recipe = {"stages": [{"name": "sft", "type": "sft"}, {"name": "over", "type": "overoptimization"}]}
    _plot_over_seeds(recipe, {"over": figures}, tmp_path)
    assert (tmp_path / "overoptimization.png").read_bytes()[:4] == b"\x89PNG"
    assert drawn["betas"] == [0.3, 0.0] and drawn["ns"] == [1, 4] and drawn["runs"] == 2
    assert drawn["results"]["beta=0.3/gold"] == pytest.approx(0.7) and drawn["results"]["start/gold"] == pytest.approx(0.6)
    assert drawn["spread"]["beta=0/kl"] == pytest.approx(2 ** 0.5) and drawn["spread"]["start/proxy"] == 0.0
    assert rlhf.plot_overoptimization_over_seeds({"bon/n=1/gold": summary([0.5, 0.6])}, tmp_path / "none") is None


@pytest.mark.slow
def test_instructgpt_recipe_raises_the_gold_reward(tmp_path):
    """The acceptance figure: after PPO against the learned RM the hidden gold reward is higher than after SFT."""
    from tether.stages.pipeline import load_recipe

    ppo = run_recipe(load_recipe("instructgpt"), tmp_path, report=False)["ppo"]
    assert ppo["gold"] > ppo["before/gold"] and ppo["gold_greedy"] > ppo["before/gold_greedy"], ppo
    assert ppo["proxy"] > ppo["before/proxy"] and ppo["accuracy"] > ppo["before/accuracy"], ppo


@pytest.mark.slow
def test_overoptimization_recipe_gold_peaks_before_the_largest_kl(tmp_path):
    """Gao et al.'s shape: the proxy keeps rising with KL while the gold reward peaks and falls."""
    from tether.stages.pipeline import load_recipe

    results = run_recipe(load_recipe("overoptimization"), tmp_path, report=False)["overoptimization"]
    betas = [0.3, 0.1, 0.03, 0.0]
    kl = {b: results[f"beta={b:g}/kl"] for b in betas}
    largest = max(kl, key=kl.get)
    assert results["peak_kl"] < kl[largest] and results[f"beta={largest:g}/gold"] < results["peak_gold"]
    assert results[f"beta={largest:g}/proxy"] > results["start/proxy"]
    bon_gold = [results[f"bon/n={n}/gold"] for n in (1, 2, 4, 8, 16, 32)]
    assert max(bon_gold) > bon_gold[0] and bon_gold[-1] < max(bon_gold)
    assert results["bon/n=32/proxy"] > results["bon/n=1/proxy"]
    assert (tmp_path / "overoptimization.png").exists()
