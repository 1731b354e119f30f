"""Smoke test of ``benchmarks/device_check.py`` (every recipe on an accelerator) with ``--device cpu``."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tether.stages.pipeline import apply_recipe_overrides, builtin_recipes, load_recipe, validate_recipe

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def device_check():
    spec = importlib.util.spec_from_file_location("tether_device_check", BENCH / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_recipe_shrinks_to_two_steps_or_one_round(device_check):
    for recipe in builtin_recipes():
        overrides = device_check.shrink_overrides(recipe)
        configs = validate_recipe(apply_recipe_overrides(load_recipe(recipe), overrides))
        trained = [c for c in configs if getattr(getattr(c, "train", None), "max_steps", None) is not None]
        # an online stage's steps come from its rounds: one round
        assert trained and all(c.train.max_steps <= 2 or getattr(c, "rounds", None) == 1 for c in trained), recipe


def test_every_variant_is_a_valid_override_of_its_recipe(device_check):
    for label, recipe, more in device_check.VARIANTS:
        overrides = [*device_check.shrink_overrides(recipe), *more]
        configs = validate_recipe(apply_recipe_overrides(load_recipe(recipe), overrides))
        assert configs, label


def test_a_recipe_runs_on_the_named_device(device_check, tmp_path):
    out = tmp_path / "check.json"
    code = device_check.main(["--device", "cpu", "--dtype", "float32", "--no-engine", "--recipes", "sft-arithmetic",
                              "--jobs", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0, report
    assert report["environment"]["device"] == "cpu"
    # the recipe and its variants (bf16-mixed SFT)
    assert sorted((c["check"], c["ok"]) for c in report["checks"]) == [
        ("recipe sft-arithmetic", True), ("recipe sft-arithmetic+bf16-mixed", True)]


def test_frozen_passes_give_the_training_forward_s_logits_on_the_cpu(device_check):
    rows = device_check.frozen_pass_checks("cpu")
    assert [r["check"] for r in rows] == ["frozen pass == training forward (tiny, bf16-mixed)",
                                          "frozen pass == training forward (small, bf16-mixed)"]
    assert all(r["ok"] for r in rows), rows


def test_a_crash_is_a_failure_and_a_data_guard_is_not(device_check, tmp_path, monkeypatch):
    class Done:
        def __init__(self, rc, text):
            self.returncode, self.stdout, self.stderr = rc, text, ""

    monkeypatch.setattr(device_check.subprocess, "run", lambda *a, **k: Done(1, "Traceback\nRuntimeError: cuda:0 and cpu!"))
    row = device_check.run_recipe("sft-arithmetic", "cpu", "float32", tmp_path, 10)
    assert not row["ok"] and "cuda:0 and cpu" in row["detail"]
    monkeypatch.setattr(device_check.subprocess, "run", lambda *a, **k: Done(2, "error: x/corpus.jsonl: no records"))
    row = device_check.run_recipe("sft-arithmetic", "cpu", "float32", tmp_path, 10)
    assert row["ok"] and "data guard" in row["detail"]
