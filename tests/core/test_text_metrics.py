"""Text metrics of completions: hand-computed values."""

import math

import pytest

from tether.core.text_metrics import TEXT_METRICS, distinct_n


def test_distinct_n_by_hand():
    texts = ["a b a", "a b c"]
    # unigrams: a b a a b c -> 3 distinct of 6; bigrams: (a b) (b a) (a b) (b c) -> 3 distinct of 4
    assert distinct_n(texts, 1) == pytest.approx(0.5) and distinct_n(texts, 2) == pytest.approx(0.75)
    assert distinct_n(["one"], 2) == 0.0 and distinct_n([], 1) == 0.0
    assert TEXT_METRICS.get("distinct")(texts, [1, 0]) == {"distinct_1": 0.5, "distinct_2": 0.75}


def test_length_by_outcome_by_hand():
    out = TEXT_METRICS.get("length_by_outcome")(["abcd", "ab", "abcdef"], [1.0, 0.0, 1.0])
    assert out == {"length/correct": 5.0, "length/incorrect": 2.0}
    assert math.isnan(TEXT_METRICS.get("length_by_outcome")(["ab"], [1.0])["length/incorrect"])


def test_reflection_words_by_hand():
    texts = ["Wait, let me check again.", "42", "waiting is not a reflection word; verify!"]
    # 1: wait, check, again (3); 2: none; 3: verify (1; "waiting" is not the word "wait")
    out = TEXT_METRICS.get("reflection")(texts, [1, 1, 0])
    assert out == {"reflection/words": pytest.approx(4 / 3), "reflection/share": pytest.approx(2 / 3)}


def test_an_evaluation_reports_the_metrics_it_is_asked_for():
    from tether.config.common import EvalConfig
    from tether.evaluation import evaluate_task
    from tether.models import build_tiny

    model, tokenizer = build_tiny("tiny", seed=0)
    figures = evaluate_task(model, tokenizer, EvalConfig(n=6, max_new_tokens=4, metrics=["distinct", "reflection"]),
                            progress=False)
    assert {"distinct_1", "distinct_2", "reflection/words", "reflection/share"} <= set(figures)
    assert "length/correct" not in figures
    with pytest.raises(ValueError, match="unknown metric 'nope'; valid: distinct, length_by_outcome, likelihood_reward_agreement, perplexity, reflection"):
        EvalConfig(metrics=["nope"])
