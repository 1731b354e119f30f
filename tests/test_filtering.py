"""Filtering a corpus: which records each check drops, counted per reason, and what survives."""

from __future__ import annotations

import pytest

from tether.filtering import (
    FilterConfig,
    build_scorer,
    filter_corpus,
    preference_pairs,
    sft_records,
    top_k_per_prompt,
)

GOOD = "<think>2+3=5 c0|</think>5"


def rec(pid: int, sample: int, completion: str, answer: str = "5", tokens: int = 10, finish: str = "stop") -> dict:
    return {"prompt_id": pid, "sample": sample, "prompt": f"p{pid}=", "completion": completion, "answer": answer,
            "tokens": tokens, "finish_reason": finish}


CORPUS = [
    rec(0, 0, GOOD),                                   # kept
    rec(0, 1, "   "),                                  # empty
    rec(0, 2, "<think>2+3=5 c0|</think>5", tokens=64, finish="length"),  # truncated
    rec(0, 3, GOOD, tokens=2),                         # too_short (same text as sample 0, but dropped earlier)
    rec(0, 4, "<think>2+3=6 c0|</think>6"),            # verifier (wrong)
    rec(1, 0, "5"),                                    # format (no think block)
    rec(1, 1, "<think>2+3=5</think>5", tokens=99),     # too_long
    rec(1, 2, "<think>2+3=5 c0|</think>  5"),          # kept (answer whitespace is fine)
    rec(1, 3, "<think>2+3=5   c0|</think>  5"),        # duplicate of sample 2 after whitespace normalisation
    rec(2, 0, "<think>x</think>7", answer="7"),        # kept
]


def test_each_reason_is_counted_once_in_order():
    cfg = FilterConfig(min_tokens=5, max_tokens=50, format="r1", verifier={"rewards": [{"name": "accuracy"}]})
    kept, summary = filter_corpus(CORPUS, cfg)
    assert [(r["prompt_id"], r["sample"]) for r in kept] == [(0, 0), (1, 2), (2, 0)]
    assert all(r["score/verifier"] == 1.0 for r in kept)
    assert summary == {"records": 10, "kept": 3, "kept_fraction": 0.3, "prompts": 3, "prompts_kept": 3,
                       "dropped/empty": 1, "dropped/truncated": 1, "dropped/too_short": 1, "dropped/too_long": 1,
                       "dropped/format": 1, "dropped/duplicate": 1, "dropped/verifier": 1}
    assert summary["records"] - summary["kept"] == sum(v for k, v in summary.items() if k.startswith("dropped/"))


def test_nothing_set_drops_only_empty_and_truncated_and_duplicates():
    _, summary = filter_corpus(CORPUS)
    assert summary["kept"] == 6 and summary["dropped/empty"] == 1 and summary["dropped/truncated"] == 1
    assert summary["dropped/duplicate"] == 2  # (0, 3) repeats (0, 0); (1, 3) repeats (1, 2)
    _, summary = filter_corpus(CORPUS, {"dedup": False, "drop_truncated": False})
    assert summary["kept"] == 9 and set(summary) >= {"dropped/empty"}


def fake_rm(records):
    """A reward model stand-in: score = the sample index (so the last samples rank highest)."""
    return [float(r["sample"]) for r in records]


def test_reward_model_threshold_then_top_k_per_prompt():
    corpus = [rec(p, s, f"<think>{p}{s}</think>5") for p in range(3) for s in range(4)]
    cfg = FilterConfig(reward_model={"path": "unused", "threshold": 1.0, "top_k": 2})
    kept, summary = filter_corpus(corpus, cfg, scorers={"reward_model": fake_rm})
    # threshold drops sample 0 of each prompt (3), top-2 of the remaining {1, 2, 3} keeps 2 and 3 (drops 3)
    assert [(r["prompt_id"], r["sample"]) for r in kept] == [(p, s) for p in range(3) for s in (2, 3)]
    assert summary["dropped/reward_threshold"] == 3 and summary["dropped/reward_top_k"] == 3
    assert [r["score/reward_model"] for r in kept] == [2.0, 3.0] * 3


def test_max_per_prompt_keeps_the_best_by_verifier_then_file_order():
    corpus = [rec(0, 0, "<think></think>4"), rec(0, 1, "<think></think>5"), rec(0, 2, "<think>a</think>5"),
              rec(1, 0, "<think></think>5")]
    kept, summary = filter_corpus(corpus, FilterConfig(verifier={"min_score": 0.0}, max_per_prompt=1))
    assert [(r["prompt_id"], r["sample"]) for r in kept] == [(0, 1), (1, 0)]  # RAFT: the best, earliest on ties
    assert summary["dropped/max_per_prompt"] == 2


def test_top_k_ties_go_to_the_earlier_record():
    records = [{"prompt_id": 0}, {"prompt_id": 0}, {"prompt_id": 1}, {"prompt_id": 0}]
    assert top_k_per_prompt(records, [1.0, 3.0, 0.0, 1.0], 2) == [True, True, True, False]


def test_verifier_scorer_reads_the_answer_column_and_none_fails_the_filter():
    score = build_scorer({"kind": "rewards", "rewards": [{"name": "accuracy"}]})
    assert score([rec(0, 0, GOOD), rec(0, 1, GOOD, answer="6")]) == [1.0, 0.0]
    kept, summary = filter_corpus([rec(0, 0, GOOD, answer=None)], FilterConfig(verifier={}))
    assert kept == [] and summary["dropped/verifier"] == 1


def judge_replies(prompts: list[str]) -> list[str]:
    """A judge: 'Score: 9' for responses ending in 5, 'Score: 2' otherwise, garbage for GARBLE."""
    return ["garbled" if "GARBLE" in p else f"Score: {9 if p.rstrip().endswith('5') else 2}" for p in prompts]


def test_judge_scorer_scores_pointwise_and_missing_replies_are_none():
    judge = {"kind": "pointwise", "backend": "callable", "template": "Q {prompt} A {response}",
             "model": f"{__name__}:judge_replies"}
    score = build_scorer({"kind": "judge", "judge": judge})
    assert score([rec(0, 0, GOOD), rec(0, 1, "<think></think>4"), rec(0, 2, "GARBLE")]) == [9.0, 2.0, None]
    with pytest.raises(ValueError, match="pointwise"):
        build_scorer({"kind": "judge", "judge": {**judge, "kind": "pairwise"}})
    with pytest.raises(ValueError, match="needs a judge block"):
        build_scorer({"kind": "judge"})


def test_sft_records_and_pairs():
    chat = sft_records([rec(0, 0, GOOD)], chat=True)[0]
    assert chat["prompt"] == [{"role": "user", "content": "p0="}]
    assert chat["completion"] == [{"role": "assistant", "content": GOOD}]
    records = [rec(0, s, f"c{s}") for s in range(5)] + [rec(1, 0, "d0"), rec(1, 1, "d1")]
    scores = [0.0, 1.0, 1.0, 0.0, None, 1.0, 1.0]
    pairs = preference_pairs(records, scores, max_per_prompt=3)
    # prompt 0: every right one (c1, c2) against every wrong one (c0, c3), c4 unscored, first three kept;
    # prompt 1 has no score gap
    assert [(p["chosen"], p["rejected"]) for p in pairs] == [("c1", "c0"), ("c1", "c3"), ("c2", "c0")]
    assert {p["prompt"] for p in pairs} == {"p0="}
    assert len(preference_pairs(records, scores, rule="best_vs_worst")) == 1


def test_rso_thins_each_prompt_before_pairing():
    from tether.config.rewards import RSOConfig

    records = [rec(p, s, f"c{p}{s}") for p in range(20) for s in range(6)]
    scores = [float(s % 3) for _ in range(20) for s in range(6)]  # rewards 0, 1, 2, 0, 1, 2 per prompt
    rso = RSOConfig(beta=0.5, samples=2, seed=1)
    pairs = preference_pairs(records, scores, rule="all_pairs", rso=rso)
    per_prompt = {}
    for p in pairs:
        per_prompt[p["prompt"]] = per_prompt.get(p["prompt"], 0) + 1
    assert pairs and max(per_prompt.values()) == 1  # two kept samples make at most one pair
    assert pairs == preference_pairs(records, scores, rule="all_pairs", rso=rso)  # deterministic
    # the tilted samples favour high rewards: most chosen completions score 2
    best = sum(p["chosen"].endswith(("2", "5")) for p in pairs)
    assert best / len(pairs) > 0.7
