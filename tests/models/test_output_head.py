"""The LM head at the scored positions only: the same log-probs, entropies, distributions and gradients as the
head over every position, from a head that multiplies only the rows a loss reads."""

import importlib.util
from pathlib import Path

import pytest
import torch

import tether.models.output_head as output_head_module
from tether.models import build_tiny
from tether.models.logprobs import scored_forward, token_logprobs
from tether.models.output_head import head_at, output_head

WORKER = Path(__file__).with_name("output_head_worker.py")
_spec = importlib.util.spec_from_file_location("output_head_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


@pytest.fixture(scope="module")
def model():
    return worker.model_and_batch()[0].eval()  # a Llama of 2,048 tokens, the one the torchrun worker uses


def _batch():
    g = torch.Generator().manual_seed(3)
    sequences, groups, first = [], [], []
    for k, n in enumerate((12, 20, 7)):  # three prompts of three completions each, then a group of one
        prompt = torch.randint(3, 2048, (n,), generator=g).tolist()
        for m in (5, 9, 2):
            sequences.append(prompt + torch.randint(3, 2048, (m,), generator=g).tolist())
            groups.append(k)
            first.append(n)
    sequences.append([5, 6, 7])
    groups.append(99)
    first.append(1)
    return sequences, groups, first


def _plain_head(monkeypatch):
    monkeypatch.setattr(output_head_module, "HEAD_GATHER_MIN_VOCAB", 10**9)


@pytest.mark.parametrize("prefix_sharing", [False, "mask", "cascade"])
def test_scored_rows_give_the_full_heads_log_probs_entropies_and_gradients(model, prefix_sharing, monkeypatch):
    sequences, groups, first = _batch()
    weights = torch.randn(len(sequences), 9, generator=torch.Generator().manual_seed(4))

    def run():
        model.zero_grad()
        logps, valid, entropy = token_logprobs(model, sequences, first_targets=first, groups=groups, temperature=0.8,
                                               row_tokens=64, pad_token_id=0, with_entropy=True,
                                               prefix_sharing=prefix_sharing)
        (logps * weights[:, : logps.shape[1]]).sum().backward()
        return logps.detach(), valid, entropy, [p.grad.clone() for p in model.parameters()]

    gathered = run()
    with monkeypatch.context() as patch:
        _plain_head(patch)
        full = run()
    assert torch.equal(gathered[1], full[1])
    torch.testing.assert_close(gathered[0], full[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gathered[2], full[2], atol=1e-6, rtol=1e-6)
    for a, b in zip(gathered[3], full[3], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_the_head_multiplies_only_the_scored_positions(model, monkeypatch):
    sequences, groups, first = _batch()
    rows_seen = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda _m, args, _out: rows_seen.append(args[0].shape[:-1].numel()))
    try:
        scored = scored_forward(model, sequences, first_targets=first, groups=groups, row_tokens=64,
                                pad_token_id=0, prefix_sharing="mask")
        distributions = scored.log_distributions(0.8)
        with monkeypatch.context() as patch:
            _plain_head(patch)
            full = scored_forward(model, sequences, first_targets=first, groups=groups, row_tokens=64,
                                  pad_token_id=0, prefix_sharing="mask")
    finally:
        hook.remove()
    scored_tokens = sum(len(s) - f for s, f in zip(sequences, first, strict=True))
    # shared prefixes: a group's completions branch from one prompt position, so K is at most the scored tokens
    assert scored.logits.shape[:2] == (1, rows_seen[0]) and rows_seen[0] <= scored_tokens
    assert rows_seen[1] == full.logits.shape[0] * full.logits.shape[1] > 2 * rows_seen[0]
    torch.testing.assert_close(distributions, full.log_distributions(0.8), atol=1e-6, rtol=1e-6)


def test_small_vocabularies_and_models_without_a_head_keep_the_plain_forward():
    tiny = build_tiny("tiny")[0]
    assert tiny.config.vocab_size < output_head_module.HEAD_GATHER_MIN_VOCAB and output_head(tiny) is None
    assert output_head(torch.nn.Linear(4, 4)) is None


def test_a_wrapped_model_is_looked_through_and_the_hook_is_removed(model):
    wrapper = torch.nn.Module()
    wrapper.module = model  # as DistributedDataParallel holds it
    head = output_head(wrapper)
    assert head is model.get_output_embeddings()
    hidden = torch.randn(2, 3, 64)
    with head_at(head, torch.tensor([4, 0])):
        picked = head(hidden)
    torch.testing.assert_close(picked[0], head(hidden.reshape(6, 64)[[4, 0]]))
    assert head(hidden).shape == (2, 3, 2048)  # the hook is gone


@pytest.mark.slow
def test_ddp_and_fsdp2_wrapped_models_get_the_single_process_gradients(tmp_path):
    """Under torchrun (2 gloo ranks), the scored-rows head behind DDP and FSDP2 as the trainers wrap models: each rank
    scores half the batch and the reduced gradients are one process's over the whole batch."""
    import json
    import os
    import socket
    import subprocess
    import sys

    out = tmp_path / "grads.json"
    with socket.socket() as probe:  # a free port (torchrun's port 0 does not rendezvous)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                           str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    worst = json.loads(out.read_text())
    assert set(worst) == {"ddp", "fsdp2"} and all(v < 1e-5 for v in worst.values()), worst


def test_a_lora_model_with_an_adapted_head_gives_the_plain_heads_log_probs(monkeypatch):
    """PEFT's wrapper is looked through to its (LoRA-adapted) head, and the scored rows give the same log-probs."""
    from peft import LoraConfig, get_peft_model

    from tether.models.logprobs import completion_logprobs

    base, prompts, completions = worker.model_and_batch()
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"]))
    assert output_head(model) is base.get_output_embeddings()

    def logps():
        return completion_logprobs(model, prompts, completions, temperature=1.0, row_tokens=64, pad_token_id=0)[0]

    gathered = logps()
    monkeypatch.setattr(output_head_module, "HEAD_GATHER_MIN_VOCAB", 10**9)
    torch.testing.assert_close(gathered, logps(), atol=1e-6, rtol=1e-6)
