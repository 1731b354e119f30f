"""Run under torchrun (2 gloo ranks): completion log-probs of a 2048-token-vocabulary model through the scored-rows
head, wrapped as the trainers wrap it (DDP, FSDP2), against one process over the whole batch. Writes the largest
gradient difference per strategy to OUT (rank 0)."""

import json
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from tether.models.logprobs import completion_logprobs
from tether.models.output_head import output_head
from tether.trainers.parallel import wrap_model


def model_and_batch():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 2048, (20,), generator=g).tolist() for _ in range(4)]
    completions = [torch.randint(3, 2048, (6,), generator=g).tolist() for _ in range(4)]
    return LlamaForCausalLM(config), prompts, completions


def gradients(model, prompts, completions, scale: float) -> None:
    logps, _ = completion_logprobs(model, prompts, completions, temperature=1.0, row_tokens=64, pad_token_id=0)
    (logps.sum() * scale).backward()


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {}
    for strategy in ("ddp", "fsdp2"):
        model, prompts, completions = model_and_batch()
        assert output_head(model) is not None  # the scored-rows head is the one under test
        gradients(model, prompts, completions, 1.0 / world)
        single = [p.grad.clone() for p in model.parameters()]
        model, prompts, completions = model_and_batch()
        wrapped = wrap_model(model, strategy)
        share = slice(rank * len(prompts) // world, (rank + 1) * len(prompts) // world)
        gradients(wrapped, prompts[share], completions[share], 1.0)
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
        result[strategy] = max((a - b).abs().max().item() for a, b in zip(grads, single, strict=True))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
