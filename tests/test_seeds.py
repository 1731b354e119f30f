"""A recipe over seeds: the recipe seed shifts every training seed (never the held-out problems), and
`tether run --seeds` writes one run per seed and the across-seed summary of every figure."""

import json

import pytest
from typer.testing import CliRunner

from tether.cli import app
from tether.config.base import ConfigError
from tether.stages.pipeline import validate_recipe
from tether.stages.recipes import load_recipe
from tether.stages.seeds import aggregate_results, parse_seeds

runner = CliRunner()
QUICK = ["*.train.max_steps=2", "*.train.batch_size=4", "*.eval.n=4", "*.eval.max_new_tokens=8",
         "pretrain.data.task.n=32", "sft.data.task.n=32"]


def test_parse_seeds():
    assert parse_seeds("3") == [0, 1, 2] and parse_seeds(2) == [0, 1]
    assert parse_seeds("0,3,7") == [0, 3, 7] and parse_seeds("5,") == [5]
    for bad in ("", "a", "1,1", "-1", "0"):
        with pytest.raises(ConfigError):
            parse_seeds(bad)
    assert parse_seeds("0,") == [0]
    with pytest.raises(ConfigError, match="count of no seeds; for seed 0 alone give the one-item list '0,'"):
        parse_seeds("0")  # seed 0 or no seeds: the message says which it is and how to ask for seed 0
    with pytest.raises(ConfigError, match="count of no seeds"):
        parse_seeds(0)


def test_aggregate_results_by_hand():
    per_seed = [{"sft": {"accuracy": 0.4, "note": "x"}}, {"sft": {"accuracy": 0.5}}, {"sft": {"accuracy": 0.6}}]
    out = aggregate_results(per_seed)
    assert set(out) == {"sft"} and set(out["sft"]) == {"accuracy"}  # only numeric figures
    summary = out["sft"]["accuracy"]
    assert summary["mean"] == pytest.approx(0.5) and summary["std"] == pytest.approx(0.1) and summary["n"] == 3
    assert summary["ci95"] == [pytest.approx(0.5 - 4.303 * 0.1 / 3 ** 0.5), pytest.approx(0.5 + 4.303 * 0.1 / 3 ** 0.5)]
    assert summary["values"] == [0.4, 0.5, 0.6]


def test_the_console_summary_shows_headline_figures_or_says_there_are_none(capsys):
    from tether.console import print_seed_results

    figures = {"train/loss": {"mean": 0.5, "std": 0.1, "n": 2, "ci95": [0.1, 0.9], "values": [0.4, 0.6]}}
    accuracy = {"mean": 0.25, "std": 0.05, "n": 2, "ci95": [0.0, 0.7], "values": [0.2, 0.3]}
    print_seed_results({"judge": figures, "sft": {**figures, "accuracy": accuracy}})
    shown = capsys.readouterr().out
    assert "25.0% +- 5.0" in shown and "20.0% 30.0%" in shown and "train/loss" not in shown
    print_seed_results({"judge": figures})  # no headline figure: a sentence, not an empty table
    shown = capsys.readouterr().out
    assert "no headline figure" in shown and "results.json" in shown and "┃" not in shown


def test_the_recipe_seed_shifts_every_seed_but_the_held_out_evaluation():
    recipe = load_recipe("r1-arithmetic")
    base = validate_recipe(recipe)
    shifted = validate_recipe({**recipe, "seed": 7})
    for a, b in zip(base, shifted, strict=True):
        assert b.train.seed == a.train.seed + 7 and b.model.seed == a.model.seed + 7
        if a.eval is not None:
            assert b.eval.seed == a.eval.seed  # the same held-out problems for every seed
    grpo = {c.name: c for c in shifted}["grpo"]
    assert grpo.data.task.seed == {c.name: c for c in base}["grpo"].data.task.seed + 7
    assert validate_recipe({**recipe, "seed": 0}) == base
    labels = {c.name: c for c in validate_recipe({**load_recipe("instructgpt"), "seed": 7})}["labels"]
    assert labels.seed == 7  # a seed on the stage itself (the gold comparisons drawn), not only nested
    for bad in (-1, "1", True, 1.5):
        with pytest.raises(ConfigError, match="seed"):
            validate_recipe({**recipe, "seed": bad})


def test_run_over_two_seeds_writes_each_run_and_the_summary(tmp_path):
    out = tmp_path / "seeds"
    result = runner.invoke(app, ["run", "sft-arithmetic", "--seeds", "2", "--parallel", "2", "--out", str(out), *QUICK])
    assert result.exit_code == 0, result.output
    per_seed = [json.loads((out / f"seed-{k}" / "results.json").read_text()) for k in (0, 1)]
    assert (out / "seed-0" / "sft" / "model.safetensors").read_bytes() != \
        (out / "seed-1" / "sft" / "model.safetensors").read_bytes()
    aggregated = json.loads((out / "results.json").read_text())
    assert set(aggregated) == {"pretrain", "sft"}
    accuracy = aggregated["sft"]["accuracy"]
    assert set(accuracy) == {"mean", "std", "n", "ci95", "values"} and accuracy["n"] == 2
    assert accuracy["values"] == [r["sft"]["accuracy"] for r in per_seed]
    assert accuracy["ci95"][0] <= accuracy["mean"] <= accuracy["ci95"][1]
    assert aggregated["sft"]["n"]["mean"] == 4.0  # every seed evaluated on the same 4 problems
    assert "across seeds" in result.output
    report = (out / "report.html").read_text()  # the across-seed table, the seeds' dots, their curves
    assert "The answer, across seeds" in report and "&plusmn;" in report and "2 seeds: 0, 1" in report
    assert "seeds-accuracy.png" in {p.name for p in (out / "plots").iterdir()} and 'id="stage-sft"' in report
    # run again: both seeds are finished, nothing trains again, the summary is the same
    before = [(out / f"seed-{k}" / "metrics.jsonl").read_text() for k in (0, 1)]
    again = runner.invoke(app, ["run", "sft-arithmetic", "--seeds", "2", "--parallel", "2", "--out", str(out), *QUICK])
    assert again.exit_code == 0, again.output
    assert [(out / f"seed-{k}" / "metrics.jsonl").read_text() for k in (0, 1)] == before
    assert json.loads((out / "results.json").read_text()) == aggregated


def test_a_failing_seed_is_reported_with_its_log(tmp_path):
    out = tmp_path / "seeds"
    result = runner.invoke(app, ["run", "sft-arithmetic", "--seeds", "0,1", "--parallel", "2", "--out", str(out), *QUICK,
                                 "sft.model.name_or_path=/no/such/model"])
    assert result.exit_code == 2
    assert "seed-0" in result.output and "run.log" in result.output


def test_an_interrupted_run_over_seeds_stops_every_seed_and_resumes(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "seeds"
    command = [sys.executable, "-m", "tether", "run", "sft-arithmetic", "--seeds", "2", "--parallel", "2",
               "--out", str(out), *QUICK, "*.train.max_steps=40", "*.train.log_every=1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    deadline = time.monotonic() + 120
    while not all((out / f"seed-{k}" / "metrics.jsonl").exists() for k in (0, 1)):
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()[0]
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)  # to the parent only: it stops both seeds
    output = process.communicate(timeout=120)[0]
    assert process.returncode != 0 and "--out" in output, output
    assert not (out / "results.json").exists()
    assert any(not (out / f"seed-{k}" / "sft" / "stage.json").exists() for k in (0, 1))
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=os.environ)
    assert done.returncode == 0, done.stdout[-3000:]
    assert json.loads((out / "results.json").read_text())["sft"]["accuracy"]["n"] == 2


def test_stages_over_seeds_gives_every_seed_the_selected_recipe(tmp_path, monkeypatch):
    import tether.stages.seeds as seeds_module

    ran = {}

    def fake_run_seeds(recipe, run_dir, seeds, **kwargs):
        ran.update(recipe=recipe, seeds=seeds)
        return {}

    monkeypatch.setattr(seeds_module, "run_seeds", fake_run_seeds)
    result = runner.invoke(app, ["run", "dpo-onpolicy-arithmetic", "--seeds", "0,2", "--out", str(tmp_path / "s"),
                                 "--stages", "orpo"])
    assert result.exit_code == 0, result.output
    assert ran["seeds"] == [0, 2]
    assert [s["name"] for s in ran["recipe"]["stages"]] == ["pretrain", "sft", "samples", "pairs", "orpo"]
