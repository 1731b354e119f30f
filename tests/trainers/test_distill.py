"""Distillation stages on the tiny model: generate -> filter -> student SFT, and STaR / ReST / RAFT rounds."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from tether.config.distill import SelfDistillConfig
from tether.data import IGNORE_INDEX, tokenize_sft
from tether.generation import generate_corpus, read_corpus
from tether.models.tiny import build_tokenizer
from tether.rollout import SamplingParams
from tether.stages.pipeline import load_recipe, run_recipe
from tether.tasks import get_task, rl_records
from tether.tasks.arithmetic import addition_trace
from tether.trainers.metrics import read_metrics

TASK = get_task("arithmetic", digits=2, operators="+")


pytestmark = pytest.mark.usefixtures("one_thread")


def teacher_script(prompt: str, sample: int) -> str:
    """Samples 0 and 2: the correct trace (the same text twice); 1 and 3: answers off by 1 and by 2."""
    a, b = (int(x) for x in prompt.rstrip("=").split("+"))
    answer = a + b + {0: 0, 1: 1, 2: 0, 3: 2}[sample]
    return f"<think>{addition_trace(a, b)}</think>{answer}"


def test_filtered_corpus_trains_a_shallower_student_on_whole_traces(tmp_path, scripted_engine):
    tokenizer = build_tokenizer()
    prompts = rl_records(TASK, 16, seed=0)
    corpus = tmp_path / "teacher.jsonl"
    generate_corpus(scripted_engine(tokenizer, teacher_script), tokenizer, prompts, corpus, SamplingParams(n=4),
                    progress=False)
    recipe = {"stages": [
        {"name": "filter", "type": "filter", "input": str(corpus),
         "filter": {"verifier": {"rewards": [{"name": "accuracy"}]}, "format": "r1"}},
        {"name": "student", "type": "sft", "model": {"name_or_path": "tether/tiny",
                                                       "config_overrides": {"num_hidden_layers": 2}},
         "data": {"path": "@filter/corpus.jsonl"}, "train": {"max_steps": 12, "batch_size": 8, "log_every": 1,
                                                              "progress": False},
         "optim": {"lr": 3e-3}, "report_to": []},
    ]}
    results = run_recipe(recipe, tmp_path / "run", report=False)
    # 64 samples: per prompt one duplicate correct trace and two wrong answers
    assert results["filter"] == {"records": 64, "kept": 16, "kept_fraction": 0.25, "prompts": 16,
                                 "prompts_kept": 16, "dropped/duplicate": 16, "dropped/verifier": 32}
    kept = read_corpus(tmp_path / "run" / "filter" / "corpus.jsonl")
    assert all(TASK.verify(r["completion"], r["answer"]) == 1.0 for r in kept)
    example = tokenize_sft(kept[0], tokenizer, max_length=512)
    prompt_len = 1 + len(kept[0]["prompt"])  # bos + one token per character
    assert all(label == IGNORE_INDEX for label in example.labels[:prompt_len])
    assert example.labels[prompt_len:] == example.input_ids[prompt_len:]  # <think> ... answer, EOS: all in the loss
    assert example.input_ids[prompt_len] == tokenizer.convert_tokens_to_ids("<think>")
    losses = [r["loss"] for r in read_metrics(tmp_path / "run", "student") if "loss" in r]
    assert losses[-1] < 0.6 * losses[0]
    config = json.loads((tmp_path / "run" / "student" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2


def test_generate_filter_sft_recipe_wires_by_stage_reference(tmp_path):
    quick = {"train": {"progress": False, "threads": 1}, "report_to": []}
    recipe = {"defaults": quick, "stages": [
        {"name": "gen", "type": "generate", "model": {"name_or_path": "tether/tiny"}, "output": "parquet",
         "prompts": {"task": {"name": "arithmetic", "n": 4}}, "sampling": {"n": 2, "max_new_tokens": 6},
         "verifier": {"rewards": [{"name": "accuracy"}]}},
        {"name": "keep", "type": "filter", "input": "@gen/corpus.parquet", "filter": {"drop_truncated": False}},
        {"name": "sft", "type": "sft", "model": {"name_or_path": "tether/tiny"}, "data": {"path": "@keep/corpus.jsonl"},
         "train": {"max_steps": 2, "batch_size": 2}},
    ]}
    results = run_recipe(recipe, tmp_path / "run", report=False)
    assert results["gen"]["records"] == 8 and results["gen"]["prompts"] == 4
    assert results["gen"]["sample_accuracy"] == 0.0  # an untrained model
    assert results["keep"]["records"] == 8 and (tmp_path / "run" / "sft" / "stage.json").exists()
    assert len(read_corpus(tmp_path / "run" / "gen" / "corpus.parquet")) == 8


def test_star_rounds_keep_exactly_the_verified_samples_and_restart_from_the_base(tmp_path):
    verifier = {"rewards": [{"name": "regex", "kwargs": {"pattern": r"\d"}}]}  # "has a digit": some of a random model's samples
    cfg = {"name": "star", "type": "self_distill", "algorithm": "star", "iterations": 2,
           "model": {"name_or_path": "tether/tiny"},
           "prompts": {"task": {"name": "arithmetic", "n": 8}}, "sampling": {"n": 2, "max_new_tokens": 12},
           "filter": {"verifier": verifier, "drop_truncated": False},
           "train": {"max_steps": 5, "batch_size": 4, "progress": False, "threads": 1}, "report_to": [],
           "eval": {"task": "arithmetic", "n": 4, "max_new_tokens": 8, "before": True}}
    assert SelfDistillConfig.model_validate(cfg).restart == "base"
    results = run_recipe({"stages": [cfg]}, tmp_path / "run", report=False)["star"]
    stage = tmp_path / "run" / "star"
    for round_ in (1, 2):
        samples = read_corpus(stage / f"iter-{round_}" / "samples.jsonl")
        unique = {(r["prompt_id"], " ".join(r["completion"].split())) for r in samples
                  if r["completion"].strip() and re.search(r"\d", r["completion"])}
        assert results[f"iter{round_}/filter/kept"] == len(unique) > 0
        assert results[f"iter{round_}/filter/records"] == 16
        assert results[f"iter{round_}/sample/accuracy"] == sum(bool(re.search(r"\d", r["completion"]))
                                                               for r in samples) / 16
        assert f"iter{round_}/accuracy" in results
    assert json.loads((stage / "iter-1" / "stage.json").read_text())["step"] == 5
    assert json.loads((stage / "iter-2" / "stage.json").read_text())["step"] == 6  # STaR: 20% more steps
    meta = json.loads((stage / "iter-2" / "samples.meta.json").read_text())
    assert meta["model"] == str(stage / "iter-1")  # round 2 samples from round 1's model
    assert (stage / "model.safetensors").exists() and results["accuracy"] == results["iter2/accuracy"]
    rows = read_metrics(tmp_path / "run", "star")
    assert [r["step"] for r in rows] == [1, 2] and all("accuracy" in r for r in rows)
    # eval.before: the starting model evaluated once, in round 1; every round's gain is paired against it
    before = json.loads((stage / "iter-1" / "eval_before.json").read_text())
    assert json.loads((stage / "iter-2" / "eval_before.json").read_text()) == before
    assert "iter2/before/accuracy" not in results and results["before/accuracy"] == results["iter1/before/accuracy"]
    assert results["before/accuracy"] == pytest.approx(sum(v > 0 for v in before["accuracy"]) / 4)
    for prefix in ("iter1/", "iter2/", ""):
        assert results[f"{prefix}gain/accuracy"] == pytest.approx(
            results[f"{prefix}accuracy"] - results["before/accuracy"])
        assert results[f"{prefix}gain/accuracy_ci95_low"] <= results[f"{prefix}gain/accuracy"] <= \
            results[f"{prefix}gain/accuracy_ci95_high"]


# ---- the recipes, end to end (minutes each; python -m pytest -m slow) --------------------------------
@pytest.mark.slow
def test_r1_distill_filtered_student_beats_unfiltered(tmp_path):
    results = run_recipe(load_recipe("r1-distill"), tmp_path / "run", report=False)
    assert results["student_filtered"]["accuracy"] > results["student_unfiltered"]["accuracy"]
    assert results["filtered"]["dropped/verifier"] > 0


@pytest.mark.slow
def test_rest_arithmetic_improves_over_its_sft_model(tmp_path):
    results = run_recipe(load_recipe("rest-arithmetic"), tmp_path / "run", report=False)
    assert results["rest"]["iter2/accuracy"] > results["sft"]["accuracy"]
    assert results["rest"]["before/accuracy"] == results["sft"]["accuracy"]  # eval.before: the SFT model, same problems
    assert results["rest"]["gain/accuracy_ci95_low"] > 0


@pytest.mark.slow
def test_best_of_n_accuracy_rises_with_n_under_the_verifier(tmp_path):
    results = run_recipe(load_recipe("best-of-n"), tmp_path / "run", report=False)["best_of_n"]
    verifier = [results[f"best_of_{n}/verifier"] for n in (1, 2, 4, 8, 16)]
    assert all(a < b for a, b in itertools.pairwise(verifier))
    # the learned reward model helps at small n, then is over-optimised (README: "best-of-n")
    assert max(results[f"best_of_{n}/reward_model"] for n in (2, 4)) > results["best_of_1/reward_model"]
    assert (tmp_path / "run" / "best_of_n" / "best_of_n.png").exists()
    # PRM beam search ran at every n on matched compute: n candidates a round, about n answers' tokens
    for n in (1, 2, 4, 8, 16):
        assert 0.0 <= results[f"search_{n}/prm_beam"] <= 1.0 and 0.0 <= results[f"best_of_{n}/prm"] <= 1.0
        assert 0.5 < results[f"tokens/search_{n}/prm_beam"] / results[f"tokens/best_of_{n}"] < 2.0
    assert "prm_beam" in (tmp_path / "run" / "best_of_n" / "best_of_n.md").read_text()
