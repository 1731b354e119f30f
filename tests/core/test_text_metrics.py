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
    with pytest.raises(ValueError, match="unknown metric 'nope'; valid: distinct, language_consistency, length_by_outcome, likelihood_reward_agreement, perplexity, reflection"):
        EvalConfig(metrics=["nope"])


def test_language_consistency_by_hand():
    from tether.core.text_metrics import cot_consistency, language_consistency, thinking_text

    # words: 7, 5, 12, 1 (c1: the c is no digit of either vocabulary) -> all own
    assert language_consistency("7+5=12 c1|") == 1.0
    # H, F, BC, B in letters; 12 in digits -> 1 of 5
    assert language_consistency("H+F=BC cB|12") == pytest.approx(1 / 5)
    # a word mixing both vocabularies (1B) is not in the target one: 7 and 5 of 7, 5, 1B
    assert language_consistency("7+5=1B") == pytest.approx(2 / 3)
    assert language_consistency("no numbers here") is None
    assert language_consistency("xy 12", own="xy", other="12") == 0.5  # other vocabularies
    with pytest.raises(ValueError, match="share characters"):
        language_consistency("1", own="01", other="1A")
    assert thinking_text("<think>a</think>b") == "a" and thinking_text("<think>open") == "open"
    assert thinking_text("no tags") is None
    # only the chain of thought counts: the answer after </think> is left out
    assert cot_consistency("<think>H+F=BC cB|</think>12") == 0.0
    assert cot_consistency("12") is None and cot_consistency("<think>ok</think>12") is None


def test_language_consistency_metric_by_hand():
    out = TEXT_METRICS.get("language_consistency")(["<think>1+A=B</think>2", "<think>3</think>3", "7"], [0, 1, 0])
    # 1/3 and 1; the third has no chain of thought
    assert out == {"consistency": pytest.approx(2 / 3), "consistency/n": 2.0}
    assert math.isnan(TEXT_METRICS.get("language_consistency")(["7"], [1])["consistency"])
