"""Best-of-n: selection, the disjoint-block curve worked by hand, the CLI and the plot."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from tether.best_of_n import (
    best_index,
    best_of_n_curve,
    block_tokens,
    comparison_table,
    curves,
    generate_best_of_n,
    plot_best_of_n,
    run_best_of_n,
    search_answers,
    select_best,
    token_curves,
)
from tether.cli import app
from tether.config.common import EvalConfig, ModelConfig
from tether.config.distill import BestOfNConfig
from tether.models import save_tiny
from tether.models.loading import resolve_model
from tether.models.reward_model import build_tiny_reward_model, set_reward_info
from tether.rewards.scorer import RewardModelScorer


def test_best_index_prefers_high_scores_then_earlier_samples_and_ranks_none_last():
    assert best_index([0.1, 0.7, 0.7, 0.2]) == 1
    assert best_index([None, -5.0]) == 1
    assert best_index([None, None]) == 0


def test_select_best_picks_one_per_prompt_by_score():
    records = [{"prompt_id": p, "sample": s, "prompt": f"p{p}", "completion": f"{p}.{s}"}
               for p in range(2) for s in range(3)]
    best = select_best(records, [0.2, 0.9, 0.1, None, -1.0, -1.0])
    assert [(b["completion"], b["score"], b["best_of"]) for b in best] == [("0.1", 0.9, 3), ("1.1", -1.0, 3)]


def test_curve_worked_by_hand():
    """Two prompts, four samples each.

    prompt 0: correct = 0 1 0 1, scores = .9 .1 .2 .8
      n=1: blocks [0] [1] [2] [3]          -> picks 0 1 2 3 -> correct 0 1 0 1 -> 2/4
      n=2: blocks [0 1] [2 3]              -> picks 0 (.9), 3 (.8) -> 0, 1   -> 1/2
      n=4: block [0 1 2 3]                 -> pick 0 (.9)         -> 0       -> 0/1
    prompt 1: correct = 1 0 0 0, scores = .5 .5 .9 .1
      n=1: 1/4; n=2: picks 0 (tie, earlier), 2 -> 1, 0 -> 1/2; n=4: pick 2 -> 0/1
    Means over prompts and blocks: n=1 (2+1)/8, n=2 (1+1)/4, n=4 0/2.
    """
    correct = [[0, 1, 0, 1], [1, 0, 0, 0]]
    scores = [[0.9, 0.1, 0.2, 0.8], [0.5, 0.5, 0.9, 0.1]]
    assert best_of_n_curve(correct, scores, [1, 2, 4]) == {1: 3 / 8, 2: 2 / 4, 4: 0.0}
    # the checker as scorer: best-of-n is pass@n over the blocks
    assert best_of_n_curve(correct, correct, [1, 2, 4]) == {1: 3 / 8, 2: 3 / 4, 4: 1.0}
    with pytest.raises(ValueError, match="n <= 4"):
        best_of_n_curve(correct, scores, [8])


def test_plot_and_curves(tmp_path):
    results = {"best_of_1/verifier": 0.4, "best_of_2/verifier": 0.6, "best_of_1/rm": 0.4, "best_of_2/rm": 0.5,
               "mean@2": 0.4}
    assert curves(results) == {"verifier": {1: 0.4, 2: 0.6}, "rm": {1: 0.4, 2: 0.5}}
    path = plot_best_of_n(results, tmp_path / "bon.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_generate_best_of_n_with_a_scorer_function(tmp_path):
    torch.manual_seed(0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1="}\n{"prompt": "2+2="}\n')
    stats = generate_best_of_n("tether/tiny", prompts, tmp_path / "best.jsonl", 4,
                               lambda records: [float(len(r["completion"])) for r in records],
                               max_new_tokens=6, seed=0, progress=False)
    best = [json.loads(line) for line in (tmp_path / "best.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (tmp_path / "best.samples.jsonl").read_text().splitlines()]
    assert stats["selected"] == 2 and len(samples) == 8
    for b in best:
        candidates = [s for s in samples if s["prompt_id"] == b["prompt_id"]]
        assert b["score"] == max(len(s["completion"]) for s in candidates) and b["best_of"] == 4


def test_eval_best_of_command(tmp_path):
    model = save_tiny(tmp_path / "tiny")
    result = CliRunner().invoke(app, ["eval", "--model", str(model), "--n", "3", "--max-new-tokens", "4",
                                      "--best-of", "1,2", "--out", str(tmp_path / "e.json"),
                                      "--plot", str(tmp_path / "e.png")])
    assert result.exit_code == 0, result.output
    figures = json.loads((tmp_path / "e.json").read_text())
    assert {"best_of_1/verifier", "best_of_2/verifier", "mean@2"} <= set(figures)
    assert (tmp_path / "e.png").exists()
    result = CliRunner().invoke(app, ["eval", "--model", str(model), "--best-of", "1,2", "--scorer", "rm"])
    assert result.exit_code == 2 and "--reward-model" in result.output


def test_block_tokens_are_the_mean_block_sums():
    # prompt 0: 3 5 1 7 -> n=1 blocks 3 5 1 7, n=2 blocks 8 8, n=4 block 16; prompt 1: 2 2 2 2 -> 2s, 4 4, 8
    assert block_tokens([[3, 5, 1, 7], [2, 2, 2, 2]], [1, 2, 4]) == {1: 24 / 8, 2: 24 / 4, 4: 24 / 2}


def test_search_curves_table_and_plot(tmp_path):
    results = {"best_of_1/rm": 0.4, "best_of_4/rm": 0.5, "tokens/best_of_1": 40.0, "tokens/best_of_4": 160.0,
               "search_1/beam": 0.4, "search_4/beam": 0.7, "tokens/search_1/beam": 41.0, "tokens/search_4/beam": 150.0,
               "finished/search_4/beam": 1.0, "mean@4": 0.4}
    assert curves(results) == {"rm": {1: 0.4, 4: 0.5}, "beam": {1: 0.4, 4: 0.7}}
    assert token_curves(results) == {"rm": {1: 40.0, 4: 160.0}, "beam": {1: 41.0, 4: 150.0}}
    assert comparison_table(results).splitlines() == [
        "| n | rm | beam |", "|---|---|---|",
        "| 1 | 40.0% (40 tok) | 40.0% (41 tok) |", "| 4 | 50.0% (160 tok) | 70.0% (150 tok) |"]
    assert plot_best_of_n(results, tmp_path / "bon.png").read_bytes()[:4] == b"\x89PNG"


def test_search_config_checks_the_matched_compute_shapes():
    cfg = BestOfNConfig(ns=[1, 2, 4, 16], search={"beam": {"prm": "p", "expansions": 4}})
    assert [cfg.search["beam"].shape(n) for n in cfg.ns] == [(1, 1), (1, 2), (1, 4), (4, 4)]
    with pytest.raises(ValueError, match="not a multiple of search expansions = 4"):
        BestOfNConfig(ns=[6], search={"beam": {"prm": "p"}})
    with pytest.raises(ValueError, match="also a scorer label"):
        BestOfNConfig(search={"verifier": {"prm": "p"}})
    with pytest.raises(ValueError, match="median"):
        BestOfNConfig(search={"beam": {"prm": "p", "aggregation": "median"}})


@pytest.fixture(scope="module")
def tiny_prm(tmp_path_factory):
    model, tokenizer = build_tiny_reward_model(seed=1)
    set_reward_info(model, process=True, step_separator="|", aggregation="min")
    path = tmp_path_factory.mktemp("prm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_prm_beam_search_end_to_end_on_the_tiny_model(tmp_path, tiny_prm):
    policy = save_tiny(tmp_path / "tiny")
    cfg = EvalConfig(n=3, max_new_tokens=10, batch_size=2, prompt_template="{prompt}<think>")
    prompts = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in (12, 34, 56)]
    model, tokenizer = resolve_model(str(policy), None, ModelConfig())
    prm = RewardModelScorer(tiny_prm)
    found = search_answers(model, tokenizer, prompts, cfg, prm, beam_width=2, expansions=2, max_steps=3)
    assert len(found) == 3
    for result in found:
        assert isinstance(result.text, str) and 1 <= result.steps <= 3
        assert len(result.ids) <= cfg.max_new_tokens and result.tokens >= len(result.ids)
        assert result.candidates <= 4 + 2 * 2 * 2
    progress = []
    again = search_answers(model, tokenizer, prompts, cfg, prm, beam_width=2, expansions=2, max_steps=3,
                           on_progress=progress.append)
    assert [(r.text, r.tokens) for r in again] == [(r.text, r.tokens) for r in found]  # seeded
    assert progress == [2, 3]  # problems searched after each batch of cfg.batch_size
    with pytest.raises(ValueError, match="process reward model"):
        search_answers(model, tokenizer, prompts, cfg, RewardModelScorer(tiny_prm, process=False), beam_width=1,
                       expansions=1)

    results = run_best_of_n(str(policy), cfg, [1, 2], {"verifier": {}, "prm": {"kind": "reward_model",
                                                                              "path": str(tiny_prm)}},
                            searches={"beam": {"prm": str(tiny_prm), "expansions": 2, "max_steps": 3}},
                            plot=tmp_path / "bon.png", table=tmp_path / "bon.md", progress=False)
    for n in (1, 2):
        assert {f"best_of_{n}/verifier", f"best_of_{n}/prm", f"search_{n}/beam", f"tokens/search_{n}/beam",
                f"tokens/best_of_{n}", f"finished/search_{n}/beam"} <= set(results)
        assert results[f"tokens/search_{n}/beam"] > 0 and 0 < results[f"tokens/best_of_{n}"] <= n * 10
    assert "beam" in (tmp_path / "bon.md").read_text() and (tmp_path / "bon.png").exists()
