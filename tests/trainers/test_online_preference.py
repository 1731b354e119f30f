"""Online / iterative DPO on the tiny model: the scored quantity rises round over round, round data is
saved and a resumed run reproduces an uninterrupted one; OAIF with a pairwise judge over real HTTP;
self-rewarding with the policy as its own judge."""

import json
import re

import pytest
import torch

from tether.config.rewards import JudgeSamplingConfig
from tether.models import build_tiny
from tether.rewards.judge import EndpointJudgeBackend, PairwiseJudge
from tether.rollout import OpenAIEngine, Rollout
from tether.serve import BackgroundServer, create_app
from tether.stages.api import train_online_dpo
from tether.trainers.online_preference import OnlineDPOConfig, OnlinePreferenceTrainer, round_updates

pytestmark = pytest.mark.usefixtures("one_thread")  # the shared fixture in conftest.py


def digit_fraction(prompts, completions, **columns):
    """A dense verifiable reward: the fraction of completion characters that are digits."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def config(**overrides):
    data = dict(name="online", data={"task": {"name": "arithmetic", "n": 64}}, rounds=3, steps_per_round=4,
                prompts_per_round=16, rollout={"samples": 4, "max_new_tokens": 12}, loss="sigmoid",
                train={"batch_size": 8, "log_every": 1, "progress": False}, optim={"lr": 5e-3, "schedule": "constant"},
                report_to=[])
    data.update(overrides)
    return OnlineDPOConfig(**data)


def rounds_logged(run_dir, key):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r and "round" in r]


def test_iterative_dpo_raises_the_verifier_score_round_over_round(tmp_path):
    model, tokenizer = build_tiny()
    results = OnlinePreferenceTrainer(config(), model, tokenizer, tmp_path,
                                      reward_functions=[digit_fraction]).fit()
    scores = rounds_logged(tmp_path, "round/score_mean")  # the policy's samples, scored at each round's start
    assert len(scores) == 3 and scores[2] > scores[0] + 0.1, scores
    pairs = rounds_logged(tmp_path, "round/pairs")
    assert results["round_3/score_mean"] == scores[2] and all(p > 0 for p in pairs)
    for r, count in enumerate(pairs):  # each round's data is on disk as a dataset
        folder = tmp_path / "online" / "rounds" / f"round-{r:03d}"
        samples = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
        saved = [json.loads(line) for line in (folder / "pairs.jsonl").read_text().splitlines()]
        assert len(samples) == 16 * 4 and len(saved) == count
        assert all(p["chosen_score"] > p["rejected_score"] for p in saved)
        assert torch.load(folder / "reference_logps.pt")["chosen"].shape == (count,)
    assert (tmp_path / "online" / "stage.json").exists()


@pytest.mark.parametrize("loss, reference", [("sppo", "round"), ("tdpo", "initial"), ("tdpo", "round")])
def test_sppo_and_tdpo_online_raise_the_score(tmp_path, loss, reference):
    """SPPO reads each pair's win probabilities over its prompt's K samples (saved with the pairs); TDPO the
    sequential KL to the reference (initial, or each round's policy)."""
    model, tokenizer = build_tiny()
    cfg = config(loss=loss, reference=reference, beta=0.1)
    OnlinePreferenceTrainer(cfg, model, tokenizer, tmp_path, reward_functions=[digit_fraction]).fit()
    scores = rounds_logged(tmp_path, "round/score_mean")
    assert scores[2] > scores[0] + 0.05, scores
    saved = [json.loads(line) for line in (tmp_path / "online" / "rounds" / "round-000" / "pairs.jsonl")
             .read_text().splitlines()]
    samples = [json.loads(line) for line in (tmp_path / "online" / "rounds" / "round-000" / "samples.jsonl")
               .read_text().splitlines()]
    assert all(p["chosen_win_prob"] > p["rejected_win_prob"] for p in saved)
    first = samples[:4]  # one prompt's K = 4 samples: hard comparisons, self included, average 1/2
    assert sum(s["win_prob"] for s in first) / 4 == pytest.approx(0.5)
    key = "win_prob/chosen" if loss == "sppo" else "seq_kl/rejected"
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r[key] for r in logged if key in r], key


def test_rso_pairs_only_the_reward_tilted_samples(tmp_path):
    model, tokenizer = build_tiny()
    cfg = config(rounds=1, steps_per_round=1, pairs={"rule": "all_pairs", "rso": {"beta": 0.1, "samples": 2}})
    OnlinePreferenceTrainer(cfg, model, tokenizer, tmp_path, reward_functions=[digit_fraction]).fit()
    saved = [json.loads(line) for line in (tmp_path / "online" / "rounds" / "round-000" / "pairs.jsonl")
             .read_text().splitlines()]
    prompts = [p["prompt_id"] for p in saved]
    assert saved and len(prompts) == len(set(prompts))  # two kept samples per prompt: one pair at most


def test_the_stage_reports_the_audit_over_every_round_s_pairs(tmp_path):
    cfg = config(rounds=2, steps_per_round=2, audit=[{"name": "accuracy"}])
    model, tokenizer = build_tiny()
    results = OnlinePreferenceTrainer(cfg, model, tokenizer, tmp_path, reward_functions=[digit_fraction]).fit()
    saved = [json.loads(line) for r in range(2)
             for line in (tmp_path / "online" / "rounds" / f"round-{r:03d}" / "pairs.jsonl").read_text().splitlines()]
    assert saved and all(p["chosen_audit"] in (0.0, 1.0) for p in saved)
    assert results["audit/chosen_mean"] == pytest.approx(sum(p["chosen_audit"] for p in saved) / len(saved))
    decided = sum(p["chosen_audit"] != p["rejected_audit"] for p in saved)
    assert results["audit/pairs_decided"] == decided
    stage = json.loads((tmp_path / "online" / "stage.json").read_text())
    assert stage["results"]["audit/chosen_mean"] == results["audit/chosen_mean"]  # in the finished stage's record


def test_an_online_stage_evaluated_before_reports_its_paired_gain(tmp_path):
    cfg = config(rounds=1, steps_per_round=2, eval={"n": 8, "max_new_tokens": 6, "before": True})
    model, tokenizer = build_tiny()
    results = OnlinePreferenceTrainer(cfg, model, tokenizer, tmp_path, reward_functions=[digit_fraction]).fit()
    assert results["gain/accuracy"] == pytest.approx(results["accuracy"] - results["before/accuracy"])
    assert results["n"] == results["round_1/n"] == 8.0 and "gain/accuracy_ci95_low" in results


def test_a_resumed_run_reproduces_the_uninterrupted_one(tmp_path):
    cfg = config(rounds=2, steps_per_round=3, train={"batch_size": 8, "progress": False, "save_every": 4})
    model, tokenizer = build_tiny()
    OnlinePreferenceTrainer(cfg, model, tokenizer, tmp_path / "a", reward_functions=[digit_fraction]).train()

    first, _ = build_tiny()
    interrupted = OnlinePreferenceTrainer(cfg, first, tokenizer, tmp_path / "b", reward_functions=[digit_fraction])
    interrupted.scorer = interrupted.build_scorer()
    for _ in range(4):  # round 0 and the first step of round 1, then a checkpoint, then "killed"
        interrupted.training_step()
        interrupted.step += 1
    interrupted.save_checkpoint()
    fresh, _ = build_tiny()
    OnlinePreferenceTrainer(cfg, fresh, tokenizer, tmp_path / "b", reward_functions=[digit_fraction]).train(resume=True)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)
    for name in ("pairs.jsonl", "samples.jsonl"):
        assert ((tmp_path / "a/online/rounds/round-001" / name).read_text()
                == (tmp_path / "b/online/rounds/round-001" / name).read_text())


class DigitJudge:
    """A scripted judge model served over HTTP: A or B for the response with more digits, a tie ([[C]]) if equal."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, prompts, params):
        texts = []
        for ids in prompts:
            a, b = re.search(r"A:(.*)\nB:(.*)\nBetter:", self.tokenizer.decode(ids, skip_special_tokens=True),
                             re.S).groups()
            da, db = sum(map(str.isdigit, a)), sum(map(str.isdigit, b))
            texts.append("A" if da > db else "B" if db > da else "[[C]]")
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        return Rollout(list(prompts), ids, [[0.0] * len(i) for i in ids], ["stop"] * len(ids),
                       list(range(len(ids))), texts)


def test_oaif_with_a_pairwise_judge_over_http_raises_the_judged_quality(tmp_path):
    model, tokenizer = build_tiny()
    cfg = config(mode="oaif", steps_per_round=1, rounds=12, prompts_per_round=16, rollout={"max_new_tokens": 12})
    assert cfg.rollout.samples == 2 and cfg.steps_per_round == 1 and cfg.train.max_steps == 12
    with BackgroundServer(create_app(engine=DigitJudge(tokenizer), tokenizer=tokenizer, model_name="judge")) as server:
        engine = OpenAIEngine(server.base_url, "judge", cache_dir=tmp_path / "cache")
        judge = PairwiseJudge(EndpointJudgeBackend(engine, sampling=JudgeSamplingConfig(max_new_tokens=2)), template="compact-pairwise")
        train_online_dpo(cfg, out=tmp_path, model=model, tokenizer=tokenizer, judge=judge)
    assert engine.stats["requests"] == 12 * 16 * 2  # every pair judged fresh, in both orders
    consistency = rounds_logged(tmp_path, "judge/consistency")
    assert len(consistency) == 12 and min(consistency) == 1.0  # the scripted judge has no position bias
    quality = []
    for r in range(12):
        rows = (tmp_path / "online" / "rounds" / f"round-{r:03d}" / "samples.jsonl").read_text().splitlines()
        quality.append(sum(digit_fraction(None, [json.loads(x)["completion"] for x in rows])) / len(rows))
    assert sum(quality[-3:]) / 3 > sum(quality[:3]) / 3 + 0.1, quality


def test_self_rewarding_has_the_policy_judge_its_own_samples(tmp_path):
    model, tokenizer = build_tiny()
    judge = {"kind": "pointwise", "template": "compact-pointwise", "scale": [0, 9], "sampling": {"max_new_tokens": 1}}
    cfg = config(self_rewarding=True, rounds=1, steps_per_round=2, scorer={"kind": "judge", "judge": judge})
    assert cfg.scorer.judge.backend == "policy"
    results = OnlinePreferenceTrainer(cfg, model, tokenizer, tmp_path).fit()
    replies = rounds_logged(tmp_path, "judge/replies")
    unparseable = rounds_logged(tmp_path, "judge/unparseable")[0]
    samples = [json.loads(x) for x in (tmp_path / "online/rounds/round-000/samples.jsonl").read_text().splitlines()]
    assert replies == [64] and unparseable == sum(s["score"] is None for s in samples)
    pairs = [json.loads(x) for x in (tmp_path / "online/rounds/round-000/pairs.jsonl").read_text().splitlines()]
    assert all(p["chosen_score"] > p["rejected_score"] for p in pairs)
    assert results["round_1/pairs"] == len(pairs)


def test_round_updates_stop_after_the_set_passes_over_few_pairs():
    assert round_updates(1, 16, 45, None) == 45  # unset: every step of the round, whatever the pair count
    assert round_updates(1, 16, 45, 2.0) == 2  # one pair: every step takes it, two passes are two steps
    assert round_updates(40, 16, 45, 2.0) == 5  # ceil(2 * 40 / 16)
    assert round_updates(720, 16, 45, 2.0) == 45  # enough pairs: the round's steps, no more
    assert round_updates(0, 16, 45, 2.0) == 1


def test_a_round_with_few_pairs_is_trained_on_them_epochs_per_round_times(tmp_path):
    model, tokenizer = build_tiny()
    cfg = config(rounds=2, steps_per_round=6, epochs_per_round=1.0, train={"batch_size": 64, "log_every": 1,
                                                                          "progress": False})
    OnlinePreferenceTrainer(cfg, model, tokenizer, tmp_path, reward_functions=[digit_fraction]).fit()
    assert rounds_logged(tmp_path, "round/updates") == [1, 1]  # fewer pairs than a batch: one pass, one step
    skipped = rounds_logged(tmp_path, "skipped_updates")
    assert skipped[-1] == 2 * 5, skipped  # the other 5 steps of each round made no update


def test_config_rules():
    with pytest.raises(ValueError, match="kto"):
        config(loss="kto")
    with pytest.raises(ValueError, match="oaif"):
        config(mode="oaif", steps_per_round=1, rollout={"samples": 4})
    assert config(mode="oaif", steps_per_round=1, rollout={}).rollout.samples == 2
    with pytest.raises(ValueError, match="threshold"):
        config(pairs={"rule": "threshold"})
    with pytest.raises(ValueError, match="valid names"):
        config(pairs={"rule": "nope"})
    with pytest.raises(ValueError, match="self_rewarding"):
        config(scorer={"kind": "judge", "judge": {"backend": "policy"}})
    with pytest.raises(ValueError, match=r"needs scorer\.kind 'judge'"):
        config(self_rewarding=True)
    cfg = config(rounds=4, steps_per_round=5)
    assert cfg.train.max_steps == 20 and cfg.train.save_every == 5  # a checkpoint at every round boundary


# ---- the built-in recipes, end to end (minutes each: python -m pytest -m slow) ----------------------------


def _run(name, tmp_path, *overrides):
    from tether.stages.pipeline import apply_recipe_overrides, load_recipe, run_recipe

    return run_recipe(apply_recipe_overrides(load_recipe(name), ["*.train.threads=1", *overrides]), tmp_path,
                      report=False)


@pytest.mark.slow
def test_online_dpo_arithmetic_recipe_gains_five_points_over_sft(tmp_path):
    figures = _run("online-dpo-arithmetic", tmp_path)["online_dpo"]
    assert [f"round_{r}/accuracy" in figures for r in (1, 2, 3)] == [True] * 3
    assert figures["round_3/accuracy"] >= figures["before/accuracy"] + 0.05, figures


@pytest.mark.slow
def test_oaif_arithmetic_recipe_judges_over_http(tmp_path):
    results = _run("oaif-arithmetic", tmp_path)
    judge = results["judge_eval"]  # the reasoning judge decides most held-out pairs, nearly all of them right
    assert judge["synthetic/decisive_accuracy"] >= 0.9 and judge["synthetic/verdict_accuracy"] >= 0.6, judge
    # tuned on the policy's own answers it ties two wrong ones: 0-2.7% (first machine, seeds 0-2). On the Zen 4
    # EPYC seed 0's judge, trained without answer_digit negatives, failed this (25.5%, seeds 1-4 1.6-5.7%); with
    # them (2026-12-07) seed 0 9.8%, seed 1 3.0% (docs/loops/online-dpo.md)
    tuned = results["judge_tuned_eval"]
    assert tuned["policy/decisive_accuracy"] >= 0.95 and tuned["policy_wrong/decisive_rate"] <= 0.1, tuned
    figures = results["oaif"]
    agreement = [v for k, v in figures.items() if k.endswith("audit/pair_agreement")]
    assert figures["accuracy"] > 0 and agreement and all(0 <= a <= 1 for a in agreement)
    log = (tmp_path / "oaif" / "judge-server.log").read_text()
    assert "listening on http://127.0.0.1:" in log
    assert len(list((tmp_path / "oaif" / "judge_cache").glob("*/*.json"))) > 0


@pytest.mark.slow
def test_self_rewarding_recipe_runs_with_the_policy_as_judge(tmp_path):
    results = _run("self-rewarding", tmp_path)
    judge, figures = results["judge_eval"], results["self_rewarding"]
    # judging in letter digits does not teach answering, and 150 IFT steps leave room: the seed model answered
    # 36-39% (2026-12-03, seeds 0-2). Its judge reads final answers only, so it cannot copy a wrong step: it
    # decided 91-95% of its own right-vs-wrong pairs, 98-100% of them right, and 5-13% of wrong-vs-wrong ones
    assert 0.25 <= figures["before/accuracy"] <= 0.6, figures
    assert judge["synthetic/decisive_accuracy"] >= 0.95 and judge["synthetic/decisive_rate"] >= 0.85, judge
    assert judge["policy/decisive_accuracy"] >= 0.95 and judge["policy_wrong/decisive_rate"] <= 0.2, judge
    assert figures["round_1/pairs"] > 100 and figures["round_1/audit/pair_agreement"] >= 0.95, figures
    assert figures["round_1/audit/chosen_mean"] >= 0.75, figures  # 80-94% of the pairs choose a right answer
    assert figures["accuracy"] > figures["before/accuracy"], figures  # +3.9 to +6.6 points in each of 3 seeds


def test_every_round_logs_the_sampler_trainer_mismatch(tmp_path):
    """The fp32 HF engine and the trainer's forward agree to float rounding on every round's samples."""
    model, tokenizer = build_tiny()
    OnlinePreferenceTrainer(config(rounds=2, mismatch_samples=32), model, tokenizer, tmp_path,
                            reward_functions=[digit_fraction]).fit()
    for key in ("mismatch/logprob_abs_diff_mean", "mismatch/kl_k3", "mismatch/is_ratio_mean"):
        assert len(rounds_logged(tmp_path, key)) == 2
    assert all(v <= 1e-5 for v in rounds_logged(tmp_path, "mismatch/logprob_abs_diff_max"))
    assert all(v > 0 for v in rounds_logged(tmp_path, "mismatch/tokens"))


def test_round_figures_count_a_decided_wrong_pair_against_the_chosen_mean():
    from tether.trainers.online_preference import round_figures

    samples = [{"score": s, "audit": a} for s, a in ((1.0, 1.0), (0.0, 0.0), (1.0, 0.0), (0.0, 0.0))]
    pairs = [{"prompt_id": 0, "chosen_score": 1.0, "rejected_score": 0.0, "chosen_audit": 1.0, "rejected_audit": 0.0},
             {"prompt_id": 1, "chosen_score": 1.0, "rejected_score": 0.0, "chosen_audit": 0.0, "rejected_audit": 0.0}]
    figures = round_figures(samples, pairs, [0, 1])
    # the audit cannot order the wrong-vs-wrong pair, so pair agreement is 1; half the pairs train toward a wrong one
    assert figures["audit/pair_agreement"] == 1.0 and figures["audit/pairs_decided"] == 1
    assert figures["audit/chosen_mean"] == 0.5 and figures["audit/rejected_mean"] == 0.0
    assert figures["audit/mean"] == 0.25 and figures["round/pair_margin"] == 1.0
