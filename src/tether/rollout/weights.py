"""A policy's weights as an inference engine takes them: full tensors under the Hugging Face names."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of ``model``'s full weights under Hugging Face names; a peft model's LoRA
    merged in (the adapter is merged, the weights copied, then unmerged)."""
    if not hasattr(model, "merge_adapter"):
        for name, tensor in model.state_dict().items():
            yield name, tensor.detach()
        return
    prefix = "base_model.model."
    model.merge_adapter()
    try:
        state = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}
    finally:
        model.unmerge_adapter()
    for name, tensor in state.items():
        name = name.removeprefix(prefix).replace(".base_layer.", ".")
        if ".modules_to_save." in name or ".original_module." in name:
            continue
        yield name, tensor
