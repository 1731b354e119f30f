"""``train.precision: bf16-mixed``: bfloat16 autocast for the forward, float32 weights, gradients and optimizer
state; the loss it gives agrees with float32 to bfloat16 rounding, and training still learns."""

import json
import math

import pytest
import torch

from tether.config.rl import GRPOConfig
from tether.models import build_tiny
from tether.tasks import get_task, sft_records
from tether.trainers.rl import RLTrainer
from tether.trainers.sft import SFTConfig, SFTTrainer

RECORDS = sft_records(get_task("arithmetic", digits=2), 64, seed=0)


def sft(tmp_path, precision, steps):
    cfg = SFTConfig(name="sft", data={"task": {"name": "arithmetic", "n": 64}, "pack_length": 128},
                    train={"max_steps": steps, "batch_size": 8, "log_every": 1, "progress": False,
                           "precision": precision},
                    optim={"lr": 3e-3, "schedule": "constant"}, report_to=[])
    model, tokenizer = build_tiny("tiny", seed=0)
    trainer = SFTTrainer(cfg, model, tokenizer, tmp_path / precision, records=RECORDS)
    return trainer


def test_bf16_mixed_loss_matches_float32_to_bfloat16_rounding(tmp_path):
    full, mixed = sft(tmp_path, "fp32", 1), sft(tmp_path, "bf16-mixed", 1)
    batch = full.micro_batches_for_step(0)[0]
    denominator = float(batch["num_loss_tokens"])
    loss_full = full.loss_fn(batch, denominator)[0]
    with mixed.training_forward():
        loss_mixed = mixed.loss_fn(batch, denominator)[0]
    assert loss_mixed.dtype == torch.float32  # reductions in float32
    assert abs(loss_mixed.item() - loss_full.item()) < 2e-2 * loss_full.item()
    assert loss_mixed.item() != loss_full.item()  # the matmuls did run in bfloat16
    loss_mixed.backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in mixed.model.parameters())


@pytest.mark.parametrize("native", [True, False])
def test_bf16_mixed_on_a_cpu_without_bfloat16_instructions_warns(tmp_path, monkeypatch, caplog, native):
    """Emulated bfloat16 products are several times slower than float32: one warning line says so."""
    from tether.trainers import loop

    monkeypatch.setattr(loop, "cpu_multiplies_bfloat16", lambda: native)
    with caplog.at_level("WARNING", logger="tether.trainers.loop"):
        sft(tmp_path, "bf16-mixed", 1)
        sft(tmp_path, "fp32", 1)
    warned = [r.getMessage() for r in caplog.records if "bfloat16 matrix instructions" in r.getMessage()]
    assert len(warned) == (0 if native else 1) and all("bf16-mixed" in m and "fp32" in m for m in warned)


def test_bf16_mixed_sft_learns_and_keeps_float32_state(tmp_path):
    trainer = sft(tmp_path, "bf16-mixed", 30)
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "bf16-mixed" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < 0.6 * losses[0], losses
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert all(v.dtype == torch.float32 for state in trainer.optimizer.state.values() for v in state.values()
               if torch.is_tensor(v) and v.is_floating_point())


def digit_fraction(prompts, completions, **columns):
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def test_bf16_mixed_grpo_raises_the_reward(tmp_path):
    cfg = GRPOConfig(name="rl", data={"task": {"name": "arithmetic", "n": 64}},
                     rollout={"group_size": 4, "max_new_tokens": 12},
                     train={"max_steps": 10, "batch_size": 8, "log_every": 1, "progress": False,
                            "precision": "bf16-mixed"},
                     optim={"lr": 1e-2, "schedule": "constant"}, report_to=[])
    model, tokenizer = build_tiny("tiny", seed=0)
    trainer = RLTrainer(cfg, model, tokenizer, tmp_path, reward_functions=[digit_fraction])
    rewards = []
    for _ in range(10):
        rewards.append(float(trainer.training_step()["reward/total/mean"]))
        trainer.step += 1
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.2, rewards


def grpo_trainer(tmp_path, precision, **rollout):
    cfg = GRPOConfig(name="rl", data={"task": {"name": "arithmetic", "n": 16}},
                     rollout={"group_size": 2, "max_new_tokens": 4, **rollout},
                     train={"max_steps": 1, "batch_size": 4, "progress": False, "precision": precision},
                     report_to=[])
    model, tokenizer = build_tiny("tiny", seed=0)
    return RLTrainer(cfg, model, tokenizer, tmp_path, reward_functions=[digit_fraction])


def test_bf16_mixed_samples_in_bfloat16_unless_the_engine_options_name_a_dtype(tmp_path):
    bf16 = grpo_trainer(tmp_path / "bf16", "bf16-mixed").engine
    assert next(bf16.model.parameters()).dtype == torch.bfloat16  # a bfloat16 sampling copy ...
    assert next(bf16.source.parameters()).dtype == torch.float32  # ... of the float32 policy
    pinned = grpo_trainer(tmp_path / "pinned", "bf16-mixed", engine_options={"dtype": "float32"}).engine
    assert pinned.model is pinned.source  # float32 named: the live policy samples, no copy
    fp32 = grpo_trainer(tmp_path / "fp32", "fp32").engine
    assert fp32.model is fp32.source


def test_online_preference_samples_in_the_training_precision(tmp_path):
    from tether.trainers.online_preference import OnlineDPOConfig, OnlinePreferenceTrainer

    for precision, dtype in (("bf16-mixed", torch.bfloat16), ("fp32", torch.float32)):
        cfg = OnlineDPOConfig(name="online", data={"task": {"name": "arithmetic", "n": 16}}, rounds=1,
                              steps_per_round=1, prompts_per_round=4, rollout={"samples": 2, "max_new_tokens": 4},
                              train={"batch_size": 4, "progress": False, "precision": precision}, report_to=[])
        model, tokenizer = build_tiny("tiny", seed=0)
        trainer = OnlinePreferenceTrainer(cfg, model, tokenizer, tmp_path / precision,
                                          reward_functions=[digit_fraction])
        assert next(trainer.engine.model.parameters()).dtype == dtype


def test_ray_workers_get_the_sampling_dtype(monkeypatch):
    import tether.rollout.ray_engine as ray_engine
    from tether.rollout.engines import build_engine

    built = {}
    monkeypatch.setattr(ray_engine, "RayEngine", lambda factory, **kw: built.update(factory=factory, kw=kw))
    model, tokenizer = build_tiny("tiny", seed=0)
    build_engine("ray", model, tokenizer, batch_size=8, worker_model={"name_or_path": "tether/tiny"},
                 options={"dtype": "bfloat16", "num_cpus": 1})
    assert built["factory"].engine == {"batch_size": 8, "dtype": "bfloat16"}
    assert built["kw"] == {"num_workers": 2, "source": model, "num_cpus": 1}


def no_grad_output_dtypes(model):
    """The dtypes of every Linear output of ``model`` computed without gradients (the frozen passes), and a
    function that removes the hooks."""
    seen = set()
    handles = [m.register_forward_hook(lambda mod, i, o: None if torch.is_grad_enabled() else seen.add(o.dtype))
               for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return seen, lambda: [h.remove() for h in handles]


def test_frozen_pass_trains_nothing_in_the_training_precision_and_restores_the_mode(tmp_path):
    trainer = sft(tmp_path, "bf16-mixed", 1)
    model, entered = trainer.model, []
    model.train()
    switch = torch.autocast("cpu", enabled=False)  # a switch is entered before the training autocast
    with trainer.frozen_pass(switch):
        entered.append((model.training, torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")))
        out = model(torch.tensor([[1, 2, 3]])).logits
    assert entered == [(False, False, True)] and out.dtype == torch.bfloat16 and out.grad_fn is None
    assert model.training and torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
    model.eval()
    try:
        with trainer.frozen_pass():
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    assert not model.training  # the mode it had, also after an error
    with sft(tmp_path, "fp32", 1).frozen_pass():
        assert not torch.is_autocast_enabled("cpu") and not torch.is_grad_enabled()


def test_bf16_mixed_dpo_reference_pass_runs_in_bfloat16(tmp_path):
    from tether.tasks.preferences import preference_records
    from tether.trainers.preference import DPOConfig, PreferenceTrainer

    pairs = preference_records(get_task("arithmetic", digits=2), 8, kind="style")
    for precision, dtype in (("bf16-mixed", torch.bfloat16), ("fp32", torch.float32)):
        cfg = DPOConfig(name="dpo", data={"task": {"n": 8}}, report_to=[],
                        train={"max_steps": 1, "batch_size": 4, "progress": False, "precision": precision})
        model, tokenizer = build_tiny("tiny", seed=0)
        trainer = PreferenceTrainer(cfg, model, tokenizer, tmp_path / precision, records=pairs, eval_records=pairs)
        seen, remove = no_grad_output_dtypes(model)
        trainer.prepare_reference(use_cache=False)
        remove()
        assert seen == {dtype}  # the frozen pass runs in the training forward's precision
        assert trainer.ref["train_chosen"].dtype == torch.float32  # its sums are float32 either way


def test_bf16_mixed_dpo_scores_a_policy_equal_to_its_reference_zero(tmp_path):
    """The reference pass runs the training forward's kernels, so at the first step (policy = reference) the
    implicit rewards are 0 and the loss log 2 up to float32 summation order (4e-7 here), as in float32; with
    SDPA in the reference pass and matrix products in training they were 2e-5 to 2e-4 apart."""
    from tether.tasks.preferences import preference_records
    from tether.trainers.preference import DPOConfig, PreferenceTrainer

    pairs = preference_records(get_task("arithmetic", digits=2), 16, kind="style")
    for precision in ("bf16-mixed", "fp32"):
        cfg = DPOConfig(name="dpo", data={"task": {"n": 16}}, report_to=[],
                        train={"max_steps": 1, "batch_size": 8, "progress": False, "precision": precision})
        model, tokenizer = build_tiny("tiny", seed=0)
        trainer = PreferenceTrainer(cfg, model, tokenizer, tmp_path / precision, records=pairs, eval_records=pairs)
        trainer.prepare_reference(use_cache=False)
        metrics = trainer.training_step()
        assert abs(metrics["rewards/chosen"]) < 2e-6 and abs(metrics["rewards/rejected"]) < 2e-6, precision
        assert metrics["loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_bf16_mixed_grpo_kl_to_a_separate_reference_model_starts_at_zero(tmp_path):
    """The reference model is a copy of the policy: its pass runs the training forward's kernels too, so the
    first step's KL (policy = reference) is 0 (it was 8e-7 with the copy left on SDPA)."""
    for precision in ("bf16-mixed", "fp32"):
        model, tokenizer = build_tiny("tiny", seed=0)
        trainer = RLTrainer(GRPOConfig(name="g", data={"task": {"name": "arithmetic", "n": 16}},
                                       rollout={"group_size": 4, "max_new_tokens": 8}, kl={"coef": 0.1},
                                       train={"max_steps": 1, "batch_size": 4, "progress": False,
                                              "precision": precision}, report_to=[]),
                            model, tokenizer, tmp_path / precision, reward_functions=[digit_fraction])
        assert trainer.ref_model is not None
        assert trainer.training_step()["kl"] == pytest.approx(0.0, abs=1e-9), precision


def test_bf16_mixed_frozen_passes_run_in_bfloat16(tmp_path):
    """The critic's frozen values (PPO), an online round's reference and mismatch passes, and a local teacher's
    scores all run under the training forward's autocast."""
    from tether.trainers.online_preference import OnlineDPOConfig, OnlinePreferenceTrainer
    from tether.trainers.ppo import PPOConfig, PPOTrainer

    train = {"max_steps": 1, "batch_size": 4, "progress": False, "precision": "bf16-mixed"}
    model, tokenizer = build_tiny("tiny", seed=0)
    ppo = PPOTrainer(PPOConfig(name="ppo", data={"task": {"name": "arithmetic", "n": 16}},
                               rollout={"max_new_tokens": 4}, critic={"init": "policy"}, train=train, report_to=[]),
                     model, tokenizer, tmp_path / "ppo", reward_functions=[digit_fraction])
    seen, remove = no_grad_output_dtypes(ppo.model)
    ppo.training_step()
    remove()
    assert seen == {torch.bfloat16}

    model, tokenizer = build_tiny("tiny", seed=0)
    online = OnlinePreferenceTrainer(
        OnlineDPOConfig(name="online", data={"task": {"name": "arithmetic", "n": 16}}, rounds=1, steps_per_round=1,
                        prompts_per_round=4, rollout={"samples": 2, "max_new_tokens": 4}, train=train, report_to=[]),
        model, tokenizer, tmp_path / "online", reward_functions=[digit_fraction])
    seen, remove = no_grad_output_dtypes(model)
    online.fit()
    remove()
    assert seen == {torch.bfloat16}

    teacher_dir = tmp_path / "teacher"
    build_tiny("tiny", seed=7)[0].save_pretrained(teacher_dir)
    tokenizer.save_pretrained(teacher_dir)
    model, tokenizer = build_tiny("tiny", seed=0)
    opd = RLTrainer(GRPOConfig(name="opd", data={"task": {"name": "arithmetic", "n": 16}}, rewards=[],
                               rollout={"group_size": 2, "max_new_tokens": 4}, kl={"coef": 0.0}, train=train,
                               report_to=[], distill={"teacher": {"path": str(teacher_dir)}}),
                    model, tokenizer, tmp_path / "opd")
    seen, remove = no_grad_output_dtypes(opd.distillation.teacher.model)
    opd.training_step()
    remove()
    assert seen == {torch.bfloat16}
