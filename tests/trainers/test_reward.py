"""Reward-model trainer: Bradley-Terry pairwise accuracy and margin rise; the PRM learns step labels."""

import json

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from tether.config.preference import DPOConfig
from tether.core.reward import bradley_terry_loss, ranking_loss
from tether.data import DataError
from tether.data.pairs import load_pair_records
from tether.models.reward_model import build_tiny_reward_model, reward_info
from tether.stages.api import train_reward_model
from tether.tasks import get_task
from tether.tasks.preferences import preference_records, ranking_records, stepwise_records
from tether.trainers import reward as reward_trainer
from tether.trainers.reward import RewardModelConfig, RewardModelTrainer

torch.set_num_threads(1)
TASK = get_task("arithmetic", digits=2)
PAIRS = preference_records(TASK, 32, kind="style")
STEPS = stepwise_records(TASK, 32, wrong_fraction=0.5)


def marked_steps(n, seed=0):
    """Traces whose first wrong step is marked with "?": every step from it on is labelled 0."""
    import random

    rng = random.Random(seed)
    records = []
    for _ in range(n):
        steps = [f"{rng.randint(10, 99)}" for _ in range(4)]
        bad = rng.choice([None, 0, 1, 2, 3])
        if bad is not None:
            steps[bad] += "?"
        records.append({"prompt": "go:", "steps": steps,
                        "labels": [int(bad is None or i < bad) for i in range(4)]})
    return records


def make_config(process=False, data_format=None, **train):
    base = {"max_steps": 12, "batch_size": 8, "log_every": 1, "progress": False, "seed": 0}
    base.update(train)
    return RewardModelConfig(name="rm", process=process, step_separator="|",
                             data={"task": {"n": 8}, "pack_length": 256, "format": data_format}, train=base,
                             optim={"lr": 3e-3, "schedule": "constant"}, report_to=[])


def make_trainer(tmp_path, name="run", *, process=False, records=None, model=None, eval_records=None,
                 data_format=None, **train):
    if model is None:
        model, _ = build_tiny_reward_model(seed=0)
    _, tok = build_tiny_reward_model()
    records = records if records is not None else (STEPS if process else PAIRS)
    return RewardModelTrainer(make_config(process, data_format, **train), model, tok, tmp_path / name,
                              records=records, eval_records=records if eval_records is None else eval_records)


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_bradley_terry_raises_pairwise_accuracy_and_margin(tmp_path):
    trainer = make_trainer(tmp_path)
    before = trainer.evaluate()
    after = trainer.train()
    assert after["margin"] > before["margin"] + 1.0, (before, after)
    assert after["pairwise_accuracy"] >= 0.9 > before["pairwise_accuracy"]
    n = after["pairwise_accuracy_n"]  # held-out pairs, and the Wilson interval of the accuracy over them
    assert n == len(trainer.eval_examples) and after["pairwise_accuracy_ci95_low"] <= after["pairwise_accuracy"]
    assert round(after["pairwise_accuracy"] * n) == sum(trainer.evaluate().outcomes["pairwise_accuracy"])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "accuracy" in r]
    assert {"margin", "rewards/mean", "rewards/std", "loss", "grad_norm"} <= set(train_rows[0])


def test_process_rm_learns_step_labels(tmp_path):
    # the score after each step must say whether any step so far was wrong (the PRM labelling)
    trainer = make_trainer(tmp_path, process=True, records=marked_steps(64), max_steps=15)
    before = trainer.evaluate()
    after = trainer.train()
    assert after["step_bce"] < 0.5 * before["step_bce"], (before, after)
    assert after["step_accuracy"] > 0.9 and after["trajectory_accuracy"] > 0.9
    assert after["step_accuracy_n"] > after["trajectory_accuracy_n"] > 0  # several steps per trajectory
    assert after["trajectory_accuracy_ci95_low"] <= after["trajectory_accuracy"] <= after["trajectory_accuracy_ci95_high"]
    # stepwise arithmetic records go through the same path
    make_trainer(tmp_path, "arith", process=True, max_steps=1).train()


def test_loss_uses_the_global_pair_count_and_margin_column(tmp_path):
    records = [dict(r, margin=0.5 * i) for i, r in enumerate(PAIRS)]
    trainer = make_trainer(tmp_path, records=records)
    group = [trainer.examples[i] for i in trainer.schedule.for_step(0)[0]]
    loss, _ = trainer.outcome_loss(group, global_pairs=2 * len(group))  # half of a two-micro-batch step
    chosen, rejected = trainer.pair_rewards(group)
    expected, _ = bradley_terry_loss(chosen, rejected, margin=torch.tensor([p.margin for p in group]))
    assert torch.allclose(loss, expected / 2, atol=1e-6)


def test_identical_and_empty_pairs_are_dropped_and_counted(tmp_path):
    bad = [*PAIRS[:16], {"prompt": "1+1=", "chosen": "2", "rejected": "2"},
           {"prompt": "1+2=", "chosen": "3", "rejected": "  "}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in bad))
    results = train_reward_model(make_config(max_steps=1).model_dump(), out=tmp_path / "out",
                                 model=build_tiny_reward_model()[0], tokenizer=build_tiny_reward_model()[1],
                                 dataset=str(path), eval_dataset=PAIRS[16:24])
    assert results["data/dropped_identical"] == 1 and results["data/dropped_empty"] == 1
    first = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and first["data/dropped_identical"] == 1


def test_missing_field_names_file_line_and_field(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [PAIRS[0], {"prompt": "1+1=", "chosen": "2", "rejected": "2"}, {"prompt": "x", "chosen": "y"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"pairs\.jsonl, line 3.*'rejected'"):
        load_pair_records(str(path), "preference")
    # rows of a list keep their original numbers past a dropped row
    with pytest.raises(DataError, match=r"row 3, field 'rejected'"):
        load_pair_records(rows, "preference")


def test_export_reloads_as_a_sequence_classifier(tmp_path):
    trainer = make_trainer(tmp_path, process=True, max_steps=2)
    trainer.train()
    trainer.finish()
    reloaded = AutoModelForSequenceClassification.from_pretrained(trainer.stage_dir)
    assert torch.equal(flat(reloaded), flat(trainer.model))
    assert reward_info(reloaded) == {"process": True, "step_separator": "|", "aggregation": "min"}


def test_resume_reproduces_uninterrupted_run(tmp_path):
    full = make_trainer(tmp_path, "full", max_steps=6)
    full.train()
    first = make_trainer(tmp_path, "split", max_steps=3, save_every=3)
    first.train()
    resumed = make_trainer(tmp_path, "split", max_steps=6, save_every=3, model=build_tiny_reward_model(seed=1)[0])
    resumed.train(resume=True)
    assert torch.equal(flat(full.model), flat(resumed.model))


def test_config_checks():
    with pytest.raises(ValueError, match="aggregation"):
        RewardModelConfig(aggregation="median")
    with pytest.raises(ValueError, match="stepwise"):
        RewardModelConfig(process=True, data={"task": {"kind": "correctness"}})
    with pytest.raises(ValueError, match="held-out pairs"):
        RewardModelConfig(eval={"task": "arithmetic"})
    with pytest.raises(ValueError, match="'stepwise'"):
        RewardModelConfig(process=True, data={"task": {}, "format": "ranking"})
    with pytest.raises(ValueError, match=r"set data\.format: ranking"):
        RewardModelConfig(data={"task": {"kind": "correctness"}, "format": "ranking"})
    with pytest.raises(ValueError, match="for reward models"):
        DPOConfig(data={"task": {"kind": "ranking"}})
    assert RewardModelConfig(data={"task": {"kind": "ranking"}}).record_format() == "ranking"
    assert RewardModelConfig(data={"path": "r.jsonl", "format": "ranking"}).record_format() == "ranking"


# ---------------------------------------------------------------- K-way rankings (InstructGPT batching)

RANKINGS = ranking_records(TASK, 32, completions=4)


def test_ranking_rm_learns_held_out_rankings(tmp_path):
    # correct > correct padded > wrong > wrong padded, on problems the model never saw
    held = ranking_records(TASK, 24, completions=4, split="eval")
    trainer = make_trainer(tmp_path, records=RANKINGS, eval_records=held, data_format="ranking")
    before = trainer.evaluate()
    after = trainer.train()
    assert after["pairs"] == before["pairs"] == 24 * 6  # all C(4, 2) pairs of every held-out prompt
    assert after["pairwise_accuracy_n"] == 24 * 6 and after["best_accuracy_n"] == 24
    assert after["pairwise_accuracy"] > max(0.6, before["pairwise_accuracy"] + 0.05), (before, after)
    assert after["loss"] < before["loss"] and after["margin"] > before["margin"]
    assert {"rewards/chosen", "rewards/rejected", "rewards/std", "best_accuracy"} <= set(after)


def test_a_prompts_answers_are_forwarded_once_in_one_batch_element(tmp_path, monkeypatch):
    records = ranking_records(TASK, 6, completions=6)  # ties: 6 answers, 13 untied pairs each
    records[1] = {**records[1], "completions": records[1]["completions"][:3], "ranks": [0, 1, 2]}  # ragged K
    trainer = make_trainer(tmp_path, records=records, data_format="ranking", batch_size=6, max_steps=1)
    calls = []
    forward = reward_trainer.score_positions

    def counting(model, sequences, positions, **kw):
        calls.append([tuple(s) for s in sequences])
        return forward(model, sequences, positions, **kw)

    monkeypatch.setattr(reward_trainer, "score_positions", counting)
    group = [trainer.examples[i] for i in trainer.schedule.for_step(0)[0]]
    loss, _ = trainer.ranked_loss(group, global_prompts=len(group))
    assert len(calls) == 1 and len(calls[0]) == 5 * 6 + 3 == len(set(calls[0]))  # K forwards per prompt, not K(K-1)
    # the loss is InstructGPT's per-prompt mean over pairs, averaged over prompts: one naive prompt at a time
    scores, ranks, mask = trainer.ranking_rewards(group)
    per_prompt = [ranking_loss(scores[b : b + 1, : int(mask[b].sum())], ranks[b : b + 1, : int(mask[b].sum())])[0]
                  for b in range(len(group))]
    assert torch.allclose(loss, torch.stack(per_prompt).mean(), atol=1e-6)
    done = len(calls)
    trainer.train()  # the training step (one micro-batch), then the held-out evaluation: one pass each
    assert [len(c) for c in calls[done:]] == [33, 33]


def test_two_answer_rankings_are_the_pair_path(tmp_path):
    rankings = [{"prompt": p["prompt"], "completions": [p["rejected"], p["chosen"]], "ranks": [1, 0]} for p in PAIRS]
    pairs = make_trainer(tmp_path, "pairs")
    ranked = make_trainer(tmp_path, "ranked", records=rankings, data_format="ranking")
    assert pairs.evaluate()["loss"] == pytest.approx(ranked.evaluate()["loss"], abs=1e-5)
    grads = []
    for trainer, loss_fn in ((pairs, pairs.outcome_loss), (ranked, ranked.ranked_loss)):
        group = [trainer.examples[i] for i in trainer.schedule.for_step(0)[0]]
        loss_fn(group, 2 * len(group))[0].backward()
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_ranking_files_train_through_the_api(tmp_path):
    path = tmp_path / "rankings.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RANKINGS[:16]))
    config = make_config(data_format="ranking", max_steps=2).model_dump()
    model, tok = build_tiny_reward_model()
    results = train_reward_model(config, out=tmp_path / "out", model=model, tokenizer=tok, dataset=str(path),
                                 eval_dataset=RANKINGS[16:24])
    assert results["pairs"] == 8 * 6 and 0 <= results["pairwise_accuracy"] <= 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1=", "completions": ["2", "2"]}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl, line 1, field 'completions\[1\]': duplicates"):
        train_reward_model(config, out=tmp_path / "bad", model=model, tokenizer=tok, dataset=str(bad))


def test_synthetic_rankings_from_the_config_alone(tmp_path):
    config = RewardModelConfig(name="rm", data={"task": {"name": "arithmetic", "options": {"digits": 2}, "n": 8,
                                                          "eval_n": 4, "kind": "ranking", "completions": 3}},
                               train={"max_steps": 1, "batch_size": 4, "progress": False}, report_to=[])
    model, tok = build_tiny_reward_model()
    trainer = RewardModelTrainer(config, model, tok, tmp_path / "run")
    assert trainer.ranking and [len(e.ranks) for e in trainer.examples] == [3] * 8
    assert trainer.train()["pairs"] == 4 * 3


def test_tokenize_rankings_leaves_out_overflowing_and_duplicate_answers():
    from tether.data.pairs import tokenize_rankings

    _, tok = build_tiny_reward_model()
    long = "1" * 200
    records = [{"prompt": "1+1=", "completions": ["3", "2", long, "é"], "ranks": [1, 0, 2, 2]},
               {"prompt": "1+1=", "completions": ["2", long]},  # one answer left: no pair
               {"prompt": "1+1=", "completions": ["é", "ü"]}]  # both the unknown token: identical
    examples, stats = tokenize_rankings(records, tok, max_length=32, overflow="drop")
    assert stats == {"overflow": 1, "identical": 1} and len(examples) == 1
    # best first; the overflowing answer left out, the others kept with their ranks
    assert examples[0].ranks == [0, 1, 2]
    assert [e.input_ids[-2] for e in examples[0].completions] == [tok("2").input_ids[0], tok("3").input_ids[0],
                                                                    tok("é").input_ids[0]]
