"""The critic-free RL trainer: every preset raises the reward; resume, accumulation and masking are exact."""

import pytest
import torch

from tether.config.rl import GRPOConfig
from tether.models import apply_lora, build_tiny
from tether.rollout import SamplingParams
from tether.trainers.rl import RLTrainer, completion_logprobs

PRESETS = ["grpo", "dr_grpo", "rloo", "reinforce", "reinforce_pp", "reinforce_pp_paper", "remax", "dapo", "gspo", "cispo", "gmpo", "sapo", "dppo"]


def digit_fraction(prompts, completions, **columns):
    """A dense verifiable reward: the fraction of completion characters that are digits."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def config(algorithm="grpo", **overrides):
    data = dict(name="rl", algorithm=algorithm, data={"task": {"name": "arithmetic", "n": 64}},
                rollout={"group_size": 4, "max_new_tokens": 12},
                train={"max_steps": 10, "batch_size": 8, "log_every": 1, "progress": False},
                optim={"lr": 1e-2, "schedule": "constant"}, report_to=[])
    if algorithm == "dapo":
        data["overlong"] = {"buffer": 4}
    data.update(overrides)
    return GRPOConfig(**data)


def trainer(tmp_path, cfg, model=None, rewards=(digit_fraction,)):
    if model is None:
        model, _ = build_tiny("tiny", seed=0)
    return RLTrainer(cfg, model, build_tiny()[1], tmp_path, reward_functions=list(rewards))


def run_steps(t, n):
    """``n`` training steps; each step's metrics."""
    out = []
    for _ in range(n):
        out.append(t.training_step())
        t.step += 1
    return out


def rewards_over_steps(t, steps):
    out = []
    for _ in range(steps):
        metrics = t.training_step()
        t.step += 1
        out.append(float(metrics["reward/total/mean"]))
    return out


@pytest.mark.parametrize("algorithm", PRESETS)
def test_preset_raises_the_reward(tmp_path, algorithm):
    t = trainer(tmp_path, config(algorithm))
    rewards = rewards_over_steps(t, 10)
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last > first + 0.2, rewards


def test_presets_set_the_algorithm_and_explicit_keys_win():
    assert config("dr_grpo").loss_agg == "seq-mean-token-sum-norm"
    assert config("dapo").clip.high == 0.28 and config("dapo").dynamic_sampling.enabled
    assert config("rloo").kl.in_reward
    paper = GRPOConfig(algorithm="reinforce_pp_paper")  # Hu 2025 as written: one response per prompt, k1 KL
    assert paper.rollout.group_size == 1 and paper.kl.estimator == "k1" and paper.kl.in_reward
    assert paper.advantage == "reinforce_pp" and GRPOConfig(algorithm="reinforce_pp").kl.estimator == "k2"
    assert config("grpo", kl={"coef": 0.0}).kl.coef == 0.0
    with pytest.raises(ValueError, match="valid names"):
        config(advantage="nope")


def test_packed_logprobs_match_the_sampler(tmp_path):
    """Log-probs recomputed by the packed training forward equal those of the sampling pass."""
    t = trainer(tmp_path, config())
    rollout = t.engine.generate(t.prompt_ids[:4], SamplingParams(n=2, temperature=0.7, max_new_tokens=10, seed=3))
    with torch.no_grad():
        logps, _ = completion_logprobs(t.model, rollout.prompt_ids, rollout.completion_ids, temperature=0.7,
                                       row_tokens=40, pad_token_id=0)
    padded = rollout.to_padded(0)
    mask = padded["completion_mask"].bool()
    assert torch.allclose(logps[mask], padded["logprobs"][mask], atol=1e-4)


def test_micro_batches_give_the_same_gradient(tmp_path):
    """The policy loss is normalised over the whole minibatch, so splitting it changes nothing."""
    grads = []
    for micro in (None, 3):
        cfg = config("grpo", micro_batch_size=micro, num_iterations=2)
        t = trainer(tmp_path / str(micro), cfg)
        t.optimizer.step = lambda *a, **k: None  # keep the weights; inspect the accumulated gradient
        captured = {}
        original = t.optimizer.zero_grad

        def capture(*a, _c=captured, _t=t, _original=original, **k):
            _c.setdefault("g", torch.cat([p.grad.flatten() for p in _t.model.parameters()]))
            _original(*a, **k)

        t.optimizer.zero_grad = capture
        t.training_step()
        grads.append(captured["g"])
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo"])
def test_resume_reproduces_uninterrupted_run(tmp_path, algorithm):
    """Stop at step 2, resume in a fresh trainer, and land on the uninterrupted run's weights.

    A fresh process loads the stage's initial model again (the KL reference is a copy of it);
    without a reference (dr_grpo) even unrelated starting weights are replaced by the checkpoint.
    """
    def cfg(steps, save_every=None):
        return config(algorithm, train={"max_steps": steps, "batch_size": 4, "save_every": save_every,
                                        "progress": False})

    full = trainer(tmp_path / "full", cfg(4))
    full.train()
    trainer(tmp_path / "cut", cfg(2, save_every=2)).train()
    start = build_tiny("tiny", seed=0 if algorithm == "grpo" else 5)[0]
    resumed = trainer(tmp_path / "cut", cfg(4, save_every=2), model=start)
    resumed.train(resume=True)
    flat = [torch.cat([p.detach().flatten() for p in m.parameters()]) for m in (full.model, resumed.model)]
    assert torch.equal(flat[0], flat[1])


def test_reference_only_when_kl_is_used(tmp_path):
    assert trainer(tmp_path, config("dr_grpo")).ref_model is None
    assert trainer(tmp_path, config("grpo")).ref_model is not None
    lora = apply_lora(build_tiny()[0], {"r": 4})
    t = trainer(tmp_path, config("grpo"), model=lora)
    assert t.ref_model is None  # the adapter-disabled base model is the reference
    rollout = t.engine.generate(t.prompt_ids[:2], SamplingParams(n=2, max_new_tokens=6, seed=0))
    ref = t.frozen_logprobs(rollout, reference=True)
    base = build_tiny()[0]
    with torch.no_grad():
        expected, _ = completion_logprobs(base, rollout.prompt_ids, rollout.completion_ids, temperature=1.0,
                                          row_tokens=1024, pad_token_id=0)
    assert torch.allclose(ref[:, :expected.shape[1]], expected, atol=1e-5)


def test_dynamic_sampling_drops_uninformative_groups(tmp_path):
    def first_prompt_only(prompts, completions, **columns):
        # every group but one gets a constant reward: those groups carry no signal
        return [float(len(c) % 2) if p == prompts[0] else 0.0 for p, c in zip(prompts, completions, strict=True)]

    t = trainer(tmp_path, config("dapo", train={"max_steps": 1, "batch_size": 4, "progress": False}),
                rewards=(first_prompt_only,))
    metrics = t.training_step()
    assert metrics["dynamic_sampling/dropped_groups"] > 0


def test_reward_errors_scored_zero_and_counted(tmp_path):
    def flaky(prompts, completions, **columns):
        if any("7" in c for c in completions):
            raise RuntimeError("boom")
        return [1.0] * len(completions)

    t = trainer(tmp_path, config("grpo", reward_on_error="zero"), rewards=(flaky,))
    metrics = t.training_step()
    assert "reward/flaky/errors" in metrics


def test_prompt_template_reaches_the_model_and_the_rewards(tmp_path):
    seen = []

    def record_prompts(prompts, completions, **columns):
        seen.extend(prompts)
        return [0.0] * len(completions)

    cfg = config("dr_grpo", data={"task": {"name": "arithmetic", "n": 8}, "prompt_template": "Q: {prompt}<think>"},
                 train={"max_steps": 1, "batch_size": 2, "progress": False})
    t = trainer(tmp_path, cfg, rewards=(record_prompts,))
    t.training_step()
    assert all(p.startswith("Q: ") and p.endswith("<think>") for p in seen)
    assert t.tokenizer.decode(t.prompt_ids[0]).endswith("<think>")
    with pytest.raises(ValueError, match="must contain"):
        config(data={"task": {"name": "arithmetic"}, "prompt_template": "no placeholder"})


def test_reinforce_with_the_mean_of_all_past_rewards_carries_its_state_through_a_resume(tmp_path):
    def cfg(steps, save_every=None):
        return config("reinforce", advantage_kwargs={"baseline": "mean"},
                      train={"max_steps": steps, "batch_size": 4, "save_every": save_every, "progress": False})

    full = trainer(tmp_path / "full", cfg(4))
    full.train()
    assert full.running_baseline.shape == (2,) and full.running_baseline[1].item() == 4 * 4 * 4  # 4 steps x 16
    trainer(tmp_path / "cut", cfg(2, save_every=2)).train()
    resumed = trainer(tmp_path / "cut", cfg(4, save_every=2))
    resumed.train(resume=True)
    assert torch.equal(resumed.running_baseline, full.running_baseline)
    flat = [torch.cat([p.detach().flatten() for p in m.parameters()]) for m in (full.model, resumed.model)]
    assert torch.equal(flat[0], flat[1])


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_dapo_overlong_filtering_masks_only_truncated_completions(tmp_path, mask_truncated):
    """DAPO's overlong filtering (Yu et al. 2025, Sec. 3.4): a completion cut at max_new_tokens gets no loss."""
    cfg = config("grpo", rollout={"group_size": 4, "max_new_tokens": 3, "mask_truncated": mask_truncated})
    t = trainer(tmp_path, cfg)
    batch = t.collect()
    n = len(batch.rollout.finish_reasons)
    batch.rollout.finish_reasons = ["length" if i % 3 == 0 else "stop" for i in range(n)]  # a known pattern
    t.prepare(batch)
    truncated = batch.truncated.bool()
    assert truncated.tolist() == [i % 3 == 0 for i in range(n)]
    kept = batch.mask.sum(1)
    if mask_truncated:
        assert (kept[truncated] == 0).all() and (kept[~truncated] > 0).all()
    else:
        assert (kept > 0).all()


def test_process_supervised_grpo_raises_the_step_scores(tmp_path, monkeypatch):
    """grpo_process reads a process reward model's score of every step (here a stub scoring a step by its
    share of digits, so the effect is known) and raises it; the real PRM path loads and runs (last step)."""
    import tether.trainers.process_supervision as process_module
    from tether.models.reward_model import build_tiny_reward_model, set_reward_info

    prm, tok = build_tiny_reward_model()
    set_reward_info(prm, process=True, step_separator=" ", aggregation="min")
    prm.save_pretrained(tmp_path / "prm")
    tok.save_pretrained(tmp_path / "prm")
    cfg = config(advantage="grpo_process", process_reward={"path": str(tmp_path / "prm")}, kl={"coef": 0.0})
    t = trainer(tmp_path / "run", cfg)
    real = run_steps(t, 1)[0]
    assert real["process/steps_mean"] >= 1 and "process/step_score_mean" in real

    class DigitSteps:  # a step's score: its share of digits
        step_separator = " "

        def __init__(self, *args, **kwargs):
            pass

        def step_scores(self, prompts, completions):
            return [[sum(c.isdigit() for c in s) / len(s) for s in text.split(" ") if s.strip()]
                    for text in completions]

    monkeypatch.setattr(process_module, "RewardModelScorer", DigitSteps)
    t = trainer(tmp_path / "stub", cfg)
    scores = [m["process/step_score_mean"] for m in run_steps(t, 10)]
    assert sum(scores[-2:]) / 2 > sum(scores[:2]) / 2 + 0.1, scores
    with pytest.raises(ValueError, match="process_reward"):
        config(advantage="grpo_process")
    with pytest.raises(ValueError, match="not 'grpo'"):
        config(process_reward={"path": "x"})


def test_each_rank_samples_with_its_own_seed_and_rank_0_with_one_process(tmp_path):
    """Under torchrun each rank samples its own prompts; each draws its own noise. With one seed for all, row j
    of every rank drew the same noise, so the same prompt on two ranks gave the same samples (here shown with
    the same prompts). Rank 0's seed is a single process's: one-process runs do not move."""
    from tether.trainers.distributed import DistInfo

    t = trainer(tmp_path, config(train={"max_steps": 10, "batch_size": 8, "progress": False, "seed": 3}))
    assert t.sampling_params(2, step=5).seed == 3 * 1_000_003 + 5 * 101 + 2
    prompts = [t.prompt_ids[i] for i in range(4)]
    ranks = []
    for rank in (0, 1):
        t.dist = DistInfo(rank=rank, world_size=2)
        ranks.append(t.engine.generate(prompts, t.sampling_params(0, step=5)).completion_ids)
    assert t.sampling_params(0, step=5).seed != 3 * 1_000_003 + 5 * 101
    assert sum(a != b for a, b in zip(*ranks, strict=True)) >= len(ranks[0]) // 2
