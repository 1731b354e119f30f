"""The ``judge_eval`` stage: a judge's held-out verdict accuracy and position consistency, checked with judges
whose answers are known (an oracle that reads the sum, one that always names the first response)."""

import re
import sys
import types

import pytest

from tether.config.base import ConfigError
from tether.config.preference import JudgeEvalConfig
from tether.data.files import read_jsonl
from tether.models.tiny import save_tiny
from tether.rewards.judge import PairwiseJudge, PointwiseJudge
from tether.stages.judge_data import VERDICTS_FILE, judge_figures, run_judge_eval, synthetic_pairs
from tether.tasks import get_task
from tether.trainers.checkpoint import read_done

ANSWER = re.compile(r"</think>(\d+)")


def _truth(prompt: str) -> str:
    a, b = re.search(r"(\d+)\+(\d+)=", prompt).groups()
    return str(int(a) + int(b))


def oracle_pairwise(prompts: list[str]) -> list[str]:
    out = []
    for prompt in prompts:
        shown = {line[:2]: line[2:].rsplit("</think>", 1)[-1].strip() for line in prompt.split("\n")
                 if line[:2] in ("A:", "B:")}
        a, b = shown["A:"], shown["B:"]
        truth = _truth(prompt)
        out.append("[[A]]" if a == truth and b != truth else "[[B]]" if b == truth and a != truth else "[[C]]")
    return out


def oracle_pointwise(prompts: list[str]) -> list[str]:
    return [f"Score: {int(ANSWER.findall(p)[0] == _truth(p))}" for p in prompts]


def greater_text(prompts: list[str]) -> list[str]:
    """Whichever response sorts later as text, in either order: decides every pair of different responses."""
    out = []
    for prompt in prompts:
        shown = {line[:2]: line[2:] for line in prompt.split("\n") if line[:2] in ("A:", "B:")}
        out.append("[[A]]" if shown["A:"] > shown["B:"] else "[[B]]" if shown["B:"] > shown["A:"] else "[[C]]")
    return out


@pytest.fixture
def judges(monkeypatch):
    module = types.ModuleType("eval_judges")
    module.oracle_pairwise, module.oracle_pointwise = oracle_pairwise, oracle_pointwise
    module.first_always = lambda prompts: ["[[A]]"] * len(prompts)
    module.greater_text = greater_text
    monkeypatch.setitem(sys.modules, "eval_judges", module)


def test_judge_figures_of_known_judges():
    task = get_task("arithmetic", digits=2)
    pairs = synthetic_pairs(task, JudgeEvalConfig(judge={"backend": "callable", "model": "m:f"},
                                                  task={"eval_n": 40}).task)
    assert len(pairs) == 40 and all(task.verify(right, _truth(p)) == 1.0 != task.verify(wrong, _truth(p))
                                    for p, right, wrong in pairs)
    oracle = judge_figures(PairwiseJudge(oracle_pairwise, template="compact-pairwise"), pairs)
    assert oracle == {"verdict_accuracy": 1.0, "decisive_rate": 1.0, "decisive_accuracy": 1.0,
                      "position_consistency": 1.0, "first_position_rate": 0.5, "pairs": 40.0}
    biased = judge_figures(PairwiseJudge(lambda ps: ["[[A]]"] * len(ps), template="compact-pairwise"), pairs)
    assert biased == {"verdict_accuracy": 0.0, "decisive_rate": 0.0, "position_consistency": 0.0,
                      "first_position_rate": 1.0, "pairs": 40.0}
    scores = judge_figures(PointwiseJudge(oracle_pointwise, template="compact-pointwise", scale=(0, 1)), pairs)
    assert scores == {"verdict_accuracy": 1.0, "decisive_rate": 1.0, "decisive_accuracy": 1.0, "pairs": 40.0}


def test_judge_figures_record_each_pair_with_what_the_judge_wrote():
    task = get_task("arithmetic", digits=2)
    pairs = synthetic_pairs(task, JudgeEvalConfig(judge={"backend": "callable", "model": "m:f"},
                                                  task={"eval_n": 5}).task)
    pairwise = PairwiseJudge(oracle_pairwise, template="compact-pairwise")
    rows: list[dict] = []
    assert judge_figures(pairwise, pairs, rows)["verdict_accuracy"] == 1.0
    assert pairwise.transcript is None  # recording stops with the call
    assert [(r["prompt"], r["responses"]) for r in rows] == [(p, [right, wrong]) for p, right, wrong in pairs]
    assert all(r["verdicts"] == ["A", "B"] and r["replies"] == [["[[A]]"], ["[[B]]"]] for r in rows)
    rows = []
    judge_figures(PointwiseJudge(oracle_pointwise, template="compact-pointwise", scale=(0, 1)), pairs, rows)
    assert all(r["scores"] == [1.0, 0.0] and r["replies"] == [["Score: 1"], ["Score: 0"]] for r in rows)
    assert [r["responses"] for r in rows] == [[right, wrong] for _, right, wrong in pairs]


def test_judge_eval_stage_reports_synthetic_and_policy_figures(tmp_path, judges):
    policy = save_tiny(tmp_path / "untrained")
    cfg = JudgeEvalConfig(name="judge_eval", judge={"backend": "callable", "model": "eval_judges:oracle_pairwise",
                                                    "template": "compact-pairwise"},
                          task={"name": "arithmetic", "options": {"digits": 2}, "eval_n": 30},
                          policy={"model": str(policy), "n": 8, "samples": 2, "sampling": {"max_new_tokens": 4}})
    results = run_judge_eval(cfg, tmp_path, resume=False)
    assert results["synthetic/verdict_accuracy"] == 1.0 and results["synthetic/pairs"] == 30
    # an untrained model answers nothing right: it gives no right-and-wrong prompt to judge, only wrong pairs,
    # which the oracle ties
    assert results["policy/sample_accuracy"] == 0.0 and results["policy/pairs"] == 0.0
    assert results["policy/wrong_pairs"] > 0 and results["policy_wrong/decisive_rate"] == 0.0
    assert read_done(tmp_path / "judge_eval")["results"] == results
    verdicts = read_jsonl(tmp_path / "judge_eval" / VERDICTS_FILE)  # every pair, with the judge's replies
    assert [v["source"] for v in verdicts] == ["synthetic"] * 30 + ["policy_wrong"] * int(results["policy/wrong_pairs"])
    assert all(v["verdicts"] == ["A", "B"] for v in verdicts if v["source"] == "synthetic")
    assert all(v["verdicts"] == ["tie", "tie"] and v["replies"] == [["[[C]]"], ["[[C]]"]]
               for v in verdicts if v["source"] == "policy_wrong")
    cfg.judge.model = "eval_judges:greater_text"  # decides every pair of two different wrong answers
    assert run_judge_eval(cfg, tmp_path, resume=False)["policy_wrong/decisive_rate"] == 1.0
    decided = [v for v in read_jsonl(tmp_path / "judge_eval" / VERDICTS_FILE) if v["source"] == "policy_wrong"]
    assert decided and all(sorted(v["verdicts"]) == ["A", "B"] for v in decided)  # one side in both orders
    cfg.task.eval_n = 0
    with pytest.raises(ConfigError, match="no pairs"):
        run_judge_eval(cfg, tmp_path, resume=False)


def test_answers_only_synthetic_pairs_are_the_final_answers():
    task = get_task("arithmetic", digits=2)
    source = JudgeEvalConfig(judge={"backend": "callable", "model": "m:f"}, task={"eval_n": 20}).task
    for (prompt, right, wrong), (_, bare_right, bare_wrong) in zip(
            synthetic_pairs(task, source), synthetic_pairs(task, source, answers_only=True), strict=True):
        assert right.endswith(f"</think>{bare_right}") and wrong.endswith(f"</think>{bare_wrong}")
        assert bare_right == _truth(prompt) != bare_wrong
