"""Checkpoint integrity: a manifest in every checkpoint, corruption detected on load with the file named,
resume falling back to the previous good checkpoint, and a failed write (disk full) that corrupts nothing."""

import errno
import hashlib
import json
import logging

import pytest
import torch

from tether.models import build_tiny
from tether.tasks import get_task, sft_records
from tether.trainers import checkpoint as ckpt
from tether.trainers.checkpoint import CheckpointError, list_checkpoints, verify_checkpoint
from tether.trainers.sft import SFTConfig, SFTTrainer

torch.set_num_threads(1)
RECORDS = sft_records(get_task("arithmetic", digits=2), 32, seed=0)


def make_trainer(tmp_path, name="run", *, seed=0, **train):
    base = {"max_steps": 4, "batch_size": 8, "log_every": 1, "progress": False, "seed": 0, "save_every": 1,
            "keep_checkpoints": 3}
    cfg = SFTConfig(name="sft", data={"task": {"n": 8}, "pack_length": 128}, train={**base, **train},
                    optim={"lr": 3e-3, "schedule": "constant"}, report_to=[])
    model, tokenizer = build_tiny("tiny", seed=seed)
    return SFTTrainer(cfg, model, tokenizer, tmp_path / name, records=RECORDS)


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 6-step run."""
    trainer = make_trainer(tmp_path_factory.mktemp("ref"), max_steps=6)
    trainer.train()
    return flat(trainer.model)


def test_every_checkpoint_has_a_manifest_of_every_file(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.train()
    path = list_checkpoints(trainer.stage_dir)[-1]
    files = json.loads((path / ckpt.MANIFEST_FILE).read_text())["files"]
    on_disk = {p.name for p in path.iterdir()} - {ckpt.MANIFEST_FILE}
    assert set(files) == on_disk and {"model.safetensors", "trainer_state.pt", "tokenizer.json"} <= on_disk
    assert all(len(entry["sha256"]) == 64 for entry in files.values())
    assert verify_checkpoint(path)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_corruption_is_detected_and_names_the_file(tmp_path, damage):
    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.train()
    path = list_checkpoints(trainer.stage_dir)[-1]
    target = path / ("model.safetensors" if damage != "manifest" else ckpt.MANIFEST_FILE)
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
        match = r"'model\.safetensors' does not match its sha256"
    elif damage == "truncate":
        target.write_bytes(bytes(data[:100]))
        match = r"'model\.safetensors' is 100 bytes.*truncated"
    elif damage == "delete":
        target.unlink()
        match = r"'model\.safetensors' is missing"
    else:
        target.write_text("{not json")
        match = r"manifest\.json is unreadable"
    with pytest.raises(CheckpointError, match=match):
        verify_checkpoint(path)


def test_a_damaged_file_without_manifest_still_fails_with_its_name(tmp_path):
    """An old-format checkpoint (no manifest) is loaded unverified, but a damaged file is still named."""
    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.train()
    path = list_checkpoints(trainer.stage_dir)[-1]
    (path / ckpt.MANIFEST_FILE).unlink()
    (path / ckpt.STATE_FILE).write_bytes(b"garbage")
    assert verify_checkpoint(path) is False
    with pytest.raises(CheckpointError, match=r"cannot read trainer_state\.pt"):
        ckpt.load_trainer_state(path)
    (path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"cannot read model\.safetensors"):
        ckpt.load_weights(build_tiny()[0], path)


def test_resume_falls_back_past_a_corrupted_checkpoint_and_stays_exact(tmp_path, reference, caplog):
    first = make_trainer(tmp_path, max_steps=4)
    first.train()
    step4 = list_checkpoints(first.stage_dir)[-1]
    weights = step4 / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0x01  # one bit in the last tensor
    weights.write_bytes(bytes(data))
    resumed = make_trainer(tmp_path, max_steps=6, seed=1)
    with caplog.at_level(logging.WARNING, logger="tether.trainers"):
        resumed.train(resume=True)
    assert "step-000004" in caplog.text and "falling back to the previous checkpoint" in caplog.text
    assert (first.stage_dir / "checkpoints" / "step-000004.corrupt").is_dir()  # kept for inspection
    assert torch.equal(flat(resumed.model), reference)  # resumed from step 3, redid step 4: still exact
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # the rerun steps are not logged twice


def test_resume_with_no_usable_checkpoint_is_a_clear_error(tmp_path):
    first = make_trainer(tmp_path, max_steps=2)
    first.train()
    for path in list_checkpoints(first.stage_dir):
        (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no usable checkpoint.*step-000002.*missing.*step-000001.*"
                                              r"missing.*Delete that folder"):
        make_trainer(tmp_path, max_steps=4).train(resume=True)
    assert len(list_checkpoints(first.stage_dir)) == 2  # nothing renamed or deleted


@pytest.mark.parametrize("where", ["weights", "state", "manifest"])
def test_disk_full_during_a_checkpoint_write_corrupts_nothing(tmp_path, reference, monkeypatch, where):
    """ENOSPC in the middle of writing step 3: a clear error, no .tmp left, steps 1-2 intact, and a
    resume after space is freed reproduces the uninterrupted run."""
    trainer = make_trainer(tmp_path, max_steps=6)
    calls = {"n": 0}
    real = {"weights": ckpt.save_weights, "state": torch.save, "manifest": ckpt.write_manifest}[where]

    def full(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            if where == "weights":  # let part of the file reach the disk first
                (args[2] / "model.safetensors").write_bytes(b"\0" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    if where == "state":
        monkeypatch.setattr(torch, "save", full)
    else:
        monkeypatch.setattr(ckpt, {"weights": "save_weights", "manifest": "write_manifest"}[where], full)
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*step-000003.*No space left on device"
                                              r".*step-000002, is intact"):
        trainer.train()
    monkeypatch.undo()
    root = trainer.stage_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-000001", "step-000002"]
    assert all(verify_checkpoint(p) for p in list_checkpoints(trainer.stage_dir))
    if where == "weights":  # space freed: the resume is exact
        resumed = make_trainer(tmp_path, max_steps=6, seed=1)
        resumed.train(resume=True)
        assert torch.equal(flat(resumed.model), reference)


def test_replacing_and_pruning_never_expose_a_half_deleted_checkpoint(tmp_path, monkeypatch):
    """A checkpoint is renamed out of the step-N namespace before it is deleted: a kill inside the
    deletion leaves a *.old.tmp that is ignored and cleaned up by the next write."""
    trainer = make_trainer(tmp_path, max_steps=3, keep_checkpoints=1)
    seen = []
    real_rmtree = ckpt.shutil.rmtree

    def rmtree(path, *args, **kwargs):
        seen.append(path.name)
        assert not ckpt._STEP_NAME.fullmatch(path.name), f"deleting {path.name} in place"
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(ckpt.shutil, "rmtree", rmtree)
    trainer.train()
    assert "step-000001.old.tmp" in seen and "step-000002.old.tmp" in seen
    root = trainer.stage_dir / "checkpoints"
    (root / "step-000009.old.tmp").mkdir()  # a deletion that was killed
    (root / "step-000007.tmp").mkdir()  # a write that was killed
    assert [p.name for p in list_checkpoints(trainer.stage_dir)] == ["step-000003"]
    ckpt.save_checkpoint(trainer.stage_dir, 4, trainer.model, trainer.tokenizer, trainer.state_dict(), keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["step-000004"]


def test_fault_delay_hook_is_off_by_default(monkeypatch, tmp_path):
    monkeypatch.delenv(ckpt.FAULT_DELAY_ENV, raising=False)
    slept = []
    monkeypatch.setattr(ckpt.time, "sleep", slept.append)
    ckpt._fault_delay()
    monkeypatch.setenv(ckpt.FAULT_DELAY_ENV, "0.25")
    ckpt._fault_delay()
    assert slept == [0.25]


def test_a_full_disk_is_named_even_when_the_writer_hides_the_errno(tmp_path, monkeypatch):
    """torch's zip writer reports a full disk as ``inline_container.cc ... unexpected pos`` with no errno: the
    free space decides, and the error says the disk is full and how to go on."""
    import shutil
    from collections import namedtuple

    trainer = make_trainer(tmp_path, max_steps=3)
    calls = {"n": 0}
    real_save = torch.save

    def failing_save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1408 vs 1296")
        return real_save(*args, **kwargs)

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(torch, "save", failing_save)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 2**20, 2**20))
    with pytest.raises(CheckpointError, match=r"step-000002 \(the disk is full \(1 MB free on .*\): RuntimeError: "
                                              r".*unexpected pos.*; free space, then resume with --resume\); "
                                              r"the last checkpoint, .*step-000001"):
        trainer.train()


def test_disk_full_reason(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from tether.trainers.checkpoint import disk_full_reason

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**40, 2**39, 2**39))  # plenty free
    assert disk_full_reason(OSError(errno.ENOSPC, "No space left on device"), tmp_path) == \
        f"the disk is full (524288 MB free on {tmp_path})"  # the errno decides, whatever the free space says
    wrapped = RuntimeError("safetensors: io error")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert disk_full_reason(wrapped, tmp_path) is not None
    assert disk_full_reason(OSError(errno.EACCES, "Permission denied"), tmp_path) is None
    assert disk_full_reason(RuntimeError("unexpected pos"), tmp_path) is None
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**40, 2**40 - 2**25, 2**25))  # 32 MB free
    assert disk_full_reason(RuntimeError("unexpected pos"), tmp_path) == f"the disk is full (32 MB free on {tmp_path})"
    assert disk_full_reason(OSError(errno.EACCES, "Permission denied"), tmp_path) is None  # an errno says otherwise


def test_trainer_state_is_saved_without_zip_checksums_and_the_option_restored(tmp_path):
    state = {"exp_avg": torch.randn(1000), "step": 3}
    assert torch.serialization.get_crc32_options() is True
    ckpt.save_without_zip_checksums(state, tmp_path / "state.pt")
    assert torch.serialization.get_crc32_options() is True
    loaded = torch.load(tmp_path / "state.pt", weights_only=False)
    assert torch.equal(loaded["exp_avg"], state["exp_avg"]) and loaded["step"] == 3
    with pytest.raises(Exception):  # noqa: B017 - whatever pickle raises, the option comes back
        ckpt.save_without_zip_checksums({"f": lambda: 0}, tmp_path / "bad.pt")
    assert torch.serialization.get_crc32_options() is True


def test_manifest_hashes_every_file_as_one_at_a_time_would(tmp_path):
    for i, size in enumerate([0, 10, 3 << 20, 5000]):
        (tmp_path / f"f{i}.bin").write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "g.bin").write_bytes(b"abc")
    ckpt.write_manifest(tmp_path)
    files = json.loads((tmp_path / ckpt.MANIFEST_FILE).read_text())["files"]
    expected = {p.relative_to(tmp_path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in tmp_path.rglob("*.bin")}
    assert {k: v["sha256"] for k, v in files.items()} == expected
    verify_checkpoint(tmp_path)


def test_verification_reports_the_first_damaged_file_in_manifest_order(tmp_path):
    """Files are checked side by side, but with several damaged the error names the first in the manifest's
    order, as checking one at a time would; an intact checkpoint still verifies."""
    for i in range(6):
        (tmp_path / f"f{i}.bin").write_bytes(bytes([i]) * (2 << 20))
    ckpt.write_manifest(tmp_path)
    assert verify_checkpoint(tmp_path)
    order = list(json.loads((tmp_path / ckpt.MANIFEST_FILE).read_text())["files"])
    assert order == [f"f{i}.bin" for i in range(6)]
    (tmp_path / "f4.bin").unlink()  # missing, late in the order
    (tmp_path / "f3.bin").write_bytes(b"short")  # truncated
    flipped = bytearray((tmp_path / "f1.bin").read_bytes())
    flipped[-1] ^= 1
    (tmp_path / "f1.bin").write_bytes(flipped)  # same size, changed: found only by hashing
    with pytest.raises(CheckpointError, match=r"'f1\.bin' does not match its sha256"):
        verify_checkpoint(tmp_path)
    (tmp_path / "f1.bin").write_bytes(bytes([1]) * (2 << 20))
    with pytest.raises(CheckpointError, match=r"'f3\.bin' is 5 bytes"):
        verify_checkpoint(tmp_path)
    (tmp_path / "f3.bin").write_bytes(bytes([3]) * (2 << 20))
    with pytest.raises(CheckpointError, match=r"'f4\.bin' is missing"):
        verify_checkpoint(tmp_path)
