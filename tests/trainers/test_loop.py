"""The shared loop's fault handling: non-finite steps skipped, counted and diagnosed; SIGINT / SIGTERM
finish the step and checkpoint; an unwritable or full output directory fails before training."""

import errno
import logging
import math
import os
import signal
from pathlib import Path

import pytest
import torch

from tether.models import build_tiny
from tether.tasks import get_task, sft_records
from tether.trainers import checkpoint as ckpt
from tether.trainers.checkpoint import CheckpointError, list_checkpoints
from tether.trainers.loop import NonFiniteError, TrainingInterrupted, _StopSignals
from tether.trainers.sft import SFTConfig, SFTTrainer

torch.set_num_threads(1)
RECORDS = sft_records(get_task("arithmetic", digits=2), 32, seed=0)


def make_trainer(tmp_path, name="run", *, seed=0, **train):
    base = {"max_steps": 4, "batch_size": 8, "log_every": 1, "progress": False, "seed": 0}
    cfg = SFTConfig(name="sft", data={"task": {"n": 8}, "pack_length": 128}, train={**base, **train},
                    optim={"lr": 3e-3, "schedule": "constant"}, report_to=[])
    model, tokenizer = build_tiny("tiny", seed=seed)
    return SFTTrainer(cfg, model, tokenizer, tmp_path / name, records=RECORDS)


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# ---- non-finite values ---------------------------------------------------------------------------
def poison(trainer, name, steps):
    """Make parameter ``name``'s gradient NaN during the given (1-based) steps."""
    param = dict(trainer.model.named_parameters())[name]
    param.register_hook(lambda g: g * float("nan") if trainer.step + 1 in steps else g)


def test_a_non_finite_gradient_is_skipped_counted_and_named(tmp_path, caplog):
    trainer = make_trainer(tmp_path, max_steps=4)
    name = "model.layers.1.mlp.down_proj.weight"
    poison(trainer, name, {2})
    weights = {}
    original = trainer.training_step

    def step():
        weights[trainer.step] = flat(trainer.model)
        return original()

    trainer.training_step = step
    with caplog.at_level(logging.WARNING, logger="tether.trainers"):
        trainer.train()
    assert trainer.skipped_steps == 1 and trainer.step == 4
    assert torch.equal(weights[1], weights[2])  # step 2 changed nothing
    assert not torch.equal(weights[2], weights[3])
    message = caplog.text
    assert "step 2:" in message and "non-finite gradient in 1 of " in message and name in message
    assert "finite loss in all 1 micro-batch(es)" in message and "update skipped" in message


def test_max_bad_steps_in_a_row_stop_the_run_with_a_diagnostic(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=10, grad_accum=2, batch_size=4, max_bad_steps=3)
    loss_fn = trainer.loss_fn
    calls = {"n": 0}

    def bad_second_micro_batch(batch, denominator):
        """From step 3 on, micro-batch 1 of every step has an infinite loss."""
        loss, metrics = loss_fn(batch, denominator)
        calls["n"] += 1
        if trainer.step >= 2 and calls["n"] % 2 == 0:
            loss = loss * float("inf")
        return loss, metrics

    trainer.loss_fn = bad_second_micro_batch
    with pytest.raises(NonFiniteError) as info:
        trainer.train()
    text = str(info.value)
    assert "3 consecutive non-finite steps (train.max_bad_steps=3)" in text
    assert "the last: step 5:" in text and "the first of them: step 3:" in text
    assert "non-finite loss in micro-batch(es) 1 of 2" in text
    assert "non-finite gradient in" in text and "model.embed_tokens.weight" in text
    assert trainer.skipped_steps == 3


def test_a_bad_step_between_good_ones_resets_the_count(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=6, max_bad_steps=2)
    poison(trainer, "lm_head.weight" if "lm_head.weight" in dict(trainer.model.named_parameters())
           else "model.norm.weight", {2, 4, 6})
    trainer.train()
    assert trainer.skipped_steps == 3 and trainer.step == 6
    assert all(math.isfinite(v) for v in flat(trainer.model).tolist())


def test_max_bad_steps_is_validated():
    with pytest.raises(ValueError, match="max_bad_steps"):
        SFTConfig(train={"max_bad_steps": 0})


# ---- SIGINT / SIGTERM -------------------------------------------------------------------------------
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_finishes_the_step_checkpoints_and_resume_is_exact(tmp_path, signum):
    reference = make_trainer(tmp_path, "ref", max_steps=5)
    reference.train()
    trainer = make_trainer(tmp_path, max_steps=5)
    original = trainer.training_step

    def step():
        if trainer.step == 2:  # arrives in the middle of step 3
            os.kill(os.getpid(), signum)
        return original()

    trainer.training_step = step
    before = signal.getsignal(signum)
    with pytest.raises(TrainingInterrupted) as info:
        trainer.train()
    stop = info.value
    assert stop.step == 3 and stop.signal_name == signal.Signals(signum).name
    assert stop.checkpoint == trainer.stage_dir / "checkpoints" / "step-000003"
    assert "--resume" in str(stop) and isinstance(stop, KeyboardInterrupt)
    assert [p.name for p in list_checkpoints(trainer.stage_dir)] == ["step-000003"]
    assert signal.getsignal(signum) is before  # the previous handler is back
    resumed = make_trainer(tmp_path, max_steps=5, seed=1)
    resumed.train(resume=True)
    assert torch.equal(flat(resumed.model), flat(reference.model))


def test_a_signal_right_after_a_scheduled_save_does_not_write_twice(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, max_steps=5, save_every=2)
    saves = []
    real_save = trainer.save_checkpoint
    monkeypatch.setattr(trainer, "save_checkpoint", lambda: saves.append(trainer.step) or real_save())
    original = trainer.training_step

    def step():
        if trainer.step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return original()

    trainer.training_step = step
    with pytest.raises(TrainingInterrupted) as info:
        trainer.train()
    assert saves == [2] and info.value.checkpoint.name == "step-000002"


def test_a_second_signal_stops_at_once():
    signals = _StopSignals()
    previous = signal.getsignal(signal.SIGTERM)
    with signals.active():
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt, match="second SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is previous


def test_an_interrupt_inside_a_step_writes_no_inexact_checkpoint(tmp_path, caplog):
    """A KeyboardInterrupt raised mid-step (a second Ctrl-C) must not checkpoint half an update."""
    trainer = make_trainer(tmp_path, max_steps=5, save_every=1)
    original = trainer.training_step

    def step():
        if trainer.step == 2:
            raise KeyboardInterrupt
        return original()

    trainer.training_step = step
    with caplog.at_level(logging.WARNING, logger="tether.trainers"), pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert [p.name for p in list_checkpoints(trainer.stage_dir)] == ["step-000001", "step-000002"]
    assert "interrupted during step 3; no checkpoint written" in caplog.text


# ---- the output directory --------------------------------------------------------------------------
def test_a_read_only_output_directory_fails_before_training(tmp_path, monkeypatch):
    real = Path.write_bytes

    def read_only(self, data):
        if self.name.startswith(".write-test"):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", read_only)
    with pytest.raises(CheckpointError, match=r"output directory .* is not writable \(Read-only file system\); "
                                              "choose another with --out"):
        make_trainer(tmp_path)


def test_an_output_path_under_a_file_fails_before_training(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not writable"):
        make_trainer(tmp_path / "file", "run")


def test_a_full_disk_fails_before_training(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: type("U", (), {"free": 1 << 20})())
    with pytest.raises(CheckpointError, match=r"has 1\.0 MiB free, less than one checkpoint needs"):
        make_trainer(tmp_path)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_optim_fused_takes_the_fused_adamw_kernel_with_the_same_updates():
    from tether.config import OptimConfig
    from tether.trainers.optimization import build_optimizer

    results = {}
    for fused in (False, True):
        model, _ = build_tiny("tiny", seed=0)
        optimizer = build_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.01, fused=fused))
        assert bool(optimizer.defaults["fused"]) is fused and bool(optimizer.defaults["foreach"]) is not fused
        g = torch.Generator().manual_seed(0)
        for _ in range(5):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            optimizer.step()
        results[fused] = torch.cat([p.detach().flatten() for p in model.parameters()])
    # the same AdamW: the two kernels differ in float rounding only
    torch.testing.assert_close(results[True], results[False], atol=1e-6, rtol=0)


def test_both_adamw_kernels_track_a_float64_adamw_without_drift():
    """Fed the same gradients under a warmup + cosine schedule for 200 steps, each float32 kernel stays within
    float32 rounding of a float64 AdamW, and the fused one is as close as the multi-tensor one: no systematic
    drift that could make the two defaults train differently (dpo-onpolicy-arithmetic's outcomes differ
    between them, docs/figures-over-seeds.md)."""
    from tether.config import OptimConfig
    from tether.trainers.optimization import build_optimizer, build_scheduler

    cfg = dict(lr=2e-3, weight_decay=0.01, warmup_steps=20, schedule="cosine", min_lr_ratio=0.1)

    def train(dtype, fused):
        model = build_tiny("tiny", seed=0, num_hidden_layers=1)[0].to(dtype)
        optimizer = build_optimizer(model, OptimConfig(**cfg, fused=fused))
        scheduler = build_scheduler(optimizer, OptimConfig(**cfg), 200)
        g = torch.Generator().manual_seed(0)  # the same gradients for every run
        for step in range(200):
            for p in model.parameters():
                p.grad = (torch.randn(p.shape, generator=g, dtype=torch.float64) * 1e-3 * (1 + step % 7)).to(dtype)
            optimizer.step()
            scheduler.step()
        return torch.cat([p.detach().double().flatten() for p in model.parameters()])

    exact = train(torch.float64, fused=False)
    error = {fused: float((train(torch.float32, fused) - exact).abs().max()) for fused in (False, True)}
    assert error[False] < 5e-6 and error[True] < 5e-6  # float32 rounding of weights of order 1, 200 updates
    assert error[True] <= 1.5 * error[False]


def test_optim_fused_falls_back_where_the_kernel_does_not_apply():
    from tether.config import OptimConfig
    from tether.trainers.optimization import build_optimizer

    meta, _ = build_tiny("tiny", seed=0)
    meta.to("meta")  # no fused kernel on this device: the multi-tensor AdamW instead
    optimizer = build_optimizer(meta, OptimConfig(fused=True))
    assert not optimizer.defaults["fused"] and optimizer.defaults["foreach"]
