"""Best-of-n: selection, the disjoint-block curve worked by hand, the CLI and the plot."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from tether.best_of_n import (
    best_index,
    best_of_n_curve,
    curves,
    generate_best_of_n,
    plot_best_of_n,
    select_best,
)
from tether.cli import app


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
    from tether.models import save_tiny

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
