"""LLM judges: parsing, templates, position swap, missing replies, and the endpoint path (cache, 500s,
garbage, an endpoint that goes down mid-run) against a scripted server on a loopback port."""

import re
import sys
import types

import pytest

from tether.config.rewards import JudgeConfig, JudgeSamplingConfig
from tether.rewards.judge import (
    EndpointJudgeBackend,
    PairwiseJudge,
    PointwiseJudge,
    load_template,
    parse_score,
    parse_verdict,
    render_template,
    template_names,
)
from tether.rewards.judge_records import answer_check, judge_records, pointwise_reply
from tether.rollout import EndpointError, OpenAIEngine
from tether.scoring import build_judge
from tether.tasks import get_task


def test_parse_score_reads_the_last_score_in_range():
    assert parse_score("Good answer.\nScore: 7", 1, 10) == 7.0
    assert parse_score("Score: 3 at first... final **Rating: 8/10**", 1, 10) == 8.0
    assert parse_score("  4.5 ", 1, 10) == 4.5  # a bare number
    assert parse_score("1", 0, 1) == 1.0
    assert parse_score("Score: 11", 1, 10) is None  # off the scale: missing, not clipped
    assert parse_score("It deserves a 7 I think", 1, 10) is None  # no score marker, not only a number
    assert parse_score("", 1, 10) is None


def test_parse_verdict_reads_brackets_phrases_and_bare_letters():
    assert parse_verdict("A is verbose, B is right. [[B]]") == "B"
    assert parse_verdict("[[A]] ... on reflection [[C]]") == "tie"  # the last verdict counts
    assert parse_verdict("Verdict: Assistant A") == "A"
    assert parse_verdict("The better response is B.") == "B"
    assert parse_verdict("A") == "A" and parse_verdict(" (B) ") == "B"
    assert parse_verdict("A good answer would explain more") is None  # a leading word "A" is not a verdict
    assert parse_verdict("xq7") is None and parse_verdict("AB") is None


def test_templates_are_package_files_with_placeholders():
    assert {"pointwise", "pairwise", "self-rewarding", "compact-pointwise", "compact-pairwise"} <= set(template_names())
    text = render_template(load_template("pairwise"), prompt="2+2=", response_a="4", response_b="{prompt}")
    assert "[[A]]" in text and "2+2=" in text and "principle" not in text.lower()
    # a response holding a placeholder is left as it is (filled once, in a fixed order)
    assert "{prompt}" in text
    with_rule = render_template(load_template("pointwise"), prompt="q", response="r", principle="Be brief.",
                                scale=(1, 10))
    assert "Be brief." in with_rule and "scale of 1 to 10" in with_rule
    with pytest.raises(ValueError, match="built-in"):
        load_template("no-such-template")


def _prefers(word):
    """A pairwise judge function that answers A or B for whichever response holds ``word``."""
    def judge(prompts):
        out = []
        for p in prompts:
            a = re.search(r"A:(.*)\nB:", p, re.S)[1]
            out.append("A" if word in a else "B")
        return out
    return judge


def test_position_swap_keeps_consistent_verdicts_and_ties_the_rest():
    judge = PairwiseJudge(_prefers("good"), template="compact-pairwise")
    values = judge.compare(["q1", "q2"], ["good", "bad"], ["bad", "good"])
    assert values == [1.0, 0.0]
    metrics = judge.take_metrics()
    assert metrics["judge/consistency"] == 1.0 and metrics["judge/replies"] == 4 and metrics["judge/ties"] == 0

    biased = PairwiseJudge(lambda prompts: ["A"] * len(prompts), template="compact-pairwise")  # always the first
    assert biased.compare(["q1", "q2", "q3"], ["x", "y", "z"], ["u", "v", "w"]) == [0.5, 0.5, 0.5]
    metrics = biased.take_metrics()
    assert metrics["judge/consistency"] == 0.0 and metrics["judge/ties"] == 3 and metrics["judge/judged"] == 3

    unswapped = PairwiseJudge(lambda prompts: ["A"] * len(prompts), template="compact-pairwise", swap=False)
    assert unswapped.compare(["q"], ["x"], ["y"]) == [1.0]  # without the swap the bias goes through
    assert "judge/consistency" not in unswapped.take_metrics()


def test_unparseable_replies_are_counted_and_scored_missing():
    replies = iter(["Score: 9", "no idea", "Score: 4", "Score: 99"])
    judge = PointwiseJudge(lambda prompts: [next(replies) for _ in prompts], template="pointwise")
    assert judge.score(["a", "b", "c", "d"], ["1", "2", "3", "4"]) == [9.0, None, 4.0, None]
    metrics = judge.take_metrics()
    assert metrics["judge/unparseable"] == 2 and metrics["judge/missing"] == 2
    assert metrics["judge/unparseable_rate"] == 0.5
    # as a reward function (the reward protocol) and averaged over samples
    averaged = PointwiseJudge(lambda prompts: None, template="pointwise", samples=2)
    averaged.backend = lambda prompts, n: [["Score: 2", "Score: 6"], ["??", "Score: 3"]][: len(prompts)]
    assert averaged(["p", "q"], ["r", "s"], answer=["x", "y"]) == [4.0, 3.0]

    pairwise = PairwiseJudge(lambda prompts: ["[[A]]", "garbage"][: len(prompts)], template="pairwise")
    assert pairwise.compare(["q"], ["a"], ["b"]) == [None]  # one order unreadable: the pair is missing
    assert pairwise.take_metrics()["judge/missing"] == 1


def _verdict_by_digits(body):
    """Scripted judge endpoint: prefers the response with more digits (compact pairwise template)."""
    prompt = body["prompt"]
    a, b = re.search(r"A:(.*)\nB:(.*)\nBetter:", prompt, re.S).groups()
    return "A" if sum(c.isdigit() for c in a) > sum(c.isdigit() for c in b) else "B"


def _endpoint_judge(url, cache_dir, **engine):
    engine = OpenAIEngine(url, "judge", cache_dir=cache_dir, backoff=0.001, **engine)
    return PairwiseJudge(EndpointJudgeBackend(engine, sampling=JudgeSamplingConfig(max_new_tokens=4)), template="compact-pairwise"), engine


def test_judgments_over_http_are_cached_and_survive_500s(fake_endpoint, tmp_path):
    server = fake_endpoint(_verdict_by_digits, faults=[500, 503])
    judge, engine = _endpoint_judge(server.base_url, tmp_path / "cache", concurrency=1, max_retries=3)
    prompts, a, b = ["1+1=", "2+2="], ["2", "x"], ["y", "44"]
    assert judge.compare(prompts, a, b) == [1.0, 0.0]
    assert engine.stats["retries"] == 2 and engine.stats["requests"] == 4 and len(server.requests) == 6
    # the same judgments again: every reply from the cache, no request sent, even with the server gone
    server.stop()
    again, engine2 = _endpoint_judge(server.base_url, tmp_path / "cache")
    assert again.compare(prompts, a, b) == [1.0, 0.0]
    assert engine2.stats["cache_hits"] == 4 and engine2.stats["requests"] == 0


def test_garbage_text_is_unparseable_but_garbage_bodies_are_retried(fake_endpoint, tmp_path):
    server = fake_endpoint(lambda body: "I cannot decide, both are lovely")
    judge, engine = _endpoint_judge(server.base_url, tmp_path / "c1")
    assert judge.compare(["q", "r"], ["a", "b"], ["c", "d"]) == [None, None]
    assert judge.take_metrics()["judge/unparseable"] == 4
    assert engine.stats["retries"] == 0 and len(server.requests) == 4  # a readable reply is not asked again

    broken = fake_endpoint(_verdict_by_digits, faults=["garbage"] * 3)
    judge, engine = _endpoint_judge(broken.base_url, tmp_path / "c2", concurrency=1, max_retries=4)
    assert judge.compare(["q"], ["11"], ["x"]) == [1.0]
    assert engine.stats["bad_responses"] == 3 and engine.stats["retries"] == 3


def test_endpoint_down_mid_run_is_a_clear_error_and_nothing_judged_is_lost(fake_endpoint, tmp_path):
    server = fake_endpoint(_verdict_by_digits)
    judge, engine = _endpoint_judge(server.base_url, tmp_path / "cache", concurrency=1, max_retries=2)
    prompts = [f"{i}+{i}=" for i in range(4)]
    a, b = ["12", "x", "345", "y"], ["z", "67", "w", "8"]
    assert judge.compare(prompts[:2], a[:2], b[:2]) == [1.0, 0.0]
    server.stop()  # the endpoint goes away
    with pytest.raises(EndpointError, match=r"4 of 8 requests failed; the 4 answered are cached in .*failed after 3 attempts"):
        judge.compare(prompts, a, b)
    assert engine.stats["failed"] == 4 and engine.stats["cache_hits"] == 4
    # back up on another port: only the 4 replies never received are asked for
    revived = fake_endpoint(_verdict_by_digits)
    judge, engine = _endpoint_judge(revived.base_url, tmp_path / "cache")
    assert judge.compare(prompts, a, b) == [1.0, 0.0, 1.0, 0.0]
    assert len(revived.requests) == 4 and engine.stats["cache_hits"] == 4


def test_build_judge_from_a_config_with_a_callable_backend(monkeypatch):
    module = types.ModuleType("my_judges")
    module.first_always = lambda prompts: ["[[A]]"] * len(prompts)
    monkeypatch.setitem(sys.modules, "my_judges", module)
    judge = build_judge({"kind": "pairwise", "backend": "callable", "model": "my_judges:first_always"})
    assert isinstance(judge, PairwiseJudge) and judge.compare(["q"], ["a"], ["b"]) == [0.5]
    assert judge.take_metrics()["judge/consistency"] == 0.0
    with pytest.raises(ValueError, match="base_url"):
        JudgeConfig(backend="endpoint", model="m")
    with pytest.raises(ValueError, match="needs model"):
        JudgeConfig(backend="serve")


def test_judge_records_have_known_balanced_verdicts():
    task = get_task("arithmetic", digits=2)
    pairwise = judge_records(task, 40, kind="pairwise", template="compact-pairwise")
    assert [r["completion"] for r in pairwise].count("A") == 20
    first = pairwise[0]
    correct = re.search(r"A:(.*)\nB:", first["prompt"])[1]
    question = first["prompt"].split("\n")[1]
    assert task.verify(correct, str(eval(question[:-1]))) == 1.0 and first["completion"] == "A"
    pointwise = judge_records(task, 30, kind="pointwise", template="compact-pointwise")
    assert len(pointwise) == 30 and {r["completion"] for r in pointwise} == {"0", "1"}
    assert all(r["prompt"].endswith("Score:") for r in pointwise)
    solving = judge_records(task, 4, kind="pairwise", template="compact-pairwise", solve_first=True)
    assert all(task.verify(r["completion"].split(" A ")[0].split(" ", 2)[2],
                           str(eval(r["prompt"].split("\n")[1][:-1]))) == 1.0 for r in solving)
    assert [parse_verdict(r["completion"]) for r in solving] == ["A", "B", "A", "B"]


def test_answer_check_by_hand():
    assert answer_check("88", "88") == "8/8= 8/8= right"
    assert answer_check("88", "89") == "8/8= 8/9x wrong"
    assert answer_check("107", "97") == "1/9x 0/7x 7/_x wrong"
    assert answer_check("7", "17") == "7/1x _/7x wrong"
    assert parse_score(f"Answer:89 <think>8+0=8 c0|</think>88 {answer_check('88', '89')} Score: 0", 0, 1) == 0.0


def test_pointwise_reply_by_hand():
    add = get_task("arithmetic", digits=2)
    sub = get_task("arithmetic", digits=2, operators="-", nonnegative=True)
    work = "<think>7+5=12 c1|4+8+1=13 c1|</think>132"
    assert pointwise_reply(add, "47+85=", "133", 0) == "0"
    assert pointwise_reply(add, "47+85=", "133", 0, work=work) == f"Answer:133 {work} 1/1= 3/3= 2/3x wrong Score: 0"
    assert pointwise_reply(sub, "132-47=", "85", 1, check="inverse") == (
        "Answer:85 <think>5+7=12 c1|8+4+1=13 c1|</think>132 1/1= 3/3= 2/2= right Score: 1")


def test_solve_first_replies_mark_each_answer_before_the_verdict():
    task = get_task("arithmetic", digits=2)
    for record in judge_records(task, 40, kind="pairwise", template="compact-pairwise", solve_first=True, ties=0.5):
        question = record["prompt"].split("\n")[1]
        truth = str(eval(question[:-1]))
        shown = {side: re.search(rf"\n{side}:.*</think>(\d+)", record["prompt"])[1] for side in "AB"}
        assert record["completion"].startswith(f"A:{shown['A']} B:{shown['B']} <think>")
        own, marks = record["completion"].split("</think>")[1].split(" ", 1)
        assert own == truth
        assert marks.startswith(f"A {answer_check(truth, shown['A'])} B {answer_check(truth, shown['B'])} [[")
        decisive = (shown["A"] == truth) != (shown["B"] == truth)
        expected = ("A" if shown["A"] == truth else "B") if decisive else "tie"
        assert parse_verdict(record["completion"]) == expected
    verdicts = [parse_verdict(r["completion"]) for r in
                judge_records(task, 400, kind="pairwise", template="compact-pairwise", solve_first=True, ties=0.25)]
    assert 0.15 < verdicts.count("tie") / 400 < 0.35 and abs(verdicts.count("A") - verdicts.count("B")) < 40
    scored = judge_records(task, 20, kind="pointwise", template="compact-pointwise", solve_first=True)

    def truth_of(record):
        return str(eval(record["prompt"].split("\n")[1].split("=")[0]))

    for record in scored:
        seen = record["prompt"].rsplit("</think>", 1)[1].split("\n")[0]
        mark = "right" if record["completion"].endswith("Score: 1") else "wrong"
        assert record["completion"].startswith(f"Answer:{seen} <think>")
        assert record["completion"].endswith(f"</think>{truth_of(record)} {answer_check(truth_of(record), seen)} "
                                             f"Score: {int(mark == 'right')}")
    with pytest.raises(ValueError, match="ties"):
        judge_records(task, 4, kind="pairwise", template="compact-pairwise", solve_first=True, ties=1.0)


def test_answers_only_records_show_the_final_answers_and_keep_the_judges_work():
    task = get_task("arithmetic", digits=2)
    traces = judge_records(task, 20, kind="pointwise", template="solve-pointwise", solve_first=True)
    answers = judge_records(task, 20, kind="pointwise", template="solve-pointwise", solve_first=True,
                            answers_only=True)
    for full, bare in zip(traces, answers, strict=True):
        shown = bare["prompt"].split("\n")[1].split("=")[1]
        assert "<think>" not in bare["prompt"] and shown.isdigit()  # "Judge\n74+35=108\n74+35="
        assert full["prompt"].split("\n")[1].endswith(f"</think>{shown}")  # the same response, its answer only
        assert bare["completion"] == full["completion"]  # the judge still works the sum out before scoring
    pairwise = judge_records(task, 40, kind="pairwise", template="solve-pairwise", solve_first=True, ties=0.5,
                             answers_only=True)
    for record in pairwise:
        a, b = re.search(r"\nA:(\d+)\nB:(\d+)\n", record["prompt"]).groups()
        assert record["completion"].startswith(f"A:{a} B:{b} <think>")


def test_self_rewarding_seed_data_answers_directly(tmp_path):
    import json

    from tether.config.preference import JudgeDataConfig
    from tether.stages.judge_data import run_judge_data

    cfg = JudgeDataConfig(name="seed_data", kind="pointwise", template="solve-pointwise", solve_first=True,
                          responses="answers", sft_n=10, sft_think=False,
                          task={"name": "arithmetic", "options": {"digits": 2}, "n": 20, "eval_n": 0})
    assert run_judge_data(cfg, tmp_path, resume=False) == {"records": 30.0, "judge_records": 20.0}
    rows = [json.loads(line) for line in (tmp_path / "seed_data" / "train.jsonl").read_text().splitlines()]
    demos = [r for r in rows if not r["prompt"].startswith("Judge")]
    assert len(demos) == 10 and all(r["completion"] == str(eval(r["prompt"][:-1])) for r in demos)
    assert all("<think>" not in r["prompt"] for r in rows)


def test_judge_records_from_a_policys_own_samples_score_each_by_the_verifier():
    from tether.rewards.judge_records import sample_judge_records

    task = get_task("arithmetic", digits=2)
    samples = [("30+38=", "<think>0+8=8 c0|3+3=6 c0|</think>78", "68"),  # a trace right, its answer wrong
               ("30+38=", "<think>0+8=8 c0|3+3=6 c0|</think>68", "68")]
    wrong, right = sample_judge_records(task, samples, template="solve-pointwise", solve_first=True)
    assert wrong["prompt"] == "Judge\n30+38=<think>0+8=8 c0|3+3=6 c0|</think>78\n30+38="
    assert wrong["completion"] == "Answer:78 <think>0+8=8 c0|3+3=6 c0|</think>68 6/7x 8/8= wrong Score: 0"
    assert right["completion"] == "Answer:68 <think>0+8=8 c0|3+3=6 c0|</think>68 6/6= 8/8= right Score: 1"
    bare = sample_judge_records(task, samples, template="solve-pointwise", scale=(1, 10))
    assert [r["completion"] for r in bare] == ["1", "10"]


def test_judge_data_adds_records_from_the_policys_samples(tmp_path):
    import json

    from tether.config.preference import JudgeDataConfig
    from tether.models.tiny import save_tiny
    from tether.stages.judge_data import run_judge_data

    policy = save_tiny(tmp_path / "untrained")
    cfg = JudgeDataConfig(name="judge_data", kind="pointwise", template="solve-pointwise", solve_first=True,
                          policy={"model": str(policy), "n": 6, "samples": 2, "sampling": {"max_new_tokens": 4}},
                          task={"name": "arithmetic", "options": {"digits": 2}, "n": 10, "eval_n": 0})
    results = run_judge_data(cfg, tmp_path, resume=False)
    assert results == {"records": 22.0, "judge_records": 22.0, "policy_records": 12.0}
    rows = [json.loads(line) for line in (tmp_path / "judge_data" / "train.jsonl").read_text().splitlines()]
    # the untrained policy answers nothing right: its 12 records all score 0
    assert sum(r["completion"].endswith("Score: 0") for r in rows) >= 12
    with pytest.raises(ValueError, match="pointwise"):
        JudgeDataConfig(kind="pairwise", policy={"model": "m"})


def test_inverse_check_records_add_the_answer_back_and_agree_with_the_verifier():
    from tether.rewards.judge_records import sample_judge_records

    task = get_task("arithmetic", digits=2, operators="-", nonnegative=True)
    records = judge_records(task, 200, kind="pointwise", template="solve-pointwise", solve_first=True,
                            check="inverse", errors=["slip", "answer"])
    for record in records:
        problem = record["prompt"].split("\n")[2]  # "Judge\n74-35=<trace>38\n74-35="
        a, b = map(int, problem[:-1].split("-"))
        seen = int(re.match(r"Answer:(\d+) ", record["completion"])[1])
        total = re.search(r"</think>(\d+) ", record["completion"])[1]
        assert int(total) == seen + b  # the judge's work is the answer plus b, not the subtraction
        assert record["completion"].endswith(f"Score: {int(seen == a - b)}")
    assert {r["completion"][-1] for r in records} == {"0", "1"}
    samples = [("132-47=", "<think>x</think>85", "85"), ("132-47=", "<think>x</think>84", "85"),
               ("132-47=", "<think>x</think>8a", "85")]
    right, wrong, unreadable = (r["completion"] for r in sample_judge_records(
        task, samples, template="solve-pointwise", solve_first=True, check="inverse"))
    assert right == "Answer:85 <think>5+7=12 c1|8+4+1=13 c1|</think>132 1/1= 3/3= 2/2= right Score: 1"
    assert wrong == "Answer:84 <think>4+7=11 c1|8+4+1=13 c1|</think>131 1/1= 3/3= 2/1x wrong Score: 0"
    assert unreadable == "Answer:8a not a number wrong Score: 0"


def test_inverse_check_needs_a_task_with_one_and_pointwise_records():
    from tether.config.preference import JudgeDataConfig

    task = get_task("arithmetic", digits=2, operators="-")
    with pytest.raises(ValueError, match="pointwise"):
        judge_records(task, 4, kind="pairwise", template="solve-pairwise", solve_first=True, check="inverse")
    with pytest.raises(ValueError, match="solve_first"):
        judge_records(task, 4, kind="pointwise", template="solve-pointwise", check="inverse")
    with pytest.raises(ValueError, match="inverse check"):
        judge_records(get_task("multiplication"), 4, kind="pointwise", template="solve-pointwise",
                      solve_first=True, check="inverse")
    with pytest.raises(ValueError, match="check 'inverse' needs"):
        JudgeDataConfig(kind="pairwise", solve_first=True, check="inverse")


def test_letter_work_records_solve_in_letters_and_agree_with_the_verifier():
    from tether.config.preference import JudgeDataConfig
    from tether.rewards.judge_records import sample_judge_records

    task = get_task("arithmetic", digits=2)
    assert answer_check("BDC", "132") == "B/1= D/3= C/2= right"
    assert answer_check("BDC", "133") == "B/1= D/3= C/3x wrong"
    records = judge_records(task, 200, kind="pointwise", template="solve-pointwise", solve_first=True,
                            letters=True, answers_only=True, errors=["slip", "dropped_carry", "misread"])
    letters = str.maketrans("ABCDEFGHIJ", "0123456789")
    for record in records:
        problem = record["prompt"].split("\n")[-1]  # "Judge\n74+35=109\n74+35="
        a, b = map(int, problem[:-1].split("+"))
        seen = re.match(r"Answer:(\d+) ", record["completion"])[1]
        work = re.search(r"<think>(.*)</think>([A-J]+) ", record["completion"])
        assert not re.search(r"\d", work[1])  # the whole worked sum is in letters
        assert int(work[2].translate(letters)) == a + b
        assert record["completion"].endswith(f"Score: {int(int(seen) == a + b)}")
    assert {r["completion"][-1] for r in records} == {"0", "1"}
    right, wrong = (r["completion"] for r in sample_judge_records(
        task, [("47+85=", "<think>x</think>132", "132"), ("47+85=", "<think>x</think>133", "132")],
        template="solve-pointwise", solve_first=True, letters=True))
    assert right == "Answer:132 <think>H+F=BC cB|E+I+B=BD cB|</think>BDC B/1= D/3= C/2= right Score: 1"
    assert wrong == "Answer:133 <think>H+F=BC cB|E+I+B=BD cB|</think>BDC B/1= D/3= C/3x wrong Score: 0"
    with pytest.raises(ValueError, match="pointwise"):
        judge_records(task, 4, kind="pairwise", template="solve-pairwise", solve_first=True, letters=True)
    with pytest.raises(ValueError, match="letters"):
        JudgeDataConfig(kind="pointwise", work_digits="letters")  # without solve_first


def test_a_local_judge_decodes_engine_batch_size_replies_at_a_time():
    """A round's judge prompts (self-rewarding: 8192) decoded at once hold every KV cache together; the judge's
    ``sampling.engine_batch_size`` caps them, with the same greedy replies."""
    from tether.models.tiny import build_tiny

    model, tokenizer = build_tiny()
    prompts = [f"{a}+{b}=" for a in range(3) for b in range(3)]
    replies = {}
    for size in (None, 2):
        judge = build_judge({"kind": "pointwise", "backend": "policy", "template": "compact-pointwise",
                             "sampling": {"max_new_tokens": 6, "engine_batch_size": size}},
                            policy=model, tokenizer=tokenizer)
        assert judge.backend.engine.batch_size == size
        replies[size] = judge.backend(prompts)
    assert replies[None] == replies[2]
