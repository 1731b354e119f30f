"""The final export: the stage directory holds the trained model in the Hugging Face layout. When the last
checkpoint was written at the final step its files are hard-linked, not serialised a second time; the
result is byte for byte what writing would give."""

import errno
import os

import pytest
import torch

from tether.models import build_tiny
from tether.models.loading import load_model
from tether.tasks import get_task, sft_records
from tether.trainers import checkpoint as ckpt
from tether.trainers.sft import SFTConfig, SFTTrainer

torch.set_num_threads(1)
RECORDS = sft_records(get_task("arithmetic", digits=2), 16, seed=0)


def fit(tmp_path, model=None, **train):
    base = {"max_steps": 2, "batch_size": 8, "log_every": 1, "progress": False, "seed": 0}
    cfg = SFTConfig(name="sft", data={"task": {"n": 8}, "pack_length": 128}, train={**base, **train},
                    optim={"lr": 3e-3, "schedule": "constant"}, report_to=[])
    built, tokenizer = build_tiny("tiny", seed=0)
    trainer = SFTTrainer(cfg, model or built, tokenizer, tmp_path / "run", records=RECORDS)
    trainer.fit()
    return trainer


def model_files(directory):
    skip = {ckpt.STATE_FILE, ckpt.MANIFEST_FILE, ckpt.DONE_FILE, "stage_config.json"}
    return {p.name: p for p in directory.iterdir() if p.is_file() and p.name not in skip}


def assert_export_is_what_writing_gives(trainer, tmp_path):
    written = tmp_path / "written"
    ckpt.save_weights(trainer.model, trainer.tokenizer, written)
    exported, fresh = model_files(trainer.stage_dir), model_files(written)
    assert set(exported) == set(fresh)
    for name, path in exported.items():
        assert path.read_bytes() == fresh[name].read_bytes(), name
    loaded, _ = load_model(str(trainer.stage_dir))
    for (name, ours), theirs in zip(trainer.model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs), name
    assert not list(trainer.stage_dir.glob("*" + ckpt.TMP_SUFFIX))


def test_the_export_links_the_checkpoint_of_the_final_step(tmp_path):
    trainer = fit(tmp_path)  # the default save_every_minutes writes a checkpoint at the final step
    last = ckpt.list_checkpoints(trainer.stage_dir)[-1]
    assert ckpt.checkpoint_step(last) == trainer.step == 2
    exported = model_files(trainer.stage_dir)
    assert set(exported) == set(model_files(last))
    for name, path in exported.items():  # the same file on disk, not a copy
        assert os.stat(path).st_ino == os.stat(last / name).st_ino, name
    assert_export_is_what_writing_gives(trainer, tmp_path)
    assert ckpt.verify_checkpoint(last)  # the checkpoint is untouched by the export
    assert ckpt.read_done(trainer.stage_dir)["step"] == 2


def test_without_a_checkpoint_of_the_final_step_the_export_is_written(tmp_path):
    trainer = fit(tmp_path, max_steps=3, save_every=2, save_every_minutes=None)
    last = ckpt.list_checkpoints(trainer.stage_dir)[-1]
    assert ckpt.checkpoint_step(last) == 2 and ckpt.newest_at(trainer.stage_dir, 3) is None
    exported = trainer.stage_dir / "model.safetensors"
    assert os.stat(exported).st_ino != os.stat(last / "model.safetensors").st_ino
    assert_export_is_what_writing_gives(trainer, tmp_path)  # the weights of step 3, not of the checkpoint


def test_a_file_system_without_hard_links_gets_a_written_export(tmp_path, monkeypatch):
    def refuse(*_args, **_kwargs):
        raise OSError(errno.EPERM, "hard links not supported")

    monkeypatch.setattr(ckpt.os, "link", refuse)
    trainer = fit(tmp_path)
    last = ckpt.list_checkpoints(trainer.stage_dir)[-1]
    assert ckpt.checkpoint_step(last) == trainer.step
    assert os.stat(trainer.stage_dir / "model.safetensors").st_ino != os.stat(last / "model.safetensors").st_ino
    assert_export_is_what_writing_gives(trainer, tmp_path)


def test_a_lora_run_exports_the_merged_model_not_the_checkpointed_adapter(tmp_path):
    model, _ = load_model("tether/tiny", lora={"r": 4})
    trainer = fit(tmp_path, model=model)
    last = ckpt.list_checkpoints(trainer.stage_dir)[-1]
    assert "adapter_model.safetensors" in model_files(last)
    exported = model_files(trainer.stage_dir)
    assert "model.safetensors" in exported and "adapter_model.safetensors" not in exported
    merged, _ = load_model(str(trainer.stage_dir))
    expected = {k: v for k, v in trainer.model.merge_and_unload().state_dict().items()}
    for name, tensor in merged.state_dict().items():
        assert torch.allclose(tensor, expected[name], atol=1e-6), name


def test_newest_at_names_only_a_checkpoint_of_that_step(tmp_path):
    assert ckpt.newest_at(tmp_path, 0) is None
    trainer = fit(tmp_path, max_steps=2, save_every=1, keep_checkpoints=3)
    assert ckpt.newest_at(trainer.stage_dir, 2) == ckpt.list_checkpoints(trainer.stage_dir)[-1]
    assert ckpt.newest_at(trainer.stage_dir, 1) is None


@pytest.mark.parametrize("manifest", ["missing", "nested"])
def test_a_checkpoint_that_cannot_be_linked_is_written_instead(tmp_path, manifest):
    trainer = fit(tmp_path)
    last = ckpt.list_checkpoints(trainer.stage_dir)[-1]
    if manifest == "missing":
        (last / ckpt.MANIFEST_FILE).unlink()
    else:
        ckpt.write_manifest(last)
        (last / "sub").mkdir()
        (last / "sub" / "x.bin").write_bytes(b"x")
        ckpt.write_manifest(last)
    target = tmp_path / "target"
    assert not ckpt._link_model_files(last, target) and not target.exists()


def test_exporting_again_from_the_same_checkpoint_leaves_one_clean_export(tmp_path):
    """A finished stage resumed exports again from the checkpoint its files are already linked to."""
    trainer = fit(tmp_path)
    last = ckpt.newest_at(trainer.stage_dir, trainer.step)
    ckpt.export_final(trainer.stage_dir, trainer.model, trainer.tokenizer, checkpoint=last)
    assert os.stat(trainer.stage_dir / "model.safetensors").st_ino == os.stat(last / "model.safetensors").st_ino
    assert_export_is_what_writing_gives(trainer, tmp_path)


def test_exporting_again_replaces_a_folder_of_the_export(tmp_path):
    """PPO's export holds a folder (the critic in ``value/``). A stage resumed after its export (killed before it
    was marked finished) exports again: the folder is replaced with the new critic, not refused (a rename onto a
    non-empty folder fails: found resuming an async PPO run on two ranks)."""
    from tether.models.value_model import ActorCritic, value_model_from

    policy, tokenizer = build_tiny("tiny", seed=0)
    model = ActorCritic(policy, value_model_from(policy, seed=0))
    stage = tmp_path / "ppo"
    stage.mkdir()
    ckpt.export_final(stage, model, tokenizer)
    with torch.no_grad():
        for p in model.critic.parameters():
            p.add_(1.0)
    ckpt.export_final(stage, model, tokenizer)
    written = tmp_path / "written"
    ckpt.save_weights(model.critic, tokenizer, written)
    for name in ("model.safetensors", "config.json"):
        assert (stage / "value" / name).read_bytes() == (written / name).read_bytes(), name
    assert not list(stage.glob(".*" + ckpt.TMP_SUFFIX))
