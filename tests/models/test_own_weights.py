"""Trainable CPU weights leave the safetensors file mapping before the first optimiser step."""

import sys
from pathlib import Path

import pytest
import torch

from tether.models import load_model, save_tiny
from tether.models.loading import own_trainable_weights


def mapped_file(address: int) -> str | None:
    """The file mapped at ``address`` in this process (Linux), None for anonymous memory."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return fields[5].strip() if len(fields) == 6 and fields[5].startswith("/") else None
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_loaded_weights_are_copied_out_of_the_file_mapping(tmp_path):
    save_tiny(tmp_path / "m", "tiny", seed=0)
    model, _ = load_model(str(tmp_path / "m"))
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    mapped = [n for n, p in params.items() if (mapped_file(p.data_ptr()) or "").endswith(".safetensors")]
    assert mapped, "from_pretrained no longer maps the weights file: this copy may be unnecessary"
    frozen = params["model.norm.weight"]
    frozen.requires_grad_(False)
    frozen_ptr = frozen.data_ptr()

    copied = own_trainable_weights(model)

    assert copied == len(params) - 1
    after = dict(model.named_parameters())
    for name, p in after.items():
        assert p is params[name]  # the same Parameter objects: optimisers and tied weights still hold them
        assert torch.equal(p, before[name])
        if name != "model.norm.weight":
            assert mapped_file(p.data_ptr()) is None
    assert frozen.data_ptr() == frozen_ptr  # frozen weights are only read: left mapped


def test_a_view_of_a_larger_storage_is_left_alone_and_tied_weights_stay_one_object():
    base = torch.nn.Parameter(torch.randn(4, 3))
    view = torch.nn.Parameter(base.data[1:])  # shares base's storage at an offset
    lin = torch.nn.Linear(3, 4, bias=False)
    model = torch.nn.Module()
    model.base, model.view, model.lin = base, view, lin
    model.tied = lin.weight  # one Parameter registered twice
    base_ptr, view_ptr, lin_ptr = base.data_ptr(), view.data_ptr(), lin.weight.data_ptr()

    assert own_trainable_weights(model) == 2  # base and the linear weight, the tied one once
    assert base.data_ptr() != base_ptr and lin.weight.data_ptr() != lin_ptr
    assert view.data_ptr() == view_ptr  # copying a view would cut it from the storage it shares
    assert model.tied is lin.weight


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_trainer_trains_on_its_own_copy_of_mapped_weights(tmp_path):
    from tether.tasks import get_task, sft_records
    from tether.trainers.sft import SFTConfig, SFTTrainer

    save_tiny(tmp_path / "m", "tiny", seed=0)
    model, tokenizer = load_model(str(tmp_path / "m"))
    weight = model.model.layers[0].mlp.up_proj.weight
    assert (mapped_file(weight.data_ptr()) or "").endswith(".safetensors")
    cfg = SFTConfig(name="sft", data={"task": {"n": 8}, "pack_length": 64}, report_to=[],
                    train={"max_steps": 1, "batch_size": 4, "progress": False, "save_every_minutes": None})
    trainer = SFTTrainer(cfg, model, tokenizer, tmp_path / "run",
                         records=sft_records(get_task("arithmetic", digits=2), 8, seed=0), stage="sft")
    trainer.train()
    assert mapped_file(weight.data_ptr()) is None
    assert next(iter(trainer.optimizer.state)) in set(model.parameters())
