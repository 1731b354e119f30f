"""DMPO in the offline preference trainer: per-turn policy and cached reference sums of multi-turn episode
pairs (tool messages masked), a few steps raise the turn-discounted margin, and config checks."""

import json

import pytest
import torch

from tether.config.preference import OnlineDPOConfig
from tether.data.episode_pairs import episode_pairs
from tether.models import build_tiny
from tether.trainers.preference import REFERENCE_CACHE, DPOConfig, PreferenceTrainer

torch.set_num_threads(1)


def calculator_episodes(n):
    """Per ``a*b=``: a success (calculator call, result, finish: 2 turns) and a failure (a malformed action,
    a wrong call, a wrong answer: 3 turns)."""
    out = []
    for k in range(n):
        a, b = 11 + k, 3 + k % 5
        prompt = [{"role": "user", "content": f"{a}*{b}="}]
        won = [{"role": "assistant", "content": f"Action: calculator[{a}*{b}]"}, {"role": "tool", "content": str(a * b)},
               {"role": "assistant", "content": f"Action: finish[{a * b}]"}]
        lost = [{"role": "assistant", "content": f"calc {a} times {b}"}, {"role": "tool", "content": "malformed action"},
                {"role": "assistant", "content": f"Action: calculator[{a}+{b}]"},
                {"role": "tool", "content": str(a + b)}, {"role": "assistant", "content": f"Action: finish[{a + b}]"}]
        out += [{"prompt": prompt, "completion": won, "outcome": 1.0},
                {"prompt": prompt, "completion": lost, "outcome": 0.0}]
    return out


PAIRS = episode_pairs(calculator_episodes(16))[0]


def make_trainer(tmp_path, name="run", loss="dmpo", *, max_steps=6, records=PAIRS, **extra):
    model, tok = build_tiny("tiny", seed=0)
    config = DPOConfig(name="dpo", loss=loss, data={"task": {"n": 8}, "pack_length": 512, "max_length": 256},
                       train={"max_steps": max_steps, "batch_size": 8, "log_every": 1, "progress": False, "seed": 0},
                       optim={"lr": 2e-3, "schedule": "constant"}, report_to=[], **extra)
    return PreferenceTrainer(config, model, tok, tmp_path / name, records=records, eval_records=records[:8])


def test_turns_are_the_assistant_messages_and_the_cached_reference_matches_the_policy(tmp_path):
    trainer = make_trainer(tmp_path)
    trainer.prepare_reference(use_cache=False)
    ref = trainer.ref
    assert ref["train_chosen_turns"].shape == (16, 2) and ref["train_rejected_turns"].shape == (16, 3)
    assert ref["train_chosen_turn_counts"].tolist() == [2] * 16 and ref["train_rejected_turn_counts"].tolist() == [3] * 16
    assert torch.allclose(ref["train_chosen_turns"].sum(-1), ref["train_chosen"], atol=1e-4)
    idx = [3, 0, 9, 12]
    trainer.model.eval()
    with torch.no_grad():
        inputs = trainer.pair_inputs([trainer.examples[i] for i in idx], None, None)
    assert inputs.chosen_turns.tolist() == [2] * 4 and inputs.rejected_turns.tolist() == [3] * 4
    assert torch.allclose(inputs.chosen_turn_logps.sum(-1), inputs.chosen_logps, atol=1e-5)
    # before any update the policy is the reference, turn by turn, so the loss is log 2
    assert torch.allclose(inputs.rejected_turn_logps, ref["train_rejected_turns"][idx], atol=1e-4)
    loss, _ = trainer.paired_loss(idx, global_pairs=len(idx))
    assert loss.item() == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-4)
    assert (trainer.stage_dir / REFERENCE_CACHE).exists()


def test_dmpo_raises_the_discounted_margin_on_episode_pairs(tmp_path):
    trainer = make_trainer(tmp_path, dmpo_gamma=0.5)
    results = trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    margins = [r["rewards/margin"] for r in rows if "rewards/margin" in r]
    assert margins[-1] > max(0.05, margins[0]), margins
    assert next(r["turns/rejected"] for r in rows if "turns/rejected" in r) == 3.0
    # held out: DMPO's own reward, β Σ_t φ(t, T) r_t
    assert results["implicit_margin"] > 0 and results["implicit_accuracy"] >= 0.75, results


def test_a_cache_without_per_turn_sums_is_recomputed(tmp_path):
    make_trainer(tmp_path, loss="sigmoid").prepare_reference(use_cache=False)
    trainer = make_trainer(tmp_path, loss="dmpo")
    trainer.prepare_reference(use_cache=True)
    assert "train_chosen_turns" in trainer.ref
    cached = torch.load(trainer.stage_dir / REFERENCE_CACHE, weights_only=True)["logps"]
    assert "train_rejected_turns" in cached


def test_config():
    cfg = DPOConfig(loss="dmpo", dmpo_gamma=0.9, beta=0.2)
    assert cfg.hparams() == {"beta": 0.2, "dmpo_gamma": 0.9} and cfg.loss_needs == {"turn_logprobs"}
    assert DPOConfig(loss="sigmoid", dmpo_gamma=0.9).ignored_hparams() == ["dmpo_gamma"]
    with pytest.raises(ValueError, match="less than or equal to 1"):
        DPOConfig(loss="dmpo", dmpo_gamma=1.5)
    with pytest.raises(ValueError, match="multi-turn agent trajectories offline"):
        OnlineDPOConfig(loss="dmpo")
