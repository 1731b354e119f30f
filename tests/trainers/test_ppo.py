"""PPO-RLHF: the reward model's score rises, the KL penalty holds the policy near its reference, score
shaping and the optimiser's parameter groups are as configured, and a resumed run reproduces the
uninterrupted one (separate models and the shared-LoRA backbone)."""

import pytest
import torch

from tether.models import apply_lora, build_tiny
from tether.models.reward_model import build_tiny_reward_model
from tether.models.value_model import SharedLoraActorCritic
from tether.rewards.scorer import RewardModelScorer
from tether.rewards.shaping import RunningMoments, shape_scores
from tether.trainers.ppo import PPOConfig, PPOTrainer
from tether.trainers.reward import RewardModelConfig, RewardModelTrainer


def digit_fraction(prompts, completions, **columns):
    """A dense verifiable reward: the fraction of completion characters that are digits."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def config(**overrides):
    data = dict(name="ppo", data={"task": {"name": "arithmetic", "n": 64}}, rollout={"max_new_tokens": 10},
                kl={"coef": 0.0}, critic={"init": "policy", "lr": 3e-3}, ppo_epochs=2, row_tokens=64,
                train={"max_steps": 10, "batch_size": 8, "log_every": 1, "progress": False},
                optim={"lr": 1e-2, "schedule": "constant"}, report_to=[])
    data.update(overrides)
    return PPOConfig(**data)


def trainer(tmp_path, cfg, model=None, rewards=(digit_fraction,), **kwargs):
    if model is None:
        model, _ = build_tiny("tiny", seed=0)
    return PPOTrainer(cfg, model, build_tiny()[1], tmp_path, reward_functions=list(rewards), **kwargs)


def run(t, steps, *keys):
    out = {k: [] for k in keys}
    for _ in range(steps):
        metrics = t.training_step()
        t.step += 1
        for k in keys:
            out[k].append(float(metrics[k]))
    return out


@pytest.fixture(scope="module")
def digit_reward_model(tmp_path_factory):
    """A tiny reward model trained for 30 steps to prefer digits to letters: a real, learned RM."""
    records = [{"prompt": f"{i}+{i}=", "chosen": str(2 * i) * 3, "rejected": "abcxyz"[i % 6] * 4} for i in range(64)]
    cfg = RewardModelConfig(name="rm", train={"max_steps": 20, "batch_size": 16, "progress": False},
                            optim={"lr": 3e-3, "schedule": "constant"}, report_to=[])
    model, tok = build_tiny_reward_model("tiny", seed=0)
    RewardModelTrainer(cfg, model, tok, tmp_path_factory.mktemp("rm"), records=records).train()
    return RewardModelScorer(model.eval(), tok)


def test_ppo_raises_the_reward_model_score(tmp_path, digit_reward_model):
    """Against a learned RM, with the critic initialised from that RM (InstructGPT's choice)."""
    cfg = config(rewards=[], critic={"init": "reward_model", "lr": 3e-3})
    t = trainer(tmp_path, cfg, rewards=(digit_reward_model,))
    assert torch.equal(t.model.critic.score.weight, digit_reward_model.model.score.weight)
    proxy = run(t, 10, "reward/mean")["reward/mean"]
    assert sum(proxy[-3:]) / 3 > sum(proxy[:3]) / 3 + 1.0, proxy


def test_kl_penalty_holds_the_policy_near_the_reference(tmp_path):
    """With beta = 0 nothing pulls the policy back and the KL to the reference keeps growing; with
    beta > 0 (k1 per token in the reward, Ziegler et al.) it stays several times smaller."""
    free = run(trainer(tmp_path / "free", config()), 8, "kl/sequence")["kl/sequence"]
    held = run(trainer(tmp_path / "held", config(kl={"coef": 0.5})), 8, "kl/sequence")["kl/sequence"]
    assert free[-1] > free[2] and free[-1] > 3 * max(held), (free, held)


def test_adaptive_controller_moves_beta_from_the_rollout_kl(tmp_path):
    t = trainer(tmp_path, config(kl={"coef": 0.1, "controller": "adaptive", "target": 1.0, "horizon": 80}))
    out = run(t, 3, "kl_coef", "kl/sequence")
    # beta_{t+1} = beta_t * (1 + clip(KL_t / 1 - 1, -0.2, 0.2) * 8 / 80): KL_0 = 0 -> beta * 0.98
    assert out["kl_coef"][:2] == pytest.approx([0.1, 0.098])
    error = min(max(out["kl/sequence"][1] - 1.0, -0.2), 0.2)
    assert out["kl_coef"][2] == pytest.approx(0.098 * (1 + error * 0.1))


def test_shape_scores_hand_values():
    scores, truncated = torch.tensor([1.0, 3.0, -2.0, 6.0]), torch.tensor([False, True, False, True])
    # batch: mean 2, population std sqrt((1 + 1 + 16 + 16) / 4) = 2.9155 -> [-0.343, 0.343, -1.372, 1.372];
    # clip 1 -> [-0.343, 0.343, -1, 1]; no-EOS penalty 0.5 on rows 1 and 3 -> [-0.343, -0.157, -1, 0.5]
    out = shape_scores(scores, truncated, norm="batch", clip=1.0, missing_eos_penalty=0.5)
    torch.testing.assert_close(out, torch.tensor([-0.3430, -0.1570, -1.0, 0.5]), atol=1e-4, rtol=0)
    moments = RunningMoments()
    shape_scores(torch.tensor([0.0, 2.0]), truncated[:2], norm="running", clip=None, missing_eos_penalty=None,
                 moments=moments)
    # running over [0, 2] then [4]: mean 2, variance (4 + 0 + 4) / 3 -> (4 - 2) / 1.633 = 1.2247
    out = shape_scores(torch.tensor([4.0]), torch.tensor([False]), norm="running", clip=None,
                       missing_eos_penalty=None, moments=moments)
    assert (moments.mean, moments.count) == (2.0, 3) and moments.var == pytest.approx(8 / 3)
    assert out.item() == pytest.approx(2 / (8 / 3) ** 0.5, rel=1e-5)


def test_policy_and_critic_have_their_own_learning_rates(tmp_path):
    t = trainer(tmp_path, config(critic={"init": "policy", "lr": 5e-4}, optim={"lr": 1e-5}))
    critic = {id(p) for p in t.model.critic.parameters()}
    for group in t.optimizer.param_groups:
        expected = 5e-4 if all(id(p) in critic for p in group["params"]) else 1e-5
        assert group["lr"] == expected and group["params"]


def test_micro_batches_give_the_same_gradient(tmp_path):
    """Policy and value losses are normalised over the whole minibatch, so splitting it changes nothing."""
    grads = []
    for micro in (None, 3):
        t = trainer(tmp_path / str(micro), config(micro_batch_size=micro, ppo_epochs=1))
        captured = {}
        t.optimizer.step = lambda *a, **k: None
        original = t.optimizer.zero_grad

        def capture(*a, _c=captured, _t=t, _original=original, **k):
            _c.setdefault("g", torch.cat([p.grad.flatten() for p in _t.model.parameters()]))
            _original(*a, **k)

        t.optimizer.zero_grad = capture
        t.training_step()
        grads.append(captured["g"])
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("shared", [False, True], ids=["separate", "shared_lora"])
def test_resume_reproduces_uninterrupted_run(tmp_path, shared):
    """Stop at step 2, resume in a fresh trainer: policy, critic, adaptive beta and running reward
    statistics land exactly where the uninterrupted run's do."""
    def cfg(steps, save_every=None):
        extra = {"model": {"lora": {"r": 4}}, "critic": {"init": "policy", "share_backbone": True}} if shared else {}
        return config(train={"max_steps": steps, "batch_size": 3, "save_every": save_every, "progress": False},
                      kl={"coef": 0.1, "controller": "adaptive", "target": 0.5, "horizon": 40},
                      rollout={"max_new_tokens": 6}, reward_norm="running", **extra)

    def policy():
        model = build_tiny("tiny", seed=0)[0]
        torch.manual_seed(0)  # the LoRA adapter's initial weights
        return apply_lora(model, {"r": 4}) if shared else model

    full = trainer(tmp_path / "full", cfg(4), model=policy())
    full.train()
    trainer(tmp_path / "cut", cfg(2, save_every=2), model=policy()).train()
    resumed = trainer(tmp_path / "cut", cfg(4, save_every=2), model=policy())
    resumed.train(resume=True)
    for a, b in zip(full.model.state_dict().values(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert resumed.kl_controller.value == full.kl_controller.value != 0.1
    assert resumed.moments.state_dict() == full.moments.state_dict()
    if shared:  # no reference copy (the adapter-free base is the reference), and the value adapter learnt
        assert full.ref_model is None
        start = SharedLoraActorCritic(policy(), seed=0)
        moved = [not torch.equal(a, b) for (n, a), b in zip(full.model.named_parameters(), start.parameters(),
                                                             strict=True) if ".value." in n]
        assert moved and all(moved)


def test_config_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match=r"needs model\.lora"):
        config(critic={"init": "policy", "share_backbone": True})
    with pytest.raises(ValueError, match="no reward model is named"):
        PPOTrainer(config(critic={"init": "reward_model"}), build_tiny()[0], build_tiny()[1], tmp_path,
                   reward_functions=[digit_fraction])
    with pytest.raises(ValueError, match="needs a reward"):
        PPOTrainer(config(), build_tiny()[0], build_tiny()[1], tmp_path)


def test_critic_warmup_trains_the_critic_alone(tmp_path):
    """critic.warmup_steps: 5 with the adaptive KL controller: for 5 steps the actor stays bitwise where it
    started (and beta with it) while the critic moves and its loss falls (0.22 -> 0.003); step 6 trains
    the actor."""
    cfg = config(critic={"init": "policy", "lr": 1e-3, "warmup_steps": 5},
                 kl={"coef": 0.1, "controller": "adaptive", "target": 0.5, "horizon": 40})
    t = trainer(tmp_path, cfg)
    actor = [p.detach().clone() for p in t.model.policy.parameters()]
    critic = [p.detach().clone() for p in t.model.critic.parameters()]
    out = run(t, 5, "critic/warmup", "value/loss", "kl_coef")
    assert out["critic/warmup"] == [1.0] * 5 and out["kl_coef"] == [0.1] * 5
    assert all(torch.equal(a, p) for a, p in zip(actor, t.model.policy.parameters(), strict=True))
    assert all(not torch.equal(c, p) for c, p in zip(critic, t.model.critic.parameters(), strict=True))
    assert out["value/loss"][-1] < 0.1 * out["value/loss"][0], out["value/loss"]
    after = run(t, 1, "critic/warmup", "policy/loss")
    assert after["critic/warmup"] == [0.0] and t.kl_controller.value != 0.1
    assert any(not torch.equal(a, p) for a, p in zip(actor, t.model.policy.parameters(), strict=True))


def test_resume_inside_the_critic_warmup_is_exact(tmp_path):
    """Stop after step 1 of a 2-step warm-up, resume: the run ends where the uninterrupted one does."""
    def cfg(steps, save_every=None):
        return config(critic={"init": "policy", "lr": 3e-3, "warmup_steps": 2}, rollout={"max_new_tokens": 6},
                      train={"max_steps": steps, "batch_size": 3, "save_every": save_every, "progress": False})

    full = trainer(tmp_path / "full", cfg(3))
    full.train()
    trainer(tmp_path / "cut", cfg(1, save_every=1)).train()
    resumed = trainer(tmp_path / "cut", cfg(3, save_every=1))
    resumed.train(resume=True)
    for a, b in zip(full.model.state_dict().values(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
