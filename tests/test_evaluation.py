"""Held-out figures carry n, Wilson intervals and, evaluated before and after, a paired gain."""

import json

import pytest
import torch

from tether.core.statistics import paired_bootstrap_interval, wilson_interval
from tether.evaluation import Figures, paired_gains, pass_at_k, with_intervals
from tether.models import build_tiny
from tether.tasks import get_task, sft_records
from tether.trainers.sft import SFTConfig, SFTTrainer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_with_intervals_adds_n_and_wilson_bounds():
    outcomes = {"accuracy": [1.0] * 8 + [0.0] * 2, "pass@4": [1.0] * 10}
    figures = with_intervals({"accuracy": 0.8, "pass@4": 1.0}, outcomes)
    assert isinstance(figures, Figures) and figures.outcomes == outcomes
    assert figures["n"] == 10.0
    assert figures["accuracy_ci95_low"] == pytest.approx(0.49016, abs=1e-4)  # by hand in test_statistics
    assert figures["accuracy_ci95_high"] == pytest.approx(0.94332, abs=1e-4)
    assert (figures["pass@4_ci95_low"], figures["pass@4_ci95_high"]) == wilson_interval(10, 10)


def test_paired_gains_only_for_rates_on_the_same_problems():
    before = {"accuracy": [0, 1, 0, 0], "pass@4": [1, 1]}
    after = {"accuracy": [1, 1, 0, 1], "pass@4": [1, 1, 1], "success": [1, 1, 1, 1]}
    gains = paired_gains(before, after)
    assert set(gains) == {"gain/accuracy", "gain/accuracy_ci95_low", "gain/accuracy_ci95_high"}
    assert gains["gain/accuracy"] == pytest.approx(0.5)
    assert (gains["gain/accuracy"], gains["gain/accuracy_ci95_low"], gains["gain/accuracy_ci95_high"]) == \
        paired_bootstrap_interval(before["accuracy"], after["accuracy"])


def test_pass_at_k_with_k_equal_n_is_a_per_problem_outcome():
    assert [pass_at_k(4, c, 4) for c in range(5)] == [0.0, 1.0, 1.0, 1.0, 1.0]


def test_a_stage_evaluated_before_and_after_reports_n_intervals_and_its_paired_gain(tmp_path):
    cfg = SFTConfig(name="sft", data={"task": {"name": "arithmetic", "n": 64}, "pack_length": 128},
                    train={"max_steps": 8, "batch_size": 8, "log_every": 1, "progress": False},
                    optim={"lr": 3e-3, "schedule": "constant"}, report_to=[],
                    eval={"n": 24, "max_new_tokens": 8, "before": True})
    model, tokenizer = build_tiny("tiny", seed=0)
    records = sft_records(get_task("arithmetic", digits=2), 64, seed=0)
    trainer = SFTTrainer(cfg, model, tokenizer, tmp_path, records=records)
    results = trainer.train()
    assert results["n"] == results["before/n"] == 24.0
    for prefix in ("", "before/"):
        low, high = results[f"{prefix}accuracy_ci95_low"], results[f"{prefix}accuracy_ci95_high"]
        assert low <= results[f"{prefix}accuracy"] <= high and high - low > 0
    assert results["gain/accuracy"] == pytest.approx(results["accuracy"] - results["before/accuracy"])
    assert results["gain/accuracy_ci95_low"] <= results["gain/accuracy"] <= results["gain/accuracy_ci95_high"]
    before = json.loads((trainer.stage_dir / "eval_before.json").read_text())
    assert len(before["accuracy"]) == 24 and sum(before["accuracy"]) / 24 == results["before/accuracy"]


def test_evaluation_reports_progress_lines_and_the_same_figures_with_or_without(monkeypatch, capsys):
    from tether.config.common import EvalConfig
    from tether.evaluation import evaluate_task
    from tether.runtime import progress

    model, tokenizer = build_tiny("tiny", seed=0)
    cfg = EvalConfig(n=6, max_new_tokens=4, batch_size=2, samples=2)
    quiet = evaluate_task(model, tokenizer, cfg, progress=False)
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    shown = evaluate_task(model, tokenizer, cfg, label="sft eval")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sft eval:")]
    done = [int(line.split()[2].split("/")[0]) for line in lines]
    assert done == [2, 4, 6, 8, 10, 12, 14, 16, 18] and all("/18 samples (" in line for line in lines)
    assert dict(shown) == dict(quiet)  # progress reporting changes nothing


def test_progress_lines_wait_for_the_interval_and_report_the_end():
    from tether.runtime.progress import ProgressLines, format_duration

    printed = []
    lines = ProgressLines("x", 4, "items", every=3600)
    lines.console = type("C", (), {"print": lambda self, line, **_: printed.append(line)})()
    lines.update(1)
    lines.update(4)  # finished quickly: no line at all
    assert printed == []
    lines.began -= 7200
    lines.update(4)  # finished after the interval: one closing line
    assert len(printed) == 1 and printed[0].startswith("x: 4/4 items (100%), ") and printed[0].endswith("0s left")
    assert (format_duration(65), format_duration(42), format_duration(3725), format_duration(float("inf"))) == \
        ("1m05s", "42s", "1h02m", "?")


def test_majority_answer_by_hand():
    from tether.evaluation import majority_answer

    texts = ["<think>a</think>42", "<think>b</think> 41", "<think>c</think>41 ", "<think>d</think>42"]
    assert majority_answer(texts) == "<think>a</think>42"  # a 2-2 tie goes to the answer seen first
    assert majority_answer([*texts, "<think>e</think>41"]) == "<think>b</think> 41"  # 41 now wins 3-2
    assert majority_answer(["7"]) == "7"
    with pytest.raises(ValueError):
        majority_answer([])


def test_pass_and_majority_at_k_come_with_their_intervals():
    from tether.config.common import EvalConfig
    from tether.evaluation import evaluate_task

    model, tokenizer = build_tiny("tiny", seed=0)
    figures = evaluate_task(model, tokenizer, EvalConfig(n=8, max_new_tokens=4, samples=3), progress=False)
    for name in ("pass@3", "maj@3"):
        assert 0 <= figures[f"{name}_ci95_low"] <= figures[name] <= figures[f"{name}_ci95_high"] <= 1
        assert len(figures.outcomes[name]) == 8
    assert figures["maj@3"] <= figures["pass@3"]  # the majority is one of the k: it can only pass if one does


def test_perplexity_of_held_out_texts_matches_a_plain_forward_pass():
    """Completion tokens + EOS of a prompt/completion record and every token but BOS of a text record, pooled
    over tokens: the same figure as one unpacked forward per sequence with the loss summed by hand."""
    import math

    import torch.nn.functional as F

    from tether.core.likelihood_metrics import perplexity
    from tether.data import tokenize_sft, tokenize_text
    from tether.evaluation import text_likelihoods

    model, tokenizer = build_tiny("tiny", seed=0)
    model.eval()
    texts = [{"prompt": "12+3=", "completion": "15"}, {"text": "7*8=56"}, {"prompt": "9-4=", "completion": "5"}]
    got = text_likelihoods(model, tokenizer, texts, batch_size=2)
    nll, tokens = 0.0, 0
    for example in [tokenize_sft(texts[0], tokenizer, max_length=64), *tokenize_text(texts[1], tokenizer, max_length=64),
                    tokenize_sft(texts[2], tokenizer, max_length=64)]:
        logits = model(torch.tensor([example.input_ids])).logits[0, :-1]
        labels = torch.tensor(example.labels[1:])
        nll += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
        tokens += int((labels != -100).sum())
    assert int(got.tokens.sum()) == tokens
    assert float(perplexity(-got.logprob, got.tokens)) == pytest.approx(math.exp(nll / tokens), rel=1e-5)


def test_sampled_likelihoods_are_the_samplers_own_log_probs_at_temperature_one():
    from tether.evaluation import sample_likelihoods
    from tether.rollout import HFEngine, SamplingParams

    model, tokenizer = build_tiny("tiny", seed=0)
    ids = [[tokenizer.bos_token_id, *tokenizer("3+4=", add_special_tokens=False)["input_ids"]]] * 2
    rollout = HFEngine(model, tokenizer, batch_size=4).generate(ids, SamplingParams(n=3, temperature=1.0,
                                                                                    max_new_tokens=6, seed=1))
    got = sample_likelihoods(model, tokenizer, rollout, [0.0] * 6, batch_size=4)
    expected = torch.tensor([sum(lp) for lp in rollout.completion_logprobs], dtype=torch.float64)
    assert torch.allclose(got.logprob, expected, atol=1e-4)
    assert got.groups.tolist() == [0, 0, 0, 1, 1, 1] and got.tokens.tolist() == [len(c) for c in rollout.completion_ids]


def test_likelihood_metrics_in_an_evaluation_and_a_reward_function_to_rank_by():
    from tether.config.common import EvalConfig
    from tether.evaluation import evaluate_task

    model, tokenizer = build_tiny("tiny", seed=0)
    cfg = EvalConfig(n=4, max_new_tokens=6, samples=3, metrics=["perplexity", "likelihood_reward_agreement"])
    figures = evaluate_task(model, tokenizer, cfg, progress=False,
                            reward_fn=lambda prompts, completions, answer: [float(len(c)) for c in completions])
    assert figures["perplexity"] > 1 and figures["perplexity/tokens"] > 0
    assert 0 <= figures["likelihood_reward_agreement"] <= 1 and figures["likelihood_reward_agreement/pairs"] > 0
    same = evaluate_task(model, tokenizer, cfg, progress=False,
                         reward_fn=lambda prompts, completions, **columns: [1.0] * len(completions))
    assert same["likelihood_reward_agreement/pairs"] == 0 and same["likelihood_reward_agreement"] != \
        same["likelihood_reward_agreement"]  # NaN: no pair with different rewards
    with pytest.raises(ValueError, match="return one per completion"):
        evaluate_task(model, tokenizer, cfg, progress=False, reward_fn=lambda prompts, completions, **c: [1.0])


def test_sft_lowers_held_out_perplexity(tmp_path):
    cfg = SFTConfig(name="sft", data={"task": {"name": "arithmetic", "n": 64}, "pack_length": 128},
                    train={"max_steps": 8, "batch_size": 8, "log_every": 1, "progress": False},
                    optim={"lr": 3e-3, "schedule": "constant"}, report_to=[],
                    eval={"n": 16, "max_new_tokens": 4, "before": True, "metrics": ["perplexity"]})
    model, tokenizer = build_tiny("tiny", seed=0)
    trainer = SFTTrainer(cfg, model, tokenizer, tmp_path, records=sft_records(get_task("arithmetic"), 64, seed=0))
    results = trainer.train()
    assert results["perplexity"] < 0.5 * results["before/perplexity"], results
    assert results["perplexity/tokens"] == results["before/perplexity/tokens"] > 16  # the same reference texts
