"""On-policy distillation in the RL trainer: the signal equals the hand-computed one, and training on it moves
the student toward the teacher (sampled-token reverse KL, GKD's JSD, top-k), from a local, a self (privileged
prompt) and a served teacher."""

import pytest
import torch

from tether.config.rl import DistillConfig, GRPOConfig
from tether.core.distillation import top_k_restricted
from tether.models import build_tiny
from tether.models.logprobs import completion_logprobs
from tether.trainers.distillation import LocalTeacher
from tether.trainers.rl import RLTrainer

TOKENIZER = build_tiny()[1]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A teacher that differs from the student: the tiny model from another seed, its distributions sharpened
    (output layer x4), saved."""
    model, tokenizer = sharp_teacher()
    path = tmp_path_factory.mktemp("teacher")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def sharp_teacher():
    model, tokenizer = build_tiny("tiny", seed=7)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model, tokenizer


def config(distill, **overrides):
    data = dict(name="opd", algorithm="grpo", data={"task": {"name": "arithmetic", "n": 32}}, rewards=[],
                rollout={"group_size": 4, "max_new_tokens": 8},
                train={"max_steps": 12, "batch_size": 8, "log_every": 1, "progress": False},
                optim={"lr": 3e-3, "schedule": "constant"}, kl={"coef": 0.0}, report_to=[], distill=distill)
    data.update(overrides)
    return GRPOConfig(**data)


def trainer(tmp_path, cfg, reward_functions=None):
    model, tokenizer = build_tiny("tiny", seed=0)
    return RLTrainer(cfg, model, tokenizer, tmp_path, reward_functions=reward_functions)


def step_batch(t):
    """One step's batch up to its advantages, as training_step builds it."""
    batch = t.collect()
    t.prepare(batch)
    t.frozen_passes(batch)
    adv = t.advantages(batch)
    return batch, adv


def scores(model, batch, prompts=None):
    r = batch.rollout
    logps, _ = completion_logprobs(model, prompts or r.prompt_ids, r.completion_ids, temperature=1.0, row_tokens=1024,
                                   pad_token_id=TOKENIZER.pad_token_id)
    return logps


def test_sampled_token_signal_is_minus_coef_times_the_log_ratio(tmp_path, teacher_dir):
    t = trainer(tmp_path, config({"teacher": {"path": teacher_dir}, "coef": 0.5}))
    batch, adv = step_batch(t)
    teacher, _ = sharp_teacher()
    expected = -0.5 * (scores(t.policy, batch) - scores(teacher, batch)) * batch.mask
    width = expected.shape[1]
    assert torch.allclose(batch.distill_advantages[:, :width], expected, atol=1e-5)
    # no reward: GRPO's outcome advantages are 0, so the advantages are the distillation signal alone
    assert torch.allclose(adv.advantages[:, :width], expected, atol=1e-5)
    assert batch.metrics["distill/teacher_tokens"] == sum(len(p) + len(c) for p, c in
                                                          zip(batch.rollout.prompt_ids, batch.rollout.completion_ids,
                                                              strict=True))


def test_beside_a_reward_the_signal_adds_to_the_outcome_advantage(tmp_path, teacher_dir):
    def length(prompts, completions, **columns):
        return [float(len(c)) for c in completions]

    cfg = config({"teacher": {"path": teacher_dir}}, rewards=[{"name": "accuracy"}])
    with_distill = trainer(tmp_path / "a", cfg, reward_functions=[length])
    without = trainer(tmp_path / "b", config(None, rewards=[{"name": "accuracy"}]), reward_functions=[length])
    batch, adv = step_batch(with_distill)
    batch_b, adv_b = step_batch(without)
    assert batch.rollout.completion_ids == batch_b.rollout.completion_ids  # same seed, same samples
    assert torch.allclose(adv.advantages, adv_b.advantages + batch.distill_advantages, atol=1e-6)


@pytest.mark.parametrize("divergence", [{"divergence": "reverse_kl"}, {"divergence": "jsd", "beta": 0.5},
                                        {"divergence": "forward_kl", "top_k": 8}],
                         ids=["sampled-reverse-kl", "jsd", "forward-kl-top8"])
def test_training_on_the_signal_moves_the_student_toward_the_teacher(tmp_path, teacher_dir, divergence):
    t = trainer(tmp_path, config({"teacher": {"path": teacher_dir}, **divergence}))
    teacher, _ = sharp_teacher()
    probe = step_batch(t)[0]

    def kl_on_probe(top_k=None):
        """KL(student || teacher) over whole next-token distributions at the probe's positions; the forward
        KL(teacher || student) over the teacher's top-k tokens when the loss is that."""
        local = LocalTeacher(teacher, temperature=1.0, row_tokens=1024, pad_token_id=TOKENIZER.pad_token_id,
                             batch_size=64)
        student = LocalTeacher(t.policy, temperature=1.0, row_tokens=1024, pad_token_id=TOKENIZER.pad_token_id,
                               batch_size=64)
        r = probe.rollout
        s, q = student.log_distributions(r.prompt_ids, r.completion_ids), local.log_distributions(r.prompt_ids,
                                                                                                  r.completion_ids)
        if top_k:
            s, q = top_k_restricted(s, q, top_k)
            return float((q.exp() * (q - s)).sum(-1).mean())
        return float((s.exp() * (s - q)).sum(-1).mean())

    top_k = divergence.get("top_k")
    before = kl_on_probe(top_k)
    for _ in range(8):
        metrics = t.training_step()
        t.step += 1
    after = kl_on_probe(top_k)
    assert after < (0.85 if top_k else 0.75) * before, (before, after)  # 8 steps at lr 3e-3
    assert ("distill/reverse_kl" if divergence["divergence"] == "reverse_kl" else "distill/divergence") in metrics


def test_self_distillation_reads_the_privileged_prompt_with_the_student_s_own_weights(tmp_path):
    cfg = config({"teacher": {"kind": "self", "privileged_prompt": "{answer} {prompt}"}})
    t = trainer(tmp_path, cfg)
    batch, _ = step_batch(t)
    assert t.distillation.teacher.model is t.policy
    for i, prompt in enumerate(batch.teacher_prompts):
        record = t.records[batch.prompt_indices[batch.rollout.prompt_index[i]]]
        assert TOKENIZER.decode(prompt, skip_special_tokens=True) == f"{record['answer']} {record['prompt']}"
        # the privileged context reaches the teacher only: the student sampled from the plain prompt
        assert TOKENIZER.decode(batch.rollout.prompt_ids[i], skip_special_tokens=True) == record["prompt"]
    expected = -(scores(t.policy, batch) - scores(t.policy, batch, batch.teacher_prompts)) * batch.mask
    assert torch.allclose(batch.distill_advantages[:, :expected.shape[1]], expected, atol=1e-5)


def test_a_teacher_served_by_tether_serve_gives_the_local_teacher_s_signal(tmp_path, teacher_dir):
    """The served teacher over real HTTP (``tether serve``'s app, echo + logprobs on token-id prompts)."""
    from tether.serve import BackgroundServer, create_app

    teacher, tokenizer = sharp_teacher()
    with BackgroundServer(create_app(teacher, tokenizer, model_name="teacher")) as server:
        served = trainer(tmp_path / "served", config({"teacher": {"kind": "served", "base_url": server.base_url,
                                                                  "served_model": "teacher", "path": teacher_dir}}))
        batch, _ = step_batch(served)
    local = trainer(tmp_path / "local", config({"teacher": {"path": teacher_dir}}))
    batch_local, _ = step_batch(local)
    assert batch.rollout.completion_ids == batch_local.rollout.completion_ids
    assert torch.allclose(batch.distill_advantages, batch_local.distill_advantages, atol=1e-5)


def test_configuration_errors_are_clear(tmp_path, teacher_dir):
    with pytest.raises(ValueError, match="served teacher returns the sampled tokens"):
        DistillConfig(teacher={"kind": "served", "base_url": "http://x/v1"}, divergence="jsd")
    with pytest.raises(ValueError, match="top_k restricts whole distributions"):
        DistillConfig(teacher={"path": "p"}, top_k=4)
    with pytest.raises(ValueError, match="privileged_prompt"):
        DistillConfig(teacher={"kind": "self"})
    with pytest.raises(ValueError, match="needs path"):
        DistillConfig(teacher={"kind": "local"})
    with pytest.raises(ValueError, match="distillation divergence"):
        DistillConfig(teacher={"path": "p"}, divergence="nope")
    with pytest.raises(ValueError, match="needs a reward"):
        RLTrainer(config(None), *build_tiny("tiny", seed=0), tmp_path)
    other, other_tokenizer = build_tiny("tiny", seed=7)
    other_tokenizer.add_tokens(["<extra>"])
    other.save_pretrained(tmp_path / "other")
    other_tokenizer.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="does not share the student's tokenizer"):
        trainer(tmp_path / "t", config({"teacher": {"path": str(tmp_path / "other")}}))
    with pytest.raises(ValueError, match="privileged_prompt names 'nothing'"):
        step_batch(trainer(tmp_path / "p", config({"teacher": {"kind": "self", "privileged_prompt": "{nothing}"}})))


@pytest.mark.slow
def test_opd_arithmetic_recipe_runs_end_to_end(tmp_path):
    """The recipe at toy size: teacher, off-policy student, cold start, and the three on-policy stages."""
    from tether.stages.pipeline import run_recipe
    from tether.stages.recipes import apply_recipe_overrides, load_recipe

    small = ["pretrain.train.max_steps=20", "sft.train.max_steps=20", "grpo.train.max_steps=2",
             "traces.prompts.task.n=40", "student_base.train.max_steps=20", "student_filtered.train.max_steps=10",
             "student_sft.train.max_steps=10", "*.eval.n=20",
             "filtered.filter.verifier=null", "filtered.filter.format=null"]  # a toy teacher solves nothing
    small += [f"{s}.train.max_steps=3" for s in ("opd", "opd-verifier", "opd-jsd")]
    small += [f"{s}.train.eval_every=3" for s in ("opd", "opd-verifier", "opd-jsd")]
    results = run_recipe(apply_recipe_overrides(load_recipe("opd-arithmetic"), small), tmp_path, report=False)
    assert results["opd"]["train/steps"] == 3 and "accuracy" in results["opd-jsd"]
    assert (tmp_path / "opd.png").exists()


def test_the_teacher_token_count_accumulates_and_survives_a_resume(tmp_path, teacher_dir):
    cfg = config({"teacher": {"path": teacher_dir}}, train={"max_steps": 3, "batch_size": 4, "log_every": 1,
                                                          "progress": False, "save_every": 1})
    whole = trainer(tmp_path / "whole", cfg)
    totals = []
    for _ in range(3):
        metrics = whole.training_step()
        whole.step += 1
        totals.append(metrics["distill/teacher_tokens_total"])
    assert totals[0] < totals[1] < totals[2] and totals[2] == sum(m for m in [totals[0], totals[1] - totals[0],
                                                                              totals[2] - totals[1]])
    first = trainer(tmp_path / "split", cfg)
    for _ in range(2):
        first.training_step()
        first.step += 1
    first.save_checkpoint()
    resumed = trainer(tmp_path / "split", cfg)
    resumed.resume()
    assert resumed.step == 2 and resumed.training_step()["distill/teacher_tokens_total"] == totals[2]
