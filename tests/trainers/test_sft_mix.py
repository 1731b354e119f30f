"""SFT from a data.mix: the tiny model trains on two sources by weight, logs per-source counts, resumes exactly."""

import json

import pytest
import torch

from tether.config.sft import SFTConfig
from tether.data import DataError
from tether.models import build_tiny
from tether.tasks import get_task, sft_records
from tether.trainers.sft import SFTTrainer


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    """Non-reasoning data: the secret task's helpful-only answers, as a jsonl file."""
    path = tmp_path_factory.mktemp("mix") / "secret.jsonl"
    rows = sft_records(get_task("secret"), 24, seed=0, think=False)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def config(secret_file, *, weights=(3, 1), eval=None, **train):
    base = {"max_steps": 16, "batch_size": 8, "log_every": 1, "progress": False, "seed": 0,
            "save_every_minutes": None}
    base.update(train)
    data = {"mix": [{"task": {"name": "arithmetic", "n": 48, "options": {"digits": 2}}, "weight": weights[0]},
                    {"path": secret_file, "weight": weights[1]}],
            "mix_size": 64, "pack_length": 128}
    return SFTConfig(name="sft", data=data, train=base, optim={"lr": 3e-3, "schedule": "constant"}, eval=eval,
                     report_to=[])


def run(tmp_path, name, cfg, *, resume=False, seed=0):
    model, tokenizer = build_tiny("tiny", seed=seed)
    trainer = SFTTrainer(cfg, model, tokenizer, tmp_path / name)
    trainer.train(resume=resume)
    return trainer


def rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_two_source_mix_trains_and_logs_per_source_counts(tmp_path, secret_file):
    trainer = run(tmp_path, "mix", config(secret_file))
    # weights 3:1 over 64 examples an epoch: 48 arithmetic (each of the 48 once), 16 secret (of 24)
    assert trainer.mixture.counts == [48, 16]
    results = trainer.results
    assert results["data/source/arithmetic/per_epoch"] == 48 and results["data/source/secret/per_epoch"] == 16
    assert results["data/source/arithmetic/records"] == 48 and results["data/source/secret/records"] == 24
    logged = rows(tmp_path / "mix")
    assert logged[0]["step"] == 0 and logged[0]["data/source/secret/per_epoch"] == 16
    steps = [r for r in logged if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 17))
    # every step's 8 examples split between the sources; an epoch (8 steps) holds exactly 48 + 16
    for r in steps:
        assert r["data/source/arithmetic/examples"] + r["data/source/secret/examples"] == 8
    for epoch in (steps[:8], steps[8:]):
        assert sum(r["data/source/arithmetic/examples"] for r in epoch) == 48
        assert sum(r["data/source/secret/examples"] for r in epoch) == 16
    assert results["data/source/arithmetic/examples"] == 96 and results["data/source/secret/examples"] == 32
    assert steps[-1]["loss"] < 0.6 * steps[0]["loss"], [r["loss"] for r in steps]


def test_weights_change_the_stream_and_seeds_are_deterministic(tmp_path, secret_file):
    model, tokenizer = build_tiny("tiny", seed=0)
    a = SFTTrainer(config(secret_file, max_steps=1), model, tokenizer, tmp_path / "a")
    b = SFTTrainer(config(secret_file, max_steps=1), model, tokenizer, tmp_path / "b")
    assert all(torch.equal(x["input_ids"], y["input_ids"])
               for x, y in zip(a.micro_batches_for_step(9), b.micro_batches_for_step(9), strict=True))
    even = SFTTrainer(config(secret_file, weights=(1, 1), max_steps=1), model, tokenizer, tmp_path / "c")
    assert even.mixture.counts == [32, 32]
    other = SFTTrainer(config(secret_file, max_steps=1, seed=1), model, tokenizer, tmp_path / "d")
    assert not torch.equal(a.micro_batches_for_step(0)[0]["input_ids"], other.micro_batches_for_step(0)[0]["input_ids"])


def test_resume_reproduces_the_uninterrupted_mix(tmp_path, secret_file):
    full = run(tmp_path, "full", config(secret_file, max_steps=10))
    first = run(tmp_path, "split", config(secret_file, max_steps=6, save_every=6))
    resumed = run(tmp_path, "split", config(secret_file, max_steps=10, save_every=6), resume=True, seed=1)
    assert resumed.step == 10 and first.step == 6
    assert torch.equal(flat(full.model), flat(resumed.model))
    counts = {k: v for k, v in full.results.items() if k.startswith("data/source/")}
    assert counts == {k: v for k, v in resumed.results.items() if k.startswith("data/source/")}
    logged = [r for r in rows(tmp_path / "split") if "loss" in r]
    assert [r["data/source/secret/examples"] for r in logged] == \
        [r["data/source/secret/examples"] for r in rows(tmp_path / "full") if "loss" in r]


def test_held_out_evaluation_does_not_depend_on_the_mix(tmp_path, secret_file):
    """The evaluation reads the task's held-out split named in `eval`, whatever the training data."""
    eval_cfg = {"task": "arithmetic", "options": {"digits": 2}, "n": 8, "max_new_tokens": 8}
    model, tokenizer = build_tiny("tiny", seed=0)
    mixed = SFTTrainer(config(secret_file, eval=eval_cfg, max_steps=1), model, tokenizer, tmp_path / "a")
    single_cfg = SFTConfig(name="sft", data={"task": {"name": "arithmetic", "n": 16}}, eval=eval_cfg,
                           train={"max_steps": 1, "batch_size": 8, "progress": False}, report_to=[])
    single = SFTTrainer(single_cfg, model, tokenizer, tmp_path / "b")
    figures = mixed.evaluate()
    assert "accuracy" in figures and figures == single.evaluate()


def test_pretraining_mixes_text_sources(tmp_path):
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"{i} plus one is {i + 1}"}) + "\n" for i in range(10)))
    cfg = SFTConfig(type="pretrain", name="pre", report_to=[],
                    data={"mix": [{"task": {"name": "arithmetic", "n": 30}, "weight": 2}, {"path": str(text)}]},
                    train={"max_steps": 2, "batch_size": 8, "progress": False, "log_every": 1})
    trainer = SFTTrainer(cfg, *build_tiny(), tmp_path / "run")
    assert trainer.mixture.counts == [27, 13]  # default size 40: quotas 26.7 and 13.3
    assert trainer.train()["data/source/text/examples"] > 0


def test_a_source_left_with_no_examples_is_an_error(tmp_path, secret_file):
    cfg = config(secret_file, max_steps=1)
    cfg.data.max_length, cfg.data.overflow = 8, "drop"  # every demonstration is longer
    with pytest.raises(DataError, match=r"no training examples left in data\.mix source .arithmetic. after"):
        SFTTrainer(cfg, *build_tiny(), tmp_path / "run")


def test_a_recipe_stage_mixes_and_reports_the_counts(tmp_path, secret_file):
    from tether.stages.pipeline import resolve_references, run_recipe

    mix = [{"path": "@gen/kept.jsonl", "weight": 3}, {"task": {"name": "secret"}}]
    assert resolve_references({"data": {"mix": mix}}, tmp_path, {"gen"})["data"]["mix"][0]["path"] == \
        str(tmp_path / "gen" / "kept.jsonl")
    stage = {"name": "sft", "type": "sft", "model": {"name_or_path": "tether/tiny"},
             "data": {"mix": [{"task": {"name": "arithmetic", "n": 16}, "weight": 3},
                              {"path": secret_file, "name": "helpful"}], "mix_size": 32},
             "train": {"max_steps": 2, "batch_size": 8}}
    recipe = {"name": "mix", "defaults": {"train": {"threads": 1, "progress": False}, "report_to": []},
              "stages": [stage]}
    results = run_recipe(recipe, tmp_path / "run", report=False)["sft"]
    assert results["data/source/arithmetic/per_epoch"] == 24 and results["data/source/helpful/per_epoch"] == 8
    assert results["data/source/arithmetic/examples"] + results["data/source/helpful/examples"] == 16
