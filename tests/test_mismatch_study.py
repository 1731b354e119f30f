"""The mismatch-study recipe, shrunk: a bfloat16 sampler against the float32 trainer shows a mismatch the float32
sampler does not, each correction runs, and the compare stage writes the figure (over seeds too)."""

import json

import pytest

from tether import stages  # noqa: F401
from tether.report import comparison_png, plots, write_seeds_report
from tether.stages.pipeline import apply_recipe_overrides, load_recipe, run_recipe

GRPO = ["fp32-sampler", "bf16-sampler", "bf16-tis", "bf16-icepop"]


def shrunk():
    overrides = ["*.train.threads=1", "*.train.progress=false", "pretrain.train.max_steps=10",
                 "sft.train.max_steps=10", "sft.eval.n=8", "sft.eval.max_new_tokens=16"]
    for stage in GRPO:
        overrides += [f"{stage}.train.max_steps=4", f"{stage}.train.eval_every=2", f"{stage}.train.batch_size=4",
                      f"{stage}.rollout.group_size=4", f"{stage}.rollout.max_new_tokens=24", f"{stage}.eval.n=8",
                      f"{stage}.eval.max_new_tokens=16", f"{stage}.train.log_every=1"]
    return apply_recipe_overrides(load_recipe("mismatch-study"), overrides)


def test_bf16_sampler_mismatch_is_measured_and_plotted(tmp_path):
    results = run_recipe(shrunk(), tmp_path, report=False)
    compared = results["mismatch"]
    assert compared["fp32-sampler/mismatch/logprob_abs_diff_max"] <= 1e-5
    for stage in GRPO[1:]:
        assert compared[f"{stage}/mismatch/logprob_abs_diff_max"] > 1e-3, compared
    assert (tmp_path / "mismatch.png").stat().st_size > 1000
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    corrected = [r["mismatch/frac_tokens_corrected"] for r in rows if r.get("stage") == "bf16-tis"
                 and "mismatch/frac_tokens_corrected" in r]
    assert corrected and all(0.0 <= c <= 1.0 for c in corrected)
    spec = json.loads((tmp_path / "mismatch" / "stage.json").read_text())
    assert spec["type"] == "compare" and spec["file"] == "mismatch.png"


def test_comparison_over_seeds_averages_the_runs(tmp_path, monkeypatch):
    for seed, value in ((0, 1.0), (1, 3.0)):
        d = tmp_path / f"seed-{seed}"
        (d / "cmp").mkdir(parents=True)
        rows = [{"stage": s, "step": step, "m": value * (i + 1) + step} for i, s in enumerate(["a", "b"])
                for step in (1, 2)]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        (d / "cmp" / "stage.json").write_text(json.dumps({"stage": "cmp", "type": "compare", "stages": ["a", "b"],
                                                           "metrics": ["m"], "file": "cmp.png", "title": ""}))
    assert comparison_png([tmp_path / "seed-0"], ["a"], ["nope"], "t") is None
    (tmp_path / "seeds.json").write_text(json.dumps({"seeds": [0, 1]}))
    (tmp_path / "recipe.yaml").write_text("name: t\nstages: []\n")
    (tmp_path / "extra.png").write_bytes(b"\x89PNG-a-figure-the-run-drew-over-seeds")
    write_seeds_report(tmp_path)
    assert (tmp_path / "cmp.png").stat().st_size > 1000
    page = (tmp_path / "report.html").read_text()
    assert "cmp.png: mean +- std over seeds" in page
    # a figure the run drew over seeds (the over-optimisation one) is on the page; the comparison only once
    assert "Other plots" in page and "extra.png" in page and page.count("cmp.png") == 1
    drawn = {}
    real = plots.small_multiples
    monkeypatch.setattr(plots, "small_multiples", lambda title, panels, spreads=None: drawn.update(
        title=title, panels=panels, spreads=spreads) or real(title, panels, spreads))
    comparison_png([tmp_path / "seed-0", tmp_path / "seed-1"], ["a", "b"], ["m"], "t")
    # a: 1 + step and 3 + step; b: 2 + step and 6 + step
    assert drawn["title"] == "t (mean +- std of 2 runs)"
    assert drawn["panels"] == {"m": {"a": {1: 3.0, 2: 4.0}, "b": {1: 5.0, 2: 6.0}}}
    assert drawn["spreads"]["m"]["a"] == pytest.approx({1: 2 ** 0.5, 2: 2 ** 0.5})
    assert drawn["spreads"]["m"]["b"] == pytest.approx({1: 8 ** 0.5, 2: 8 ** 0.5})


def test_mean_and_std_over_runs_uses_the_runs_that_logged_each_step():
    mean, std = plots.mean_and_std_over_runs([{0: 1.0, 10: 2.0}, {0: 3.0, 10: 6.0, 20: 5.0}, {0: 8.0}])
    assert mean == pytest.approx({0: 4.0, 10: 4.0, 20: 5.0})
    # step 0: (1, 3, 8), sample std sqrt(((-3)^2 + (-1)^2 + 4^2) / 2); step 20 has one run: no std
    assert std == pytest.approx({0: 13 ** 0.5, 10: 8 ** 0.5})


def test_comparison_names_how_many_runs_each_line_averages(tmp_path, monkeypatch):
    """A stage only some seeds ran (a resumed run with fewer stages) is averaged over those seeds, and the
    title gives the range of runs behind the lines."""
    for seed in range(3):
        d = tmp_path / f"seed-{seed}"
        d.mkdir()
        rows = [{"stage": "a", "step": 1, "m": float(seed)}] + ([{"stage": "b", "step": 1, "m": 1.0}] if seed else [])
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    drawn = {}
    monkeypatch.setattr(plots, "small_multiples", lambda title, panels, spreads=None: drawn.update(
        title=title, panels=panels) or b"png")
    comparison_png([tmp_path / f"seed-{k}" for k in range(3)], ["a", "b"], ["m"], "t")
    assert drawn == {"title": "t (mean +- std of 2-3 runs)", "panels": {"m": {"a": {1: 1.0}, "b": {1: 1.0}}}}
