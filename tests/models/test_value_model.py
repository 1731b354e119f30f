"""The critic: initialised from a reward model it reproduces the RM's score, it saves and reloads exactly,
values are read at the state each token was chosen in, and the shared-LoRA actor-critic routes adapters."""

import torch

from tether.models import apply_lora, build_tiny
from tether.models.reward_model import build_tiny_reward_model, score_positions
from tether.models.value_model import (
    ActorCritic,
    SharedLoraActorCritic,
    completion_values,
    load_value_model,
    token_values,
    value_model_from,
)

SEQUENCES = [[1, 20, 21, 22, 23, 2], [1, 30, 31, 2]]


def _values_at_last_token(critic):
    out = []
    for seq in SEQUENCES:
        ids = torch.tensor([seq])
        out.append(token_values(critic, ids, torch.arange(len(seq))[None])[0, -1])
    return torch.stack(out)


def test_critic_from_a_reward_model_reproduces_its_score(tmp_path):
    # InstructGPT initialises the value function from the RM: same backbone, same head weight, bias 0,
    # so V at the last token equals the RM's score of the sequence.
    rm, tok = build_tiny_reward_model("tiny", seed=3)
    with torch.no_grad():
        expected = score_positions(rm, SEQUENCES, [[len(s) - 1] for s in SEQUENCES], row_tokens=64, pad_token_id=0)
        torch.testing.assert_close(_values_at_last_token(value_model_from(rm)), expected, atol=1e-5, rtol=1e-5)
        rm.save_pretrained(tmp_path / "rm")
        tok.save_pretrained(tmp_path / "rm")
        loaded, _ = load_value_model(str(tmp_path / "rm"))
        torch.testing.assert_close(_values_at_last_token(loaded), expected, atol=1e-5, rtol=1e-5)


def test_critic_from_the_policy_copies_the_backbone_and_has_no_dropout():
    policy, _ = build_tiny("tiny", seed=1)
    critic = value_model_from(policy, seed=4)
    for name, tensor in policy.model.state_dict().items():
        assert torch.equal(critic.model.state_dict()[name], tensor)
    critic.train()
    ids, pos = torch.tensor([SEQUENCES[0]]), torch.arange(6)[None]
    assert torch.equal(token_values(critic, ids, pos), token_values(critic, ids, pos))  # dropout off


def test_save_and_reload_gives_the_same_values(tmp_path):
    critic, tok = load_value_model("tether/tiny", seed=2)
    critic.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again, _ = load_value_model(str(tmp_path), seed=99)  # the saved head, not a new one from seed 99
    with torch.no_grad():
        torch.testing.assert_close(_values_at_last_token(again), _values_at_last_token(critic))


def test_completion_values_read_the_state_before_each_token():
    # completion token j of a sequence is chosen after position len(prompt) + j - 1: V is read there,
    # whichever way the sequences are packed
    critic, _ = load_value_model("tether/tiny", seed=0)
    prompts, completions = [[1, 20, 21], [1, 30]], [[40, 41, 2], [50, 2]]
    with torch.no_grad():
        packed = completion_values(critic, prompts, completions, row_tokens=64, pad_token_id=0)
        alone = completion_values(critic, prompts, completions, row_tokens=1, pad_token_id=0)
        full = token_values(critic, torch.tensor([[1, 20, 21, 40, 41, 2]]), torch.arange(6)[None])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[0], full[0, 2:5], atol=1e-5, rtol=1e-5)
    assert packed[1, 2] == 0.0  # past the second completion


def test_actor_critic_saves_policy_and_critic_and_loads_them_back(tmp_path):
    policy, _ = build_tiny("tiny", seed=0)
    model = ActorCritic(policy, value_model_from(policy, seed=1))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "value" / "model.safetensors").exists()
    other = ActorCritic(build_tiny("tiny", seed=5)[0], value_model_from(build_tiny("tiny", seed=6)[0], seed=7))
    other.load_pretrained_weights(tmp_path)
    for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_shared_lora_routes_policy_value_and_reference():
    base, _ = build_tiny("tiny", seed=0)
    model = SharedLoraActorCritic(apply_lora(base, {"r": 4}), seed=0)
    policy_params, critic_params = model.parts()
    assert all(p.requires_grad for p in critic_params) and any(p.requires_grad for p in policy_params)
    for p in policy_params + critic_params:  # make both adapters non-trivial
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    ids, pos = torch.tensor([SEQUENCES[0]]), torch.arange(6)[None]
    plain, _ = build_tiny("tiny", seed=0)
    with torch.no_grad():
        with model.disable_adapter():
            torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)
        assert not torch.allclose(model(input_ids=ids).logits, plain(input_ids=ids).logits)
    (model(input_ids=ids).logits.sum() + model.values(ids, pos).sum()).backward()
    # both adapters learn, even after the reference pass (peft's disable_adapter re-freezes inactive ones)
    assert all(p.grad is not None for p in critic_params)
    assert all(p.grad is not None for p in policy_params if p.requires_grad)
