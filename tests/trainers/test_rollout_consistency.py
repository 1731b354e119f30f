"""The sampler beside the trainer: zero mismatch on the fp32 HF engine (each update layout: prefix-shared
under a row mask or with cascade attention, packed; agent episodes), ``mismatch/*`` in every RL-type stage,
``old_logprobs: sampler`` skips the recompute pass, and a perturbed sampler gives the hand-computed mismatch
and corrections."""

import math
import sys
from pathlib import Path

import pytest
import torch

from tether.config.rl import GRPOConfig
from tether.rollout import Rollout

sys.path.insert(0, str(Path(__file__).parent))
import test_agent
import test_ppo
import test_rl

KEYS = {"mismatch/logprob_abs_diff_mean", "mismatch/logprob_abs_diff_max", "mismatch/kl_k3",
        "mismatch/is_ratio_mean", "mismatch/is_ratio_max"}


@pytest.mark.parametrize("share", ["mask", "cascade", False], ids=["dense-mask", "cascade", "packed"])
@pytest.mark.parametrize("reuse", [1, 2], ids=["one-pass", "recomputed"])
def test_fp32_hf_engine_has_no_mismatch(tmp_path, share, reuse):
    t = test_rl.trainer(tmp_path, test_rl.config(prefix_sharing=share, num_iterations=reuse))
    for m in test_rl.run_steps(t, 3):
        assert set(m) >= KEYS
        assert float(m["mismatch/logprob_abs_diff_max"]) <= 1e-5
        assert float(m["mismatch/tokens"]) > 0


@pytest.mark.parametrize("share", ["mask", "cascade", False], ids=["dense-mask", "cascade", "packed"])
def test_agent_episodes_have_no_mismatch_and_observations_no_sampler_logprob(tmp_path, share):
    t = test_agent.trainer(tmp_path, test_agent.config(prefix_sharing=share,
                                                       train={"max_steps": 2, "batch_size": 2, "progress": False}))
    collect = t.collect
    batches = []
    t.collect = lambda: batches.append(collect()) or batches[-1]
    for m in test_rl.run_steps(t, 2):
        assert float(m["mismatch/logprob_abs_diff_max"]) <= 1e-5
    rollout = batches[-1].rollout
    observed = [lp for lps, action in zip(rollout.completion_logprobs, rollout.action_masks, strict=True)
                for lp, a in zip(lps, action, strict=True) if not a]
    assert observed and all(math.isnan(x) for x in observed)


def test_ppo_logs_the_mismatch(tmp_path):
    t = test_ppo.trainer(tmp_path, test_ppo.config(train={"max_steps": 1, "batch_size": 4, "progress": False}))
    m = test_rl.run_steps(t, 1)[0]
    assert set(m) >= KEYS and float(m["mismatch/logprob_abs_diff_max"]) <= 1e-5


def test_sampler_old_logprobs_skip_the_recompute_pass(tmp_path):
    calls = {}
    for mode in ("recompute", "sampler"):
        t = test_rl.trainer(tmp_path / mode, test_rl.config(old_logprobs=mode, num_iterations=2, kl={"coef": 0.0}))
        frozen = t.frozen_logprobs
        calls[mode] = 0

        def counting(*args, _frozen=frozen, _mode=mode, **kwargs):
            calls[_mode] += 1
            return _frozen(*args, **kwargs)

        t.frozen_logprobs = counting
        m = test_rl.run_steps(t, 2)[-1]
        assert float(m["mismatch/logprob_abs_diff_max"]) <= 1e-5
    assert calls == {"recompute": 2, "sampler": 0}


class Perturbed:
    """An engine whose reported log-probs are the true ones minus log(rho): the ratio pi_old / mu is rho."""

    def __init__(self, engine, rho):
        self.engine, self.shift = engine, math.log(rho)

    def generate(self, prompts, params):
        out = self.engine.generate(prompts, params)
        return Rollout(out.prompt_ids, out.completion_ids, [[x - self.shift for x in lps] for lps in
                                                            out.completion_logprobs],
                       out.finish_reasons, out.prompt_index, out.texts)


def perturbed_trainer(tmp_path, rho, **overrides):
    cfg = test_rl.config(kl={"coef": 0.0}, optim={"lr": 1e-2, "schedule": "constant", "weight_decay": 0.0,
                                                  "max_grad_norm": None},
                         **overrides)
    t = test_rl.trainer(tmp_path, cfg)
    t.engine = Perturbed(t.engine, rho)
    return t


def test_a_perturbed_sampler_is_measured(tmp_path):
    m = test_rl.run_steps(perturbed_trainer(tmp_path, 3.0, rollout_correction={"mode": "tis", "cap": 2.0}), 1)[0]
    assert float(m["mismatch/logprob_abs_diff_mean"]) == pytest.approx(math.log(3.0), abs=1e-5)
    assert float(m["mismatch/is_ratio_mean"]) == pytest.approx(3.0, abs=1e-4)
    assert float(m["mismatch/kl_k3"]) == pytest.approx(3.0 - 1.0 - math.log(3.0), abs=1e-4)
    assert float(m["mismatch/frac_tokens_corrected"]) == 1.0  # every rho = 3 > cap 2


@pytest.mark.parametrize("mode", ["mis", "icepop", "seq_mask"])
def test_tokens_outside_the_band_get_no_gradient(tmp_path, mode):
    """rho = 3 on every token, band [0.5, 2]: every token is dropped, so the step leaves the policy as it was
    (no KL, no entropy, no weight decay); with the ratio inside the band the policy moves."""
    for rho, moves in ((3.0, False), (1.5, True)):
        t = perturbed_trainer(tmp_path / f"{mode}-{rho}", rho, rollout_correction={"mode": mode, "low": 0.5,
                                                                                    "high": 2.0})
        before = [p.detach().clone() for p in t.model.parameters()]
        m = test_rl.run_steps(t, 1)[0]
        changed = any(not torch.equal(a, b) for a, b in zip(before, t.model.parameters(), strict=True))
        assert changed == moves, (mode, rho)
        assert float(m["mismatch/frac_tokens_corrected"]) == (0.0 if moves else 1.0)


def test_tis_weights_scale_the_gradient(tmp_path):
    """With rho = 1.5 on every token and cap 2, TIS multiplies every token's policy gradient by 1.5: the first
    step's gradient is 1.5 times the uncorrected one."""
    grads = {}
    for mode in ("none", "tis"):
        t = perturbed_trainer(tmp_path / mode, 1.5, rollout_correction={"mode": mode, "cap": 2.0})
        t.optimizer.step = lambda *a, **k: None  # keep the weights; read the gradient before it is cleared
        original = t.optimizer.zero_grad

        def capture(*a, _mode=mode, _t=t, _original=original, **k):
            present = [p.grad.flatten() for p in _t.model.parameters() if p.grad is not None]
            if present:
                grads.setdefault(_mode, torch.cat(present))
            _original(*a, **k)

        t.optimizer.zero_grad = capture
        test_rl.run_steps(t, 1)
    torch.testing.assert_close(grads["tis"], 1.5 * grads["none"], rtol=1e-4, atol=1e-7)


def test_config_errors_are_one_line_and_clear():
    with pytest.raises(ValueError, match="needs old_logprobs: recompute"):
        GRPOConfig(old_logprobs="sampler", rollout_correction={"mode": "tis"})
    with pytest.raises(ValueError, match="valid names"):
        GRPOConfig(rollout_correction={"mode": "nope"})
    with pytest.raises(ValueError, match="must be below high"):
        GRPOConfig(rollout_correction={"mode": "icepop", "low": 2.0, "high": 1.0})
    with pytest.raises(ValueError, match=r"not arguments of 'sapo'"):
        GRPOConfig(policy_loss="sapo", policy_loss_kwargs={"tau": 2.0})


def test_sampler_mode_refuses_an_engine_without_logprobs(tmp_path):
    t = test_rl.trainer(tmp_path, test_rl.config(old_logprobs="sampler"))
    generate = t.engine.generate

    def without(prompts, params):
        out = generate(prompts, params)
        return Rollout(out.prompt_ids, out.completion_ids, [[math.nan] * len(c) for c in out.completion_ids],
                       out.finish_reasons, out.prompt_index, out.texts)

    t.engine.generate = without
    with pytest.raises(ValueError, match="use old_logprobs: recompute"):
        t.training_step()
