"""The shared loop through the SFT trainer: loss falls, accumulation and resume are exact."""

import json

import pytest
import torch

from tether.data import DataError
from tether.models import build_tiny
from tether.tasks import get_task, sft_records
from tether.trainers.checkpoint import list_checkpoints
from tether.trainers.sft import SFTConfig, SFTTrainer


def make_config(**train):
    base = {"max_steps": 6, "batch_size": 8, "grad_accum": 1, "log_every": 1, "progress": False, "seed": 0}
    base.update(train)
    return SFTConfig(name="sft", data={"task": {"name": "arithmetic", "n": 64}, "pack_length": 128},
                     train=base, optim={"lr": 3e-3, "schedule": "constant"}, report_to=[])


RECORDS = sft_records(get_task("arithmetic", digits=2), 64, seed=0)


def run(tmp_path, name, *, records=RECORDS, resume=False, model=None, **train):
    if model is None:
        model, _ = build_tiny("tiny", seed=0)
    _, tokenizer = build_tiny("tiny", seed=0)
    trainer = SFTTrainer(make_config(**train), model, tokenizer, tmp_path / name, records=records)
    trainer.train(resume=resume)
    return trainer


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_sft_loss_falls(tmp_path):
    trainer = run(tmp_path, "a", max_steps=30)
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert rows[0]["stage"] == "sft" and rows[0]["step"] == 1
    assert {"lr", "grad_norm", "tokens_per_s"} <= set(rows[0])
    assert losses[-1] < 0.6 * losses[0], losses
    assert trainer.step == 30


def accumulated_gradient(trainer):
    batches = trainer.micro_batches_for_step(0)
    denominator = trainer.global_count(sum(b["num_loss_tokens"] for b in batches))
    trainer.model.zero_grad()
    for batch in batches:
        trainer.loss_fn(batch, denominator)[0].backward()
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters()])


@pytest.mark.parametrize("packing", [True, False])
def test_accumulation_equals_large_batch(tmp_path, packing):
    """batch 8 x accumulation 1 == batch 2 x accumulation 4: the loss is normalised by the loss
    tokens of the whole accumulated batch, so the summed gradient is the same."""
    model, tokenizer = build_tiny()
    grads = []
    for batch_size, accum in [(8, 1), (2, 4)]:
        cfg = make_config(batch_size=batch_size, grad_accum=accum)
        cfg.data.packing = packing
        trainer = SFTTrainer(cfg, model, tokenizer, tmp_path / f"{batch_size}", records=RECORDS)
        grads.append(accumulated_gradient(trainer))
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    # and through the optimiser: after 3 steps the weights agree to float32 noise
    a = run(tmp_path, "big", batch_size=8, grad_accum=1, max_steps=3)
    b = run(tmp_path, "small", batch_size=2, grad_accum=4, max_steps=3)
    assert torch.allclose(flat(a.model), flat(b.model), atol=5e-5)


def test_resume_reproduces_uninterrupted_run(tmp_path):
    full = run(tmp_path, "full", max_steps=8, save_every=100)
    first = run(tmp_path, "split", max_steps=4, save_every=4)
    assert [p.name for p in list_checkpoints(first.stage_dir)] == ["step-000004"]
    # a fresh process: new model object with different weights, then resume to step 8
    resumed = run(tmp_path, "split", max_steps=8, save_every=4, resume=True, model=build_tiny("tiny", seed=1)[0])
    assert resumed.step == 8
    assert torch.equal(flat(full.model), flat(resumed.model))


def test_interrupted_checkpoint_write_is_ignored(tmp_path):
    trainer = run(tmp_path, "c", max_steps=2, save_every=2)
    root = trainer.stage_dir / "checkpoints"
    (root / "step-000004.tmp").mkdir()  # a write killed before its rename
    assert [p.name for p in list_checkpoints(trainer.stage_dir)] == ["step-000002"]


def test_final_export_reloads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = run(tmp_path, "e", max_steps=2)
    trainer.finish()
    reloaded = AutoModelForCausalLM.from_pretrained(trainer.stage_dir)
    AutoTokenizer.from_pretrained(trainer.stage_dir)
    assert torch.equal(flat(reloaded), flat(trainer.model))
    assert json.loads((trainer.stage_dir / "stage.json").read_text())["step"] == 2


def test_bad_row_fails_before_training(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2="}\n')
    model, tokenizer = build_tiny()
    cfg = SFTConfig(name="sft", data={"path": str(bad)}, train={"max_steps": 1, "progress": False},
                    report_to=[])
    with pytest.raises(DataError, match=r"bad\.jsonl.*line 2.*completion"):
        SFTTrainer(cfg, model, tokenizer, tmp_path / "run")
    assert not (tmp_path / "run" / "sft").exists()


def test_on_error_skip_trains_on_the_good_rows_and_counts_the_rest(tmp_path):
    import json as _json

    from tether.config.sft import SFTConfig
    from tether.data.schemas import DataError
    from tether.models import build_tiny
    from tether.trainers.sft import SFTTrainer

    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(16)]
    rows[3] = {"prompt": 7, "completion": "x"}
    rows[9] = {"prompt": "1+1="}
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(_json.dumps(r) for r in rows))
    base = {"data": {"path": str(path), "packing": False}, "train": {"max_steps": 1, "batch_size": 4,
                                                                    "progress": False}, "report_to": []}
    with pytest.raises(DataError, match=r"2 of 16 lines are bad"):
        SFTTrainer(SFTConfig(**base), *build_tiny(), tmp_path / "raise")
    skip = {**base, "data": {**base["data"], "on_error": "skip"}}
    trainer = SFTTrainer(SFTConfig(**skip), *build_tiny(), tmp_path / "skip")
    assert len(trainer.examples) == 14
    assert trainer.fit()["data/skipped"] == 2


def test_a_large_vocabulary_takes_the_head_at_the_loss_positions_with_the_same_loss_and_gradients(tmp_path,
                                                                                                  monkeypatch):
    """A 2,048-token model (>= HEAD_GATHER_MIN_VOCAB): the SFT loss runs its LM head on the loss positions only, and
    the loss and every gradient equal the plain head's over all positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import tether.models.output_head as output_head_module

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=256, pad_token_id=0))
    tokenizer = build_tiny("tiny", seed=0)[1]
    trainer = SFTTrainer(make_config(), model, tokenizer, tmp_path / "run", records=RECORDS)
    batch = trainer.micro_batches_for_step(0)[0]
    rows = []
    hook = model.get_output_embeddings().register_forward_hook(lambda _m, args, _o: rows.append(args[0].shape[1]))

    def loss_and_grads():
        model.zero_grad()
        loss, metrics = trainer.loss_fn(batch, 100.0)
        loss.backward()
        return loss.detach(), metrics["loss_tokens"], [p.grad.clone() for p in model.parameters()]

    try:
        gathered = loss_and_grads()
        with monkeypatch.context() as patch:
            patch.setattr(output_head_module, "HEAD_GATHER_MIN_VOCAB", 10**9)
            full = loss_and_grads()
    finally:
        hook.remove()
    assert rows[0] == int(gathered[1]) < batch["input_ids"].numel() == rows[1] * batch["input_ids"].shape[0]
    torch.testing.assert_close(gathered[0], full[0], atol=1e-6, rtol=1e-6)
    for a, b in zip(gathered[2], full[2], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
