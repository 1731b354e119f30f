"""Offline preference trainer: the implicit-reward margin grows for every loss; the cached reference
is the live reference; bad pairs are dropped and counted; KTO uses mismatched in-batch pairs."""

import copy
import json

import pytest
import torch

from tether.core.preference_losses import PREFERENCE_LOSSES
from tether.data import DataError
from tether.models import build_tiny
from tether.stages.api import train_dpo
from tether.tasks import get_task
from tether.tasks.preferences import preference_records, split_pairs
from tether.trainers.preference import REFERENCE_CACHE, DPOConfig, PreferenceTrainer

torch.set_num_threads(1)
TASK = get_task("arithmetic", digits=2)
PAIRS = preference_records(TASK, 32, kind="style")  # concise beats padded: learnt in a few steps


def make_config(loss="sigmoid", *, data=None, **train):
    base = {"max_steps": 10, "batch_size": 8, "log_every": 1, "progress": False, "seed": 0}
    extra = {k: train.pop(k) for k in list(train) if k not in base and k not in ("save_every", "grad_accum")}
    base.update(train)
    return DPOConfig(name="dpo", loss=loss, data=data or {"task": {"n": 8}, "pack_length": 256}, train=base,
                     optim={"lr": 2e-3, "schedule": "constant"}, report_to=[], **extra)


def make_trainer(tmp_path, name="run", loss="sigmoid", *, records=PAIRS, eval_records=PAIRS, model=None, **kw):
    if model is None:
        model, _ = build_tiny("tiny", seed=0)
    _, tok = build_tiny()
    return PreferenceTrainer(make_config(loss, **kw), model, tok, tmp_path / name, records=records,
                             eval_records=eval_records)


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def logged(tmp_path, name, key):
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "kto"])
def test_implicit_reward_margin_rises(tmp_path, loss):
    records = split_pairs(PAIRS) if loss == "kto" else PAIRS
    trainer = make_trainer(tmp_path, loss=loss, records=records, max_steps=12)
    results = trainer.train()
    margins = logged(tmp_path, "run", "rewards/margin")
    assert sum(margins[-3:]) / 3 > max(0.05, 2 * sum(margins[:3]) / 3), margins
    # on the pairs themselves: chosen beats rejected by the implicit reward
    assert results["implicit_margin"] > 0 and results["implicit_accuracy"] >= 0.8, results
    if loss == "kto":
        assert logged(tmp_path, "run", "kl")


def records_for(loss, records=PAIRS):
    """The pairs with what the loss reads beyond them: SPPO's win probabilities."""
    if "win_probabilities" in PREFERENCE_LOSSES.needs(loss):
        return [{**r, "chosen_win_prob": 0.75, "rejected_win_prob": 0.25} for r in records]
    return records


@pytest.mark.parametrize("loss", PREFERENCE_LOSSES.names())
def test_every_paired_loss_raises_the_margin(tmp_path, loss):
    records = records_for(loss)
    trainer = make_trainer(tmp_path, loss=loss, max_steps=6, batch_size=16, records=records, eval_records=records)
    from tether.config.preference import REFERENCE_FREE

    before = trainer.preference_figures() if loss in REFERENCE_FREE else {"implicit_margin": 0.0}
    after = trainer.train()
    assert after["implicit_margin"] > before["implicit_margin"], (loss, before, after)


def test_sppo_without_win_probabilities_is_a_one_line_error(tmp_path):
    with pytest.raises(DataError, match="chosen_win_prob"):
        make_trainer(tmp_path, loss="sppo")
    bad = [{**PAIRS[0], "chosen_win_prob": 1.5, "rejected_win_prob": 0.0}]
    with pytest.raises(DataError, match="outside"):
        make_trainer(tmp_path, loss="sppo", records=bad)


def test_step_dpo_trains_on_the_first_wrong_step(tmp_path, monkeypatch):
    """Correctness pairs are cut to their first wrong step (by divergence, or by a process reward model's
    step scores); the stage trains on those and logs what it dropped."""
    pairs = preference_records(TASK, 32, kind="correctness")
    trainer = make_trainer(tmp_path, loss="step_dpo", records=pairs, eval_records=pairs[:8], max_steps=4)
    prompts = [tuple(e.chosen.input_ids) for e in trainer.examples]
    assert len(trainer.examples) == 32 and len(set(prompts)) == 32
    assert trainer.train()["implicit_margin"] > 0
    assert trainer.data_stats["dropped_step_no_wrong_step"] == 0

    import tether.trainers.preference as module

    class StubPRM:  # every step scored good but the second
        def __init__(self, *args, **kwargs):
            pass

        def step_scores(self, prompts, completions):
            return [[0.9, 0.1] + [0.9] * 8 for _ in completions]

    monkeypatch.setattr(module, "RewardModelScorer", StubPRM)
    trainer = make_trainer(tmp_path, "prm", loss="step_dpo", records=pairs, eval_records=pairs[:8], max_steps=1,
                           steps={"prm": "some/prm"})
    # where the traces' error is not at step 1 they agree there: dropped as prefix_differs
    kept = sum(1 for r in pairs if r["chosen"].split("|")[1] != r["rejected"].split("|")[1]
               and r["chosen"].split("|")[0] == r["rejected"].split("|")[0])
    assert len(trainer.examples) == kept and trainer.data_stats["dropped_step_prefix_differs"] == 32 - kept


def test_mixed_losses_and_wpo(tmp_path):
    trainer = make_trainer(tmp_path, loss={"sigmoid": 0.8, "hinge": 0.2}, wpo=True, max_steps=4)
    results = trainer.train()
    assert results["implicit_margin"] > 0
    assert logged(tmp_path, "run", "hinge/loss") and logged(tmp_path, "run", "rewards/margin")


def test_cached_reference_equals_a_live_reference_model(tmp_path):
    model, _ = build_tiny("tiny", seed=0)
    live_ref = copy.deepcopy(model).eval()
    trainer = make_trainer(tmp_path, model=model, max_steps=3)
    trainer.train()
    idx = trainer.schedule.for_step(3)[0]
    cached, _ = trainer.paired_loss(idx, global_pairs=len(idx))
    pairs = [trainer.examples[i] for i in idx]
    with torch.no_grad():
        policy = trainer.model
        trainer.model = live_ref
        ref = trainer.pair_inputs(pairs, None, None)
        trainer.model = policy
    inputs = trainer.pair_inputs(pairs, ref.chosen_logps, ref.rejected_logps)
    live, _ = trainer.loss(inputs)
    assert torch.allclose(cached, live, atol=1e-5), (cached, live)
    assert (trainer.stage_dir / REFERENCE_CACHE).exists()


def test_reference_free_losses_compute_no_reference(tmp_path):
    trainer = make_trainer(tmp_path, loss="simpo", max_steps=1)
    trainer.train()
    assert trainer.ref is None and not (trainer.stage_dir / REFERENCE_CACHE).exists()


def test_bad_pairs_are_dropped_and_counted(tmp_path):
    bad = [*PAIRS[:16], {"prompt": "1+1=", "chosen": "2", "rejected": "2"}, {"prompt": "2+2=", "chosen": "",
                                                                           "rejected": "5"}]
    model, tok = build_tiny()
    results = train_dpo(make_config(max_steps=1), out=tmp_path, model=model, tokenizer=tok, dataset=bad,
                        eval_dataset=PAIRS[16:])
    assert results["data/dropped_identical"] == 1 and results["data/dropped_empty"] == 1
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["data/dropped_identical"] == 1
    with pytest.raises(DataError, match=r"row 2, field 'chosen': missing"):
        train_dpo(make_config(max_steps=1), out=tmp_path / "b", model=model, tokenizer=tok,
                  dataset=[PAIRS[0], {"prompt": "1+1=", "rejected": "3"}])


def test_kto_needs_unpaired_records_or_split_pairs(tmp_path):
    with pytest.raises(DataError, match="split_pairs"):
        make_trainer(tmp_path, loss="kto")
    data = {"task": {"n": 8}, "pack_length": 256, "split_pairs": True}
    trainer = make_trainer(tmp_path, "split", loss="kto", data=data)
    assert len(trainer.examples) == 2 * len(PAIRS)


def test_kto_kl_pairs_are_mismatched_within_the_batch(tmp_path):
    trainer = make_trainer(tmp_path, loss="kto", records=split_pairs(PAIRS))
    _, tok = build_tiny()
    for group in trainer.schedule.fixed_batches():
        for j, i in enumerate(group):
            partner = trainer.examples[group[(j + 1) % len(group)]]
            text = tok.decode(trainer.kl_examples[i].input_ids)
            assert text.startswith(f"<s>{partner.prompt}") and text.endswith(f"{trainer.examples[i].completion}</s>")


def test_resume_reproduces_uninterrupted_run(tmp_path):
    full = make_trainer(tmp_path, "full", max_steps=6)
    full.train()
    make_trainer(tmp_path, "split", max_steps=3, save_every=3).train()
    # a fresh process resumes with other weights: the reference comes from the cache, not from them
    resumed = make_trainer(tmp_path, "split", max_steps=6, save_every=3, model=build_tiny("tiny", seed=1)[0])
    resumed.train(resume=True)
    assert torch.equal(flat(full.model), flat(resumed.model))


def test_config_checks():
    with pytest.raises(ValueError, match="valid names"):
        DPOConfig(loss="dpo2")
    # a recipe tuned for rpo still runs after loss=ipo: rpo_alpha is ignored (with a warning)
    cfg = DPOConfig(loss="ipo", rpo_alpha=2.0, beta=0.5)
    assert cfg.hparams() == {"beta": 0.5} and cfg.ignored_hparams() == ["rpo_alpha"]
    assert DPOConfig(loss={"sigmoid": 1.0, "rpo": 0.5}, rpo_alpha=0.5).needs_reference
    assert not DPOConfig(loss="orpo").needs_reference
    with pytest.raises(ValueError, match="kto"):
        DPOConfig(loss={"kto": 1.0})


def test_packed_and_padded_batches_give_the_same_loss_and_gradients(tmp_path):
    grads, losses = [], []
    for packing in (True, False):
        data = {"task": {"n": 8}, "pack_length": 96, "packing": packing}
        trainer = make_trainer(tmp_path, f"p{packing}", data=data, max_steps=1)
        trainer.prepare_reference(use_cache=False)
        trainer.model.zero_grad()
        loss, _ = trainer.paired_loss(trainer.schedule.for_step(0)[0], global_pairs=8)
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]))
    assert torch.allclose(losses[0], losses[1], atol=1e-6)
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("stage", ["dpo", "rm"])
def test_on_error_skip_leaves_out_bad_pair_rows_and_counts_them(tmp_path, stage):
    import json as _json

    from tether.config import DPOConfig, RewardModelConfig
    from tether.data.schemas import DataError
    from tether.models import build_tiny
    from tether.trainers.preference import PreferenceTrainer
    from tether.trainers.reward import RewardModelTrainer as RewardTrainer

    rows = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(16)]
    rows[2] = {"prompt": "1+1=", "chosen": 2, "rejected": "3"}
    rows[5] = {"prompt": "1+1=", "chosen": "2"}
    rows[11] = {"prompt": "1+1=", "chosen": "2", "rejected": "2"}  # identical: dropped and counted either way
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(_json.dumps(r) for r in rows))
    from tether.models.reward_model import build_tiny_reward_model

    config, trainer = (DPOConfig, PreferenceTrainer) if stage == "dpo" else (RewardModelConfig, RewardTrainer)
    build = build_tiny if stage == "dpo" else build_tiny_reward_model
    base = {"data": {"path": str(path)}, "train": {"max_steps": 1, "batch_size": 4, "progress": False},
            "report_to": []}
    with pytest.raises(DataError, match=r"pairs\.jsonl.*line 3.*chosen(.|\n)*line 6.*rejected"):
        trainer(config(**base), *build(), tmp_path / "raise")
    skipping = trainer(config(**{**base, "data": {**base["data"], "on_error": "skip"}}), *build(),
                       tmp_path / "skip")
    assert len(skipping.examples) == 13
    results = skipping.fit()
    assert results["data/skipped"] == 2 and results["data/dropped_identical"] == 1
