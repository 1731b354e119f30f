"""SPIN: pairs are (SFT demonstration, the model's own generation), identical ones dropped; each iteration's
reference is the previous iterate; the demonstrations' margin over the model's generations grows."""

import json

import pytest
import torch

from tether.config.preference import SPINConfig
from tether.data.sources import demonstration_records
from tether.models import build_tiny
from tether.stages.api import train_spin
from tether.trainers.online_preference import SPINTrainer, spin_pairs

pytestmark = pytest.mark.usefixtures("one_thread")  # the shared fixture in conftest.py


def config(**overrides):
    data = dict(name="spin", data={"task": {"name": "arithmetic", "n": 32}}, rounds=2, steps_per_round=3,
                prompts_per_round=16, rollout={"max_new_tokens": 12}, loss="sigmoid", beta=0.5,
                train={"batch_size": 8, "log_every": 1, "progress": False}, optim={"lr": 3e-3, "schedule": "constant"},
                report_to=[])
    data.update(overrides)
    return SPINConfig(**data)


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_spin_pairs_put_the_demonstration_first_and_drop_matches():
    pairs, matched = spin_pairs(["p1", "p2", "p3"], ["12", "7 ", "5"], ["13", "7", "x"])
    assert matched == 1  # "7" reproduces "7 " up to whitespace: no pair
    assert pairs == [{"sample": 0, "prompt": "p1", "chosen": "12", "rejected": "13"},
                     {"sample": 2, "prompt": "p3", "chosen": "5", "rejected": "x"}]


def test_spin_rounds_pair_demos_with_generations_against_the_previous_iterate(tmp_path):
    cfg = config()
    model, tokenizer = build_tiny()
    records = demonstration_records(cfg.data)
    trainer = SPINTrainer(cfg, model, tokenizer, tmp_path, records=records)
    assert trainer.ref_model is None  # the reference is the policy itself at each round's start
    trainer.scorer = trainer.build_scorer()
    for _ in range(cfg.steps_per_round):  # round 1
        trainer.training_step()
        trainer.step += 1
    previous = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.training_step()  # round 2 starts: its data and reference log-probs come from the round-1 iterate
    rounds = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in rounds if "round" in r]
    assert len(rounds) == 2 and all(r["mismatch/logprob_abs_diff_max"] <= 1e-5 for r in rounds)
    folder = tmp_path / "spin/rounds/round-001"
    samples, pairs = read(folder / "samples.jsonl"), read(folder / "pairs.jsonl")
    assert len(samples) == 16 and len(pairs) == sum(not s["matches_demo"] for s in samples)
    generated = {s["prompt_id"]: s["completion"] for s in samples}
    for pair in pairs:
        assert pair["chosen"] == records[pair["prompt_id"]]["completion"]
        assert pair["rejected"] == generated[pair["prompt_id"]] != pair["chosen"]
    reference = torch.load(folder / "reference_logps.pt")
    check, _ = build_tiny()
    check.load_state_dict(previous)
    inputs = trainer._inputs(check.eval(), trainer.pairs, None, None, wpo=False)
    assert torch.allclose(reference["chosen"], inputs.chosen_logps.detach(), atol=1e-4)
    assert torch.allclose(reference["rejected"], inputs.rejected_logps.detach(), atol=1e-4)


def test_spin_raises_the_demonstrations_margin(tmp_path):
    results = train_spin(config(rounds=2, steps_per_round=6), out=tmp_path)
    rows = [r for r in read(tmp_path / "metrics.jsonl") if "rewards/margin" in r]
    assert results["round_1/match_rate"] >= 0 and "round_2/match_rate" in results
    margins = [r["rewards/margin"] for r in rows]
    assert margins[-1] > margins[0], margins
    assert (tmp_path / "spin/stage.json").exists()


def test_spin_rejects_what_it_does_not_use():
    with pytest.raises(ValueError, match="spin takes no scorer"):
        config(scorer={"kind": "rewards"})
    assert config().reference == "round" and config().rollout.samples == 1


@pytest.mark.slow
def test_spin_recipe_beats_the_sft_model_after_two_iterations(tmp_path):
    from tether.stages.pipeline import load_recipe, run_recipe

    results = run_recipe(load_recipe("spin-arithmetic"), tmp_path, report=False)
    assert results["spin"]["round_2/accuracy"] > results["sft"]["accuracy"]
    assert results["spin"]["before/accuracy"] == results["sft"]["accuracy"]
