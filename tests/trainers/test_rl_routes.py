"""One GRPO step on mixed prompts (arithmetic: reasoning, secret: general) with rewards routed by kind."""

from tether.config.rl import GRPOConfig
from tether.models import build_tiny
from tether.trainers.rl import RLTrainer


def test_one_routed_grpo_step(tmp_path):
    cfg = GRPOConfig(
        name="rl", algorithm="grpo", task={"name": "arithmetic", "options": {"digits": 2, "letter_digits": 0.5}},
        data={"mix": [{"task": {"n": 16}, "weight": 1, "columns": {"kind": "reasoning"}},
                      {"task": {"name": "secret", "n": 16}, "weight": 1, "columns": {"kind": "general"}}]},
        reward_routes={"routes": {
            "reasoning": {"rewards": [{"name": "accuracy"}, {"name": "format", "weight": 0.1},
                                      {"name": "language_consistency", "weight": 0.1}]},
            "general": {"answer_only": True, "rewards": [{"name": "judge", "kwargs": {"judge": {
                "backend": "callable", "model": "tether.tasks.secret:rule_judge", "kind": "pointwise"}}}]}}},
        rollout={"group_size": 2, "max_new_tokens": 8}, train={"max_steps": 1, "batch_size": 8, "progress": False},
        optim={"lr": 1e-3, "schedule": "constant"}, report_to=[])
    model, tokenizer = build_tiny("tiny", seed=0)
    trainer = RLTrainer(cfg, model, tokenizer, tmp_path)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = trainer.training_step()
    reasoning, general = metrics["reward/route/reasoning/samples"], metrics["reward/route/general/samples"]
    assert reasoning + general == 16 and reasoning > 0 and general > 0  # 8 prompts x 2 samples of both kinds
    assert "reward/reasoning/accuracy/mean" in metrics and "reward/general/judge/mean" in metrics
    assert metrics["reward/general/judge/none"] == 0.0  # the rule judge scores every general answer
    assert -1.0 <= metrics["reward/general/judge/mean"] <= 1.0  # normalised judge score
    # the policy moves when some group's rewards differ; with 2 samples a group, whether any does depends on
    # the draws, which differ between processors. Where every group ties, the advantages are exactly 0 and
    # what is left is the KL term (grpo: beta 0.04) between the policy and the reference forward, identical
    # weights whose log-probs differ only by rounding (the update packs its shuffled rows, the reference pass
    # the rollout's order, so rows hold other sequences): float noise.
    change = max(float((a - b).abs().max()) for a, b in zip(before, model.parameters(), strict=True))
    if metrics["advantage/frac_zero_std_groups"] < 1:
        assert change > 1e-5
    else:
        assert metrics["advantage/advantage_abs_max"] == 0 and float(metrics["grad_norm"]) < 1e-6
