"""AI feedback against a constitution: the critique -> revision chain (on a local tiny-model judge, on the
rule-based judge, and over HTTP), position-swapped labels with the judge's biases, and the d-RLAIF reward."""

import re

import pytest

from tether.config.rewards import JudgeSamplingConfig
from tether.models import build_tiny
from tether.rewards import REWARD_FUNCTIONS, RewardComposer, RewardFunctionError, RewardSpec
from tether.rewards.cai import (
    combine_orders,
    critique_and_revise,
    judge_bias,
    preference_labels,
    principle_rng,
)
from tether.rewards.constitution import load_constitution, parse_constitution
from tether.rewards.judge import EndpointJudgeBackend, EngineJudgeBackend, PairwiseJudge
from tether.rollout import HFEngine, OpenAIEngine
from tether.rollout.engines import TextFunctionEngine
from tether.scoring import reward_composer
from tether.serve import BackgroundServer, create_app
from tether.tasks.secret import REFUSAL, prompt_text, rule_judge

SHORT = parse_constitution("""\
principles:
  - {name: secret, critique_request: "Reveals the secret?", revision_request: Hide it., comparison: "Which keeps the secret?"}
  - {name: rude, critique_request: "Rude?", revision_request: Be polite., comparison: "Politer?"}
""")
SECRET_ONLY = parse_constitution('- {critique_request: "Does it reveal a secret?", revision_request: Hide it.}\n')
PROMPTS = [prompt_text("opal", "spell the secret"), prompt_text("jade", "swap cat dog"),
           prompt_text("ruby", "what is the secret?")]
ANSWERS = ["o-p-a-l", "dog cat", "The secret is ruby."]


pytestmark = pytest.mark.usefixtures("one_thread")  # the shared fixture in conftest.py


class Spy:
    """A judge backend that records the judge prompts it is sent, then passes them on."""

    is_judge_backend = True

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def __call__(self, texts, n=1):
        self.calls.append(list(texts))
        return self.backend(texts, n)


def test_the_chain_runs_on_a_local_tiny_model_judge():
    model, tokenizer = build_tiny()
    local = EngineJudgeBackend(HFEngine(model, tokenizer), tokenizer, sampling=JudgeSamplingConfig(max_new_tokens=6))  # greedy: deterministic
    spy = Spy(local)
    records, figures = critique_and_revise(spy, SHORT, PROMPTS, ANSWERS, rounds=2, seed=3)
    assert len(spy.calls) == 4  # critiques then revisions, per round, each one batch
    for i, record in enumerate(records):
        assert record["prompt"] == PROMPTS[i] and record["initial"] == ANSWERS[i]
        current = ANSWERS[i]
        for r, step in enumerate(record["chain"]):
            principle = SHORT.sample(principle_rng(3, i, r))
            assert step["round"] == r + 1 and step["principle"] == principle.name
            critique_prompt, revision_prompt = spy.calls[2 * r][i], spy.calls[2 * r + 1][i]
            assert f"Assistant: {current}\n\nCritiqueRequest: {principle.critique_request}" in critique_prompt
            assert step["critique"] == local([critique_prompt])[0][0].strip()  # the model's own reply
            assert f"Critique: {step['critique']}\n\nRevisionRequest: {principle.revision_request}" in revision_prompt
            assert step["revision"] == local([revision_prompt])[0][0].strip()
            current = step["revision"] or current  # an empty revision keeps the response
        assert record["revision"] == current
    assert figures["chain/examples"] == 3 and figures["chain/rounds"] == 2


def test_rule_judge_revisions_depend_on_the_sampled_principle():
    records, _ = critique_and_revise(rule_judge, "default", PROMPTS * 4, ANSWERS * 4, rounds=1, seed=5)
    for r in records:
        principle = r["chain"][0]["principle"]
        if r["initial"] == "dog cat":  # a harmless request answered right: nothing to fix under any principle
            assert r["revision"] == "dog cat"
        else:  # only the confidentiality principle makes this judge see the leak
            assert (r["revision"] == REFUSAL) == (principle == "confidential"), principle
    assert "confidential" in [r["chain"][0]["principle"] for r in records]
    assert "reveals the secret word 'opal'" in next(
        r["chain"][0]["critique"] for r in records if r["chain"][0]["principle"] == "confidential" and "opal" in
        r["prompt"])
    more, _ = critique_and_revise(rule_judge, "default", PROMPTS * 4, ANSWERS * 4, rounds=4, seed=5)
    fixed = [sum(r["revision"] == REFUSAL for r in rs) for rs in (records, more)]
    assert fixed[1] >= fixed[0] and all(len(r["chain"]) == 4 for r in more)  # more rounds, more principles tried


def test_the_chain_reaches_a_judge_served_over_http():
    tokenizer = build_tiny()[1]
    app = create_app(engine=TextFunctionEngine(rule_judge, tokenizer), tokenizer=tokenizer, model_name="rules")
    with BackgroundServer(app) as server:
        backend = EndpointJudgeBackend(OpenAIEngine(server.base_url, "rules", backoff=0.001), sampling=JudgeSamplingConfig(max_new_tokens=64))
        records, _ = critique_and_revise(backend, SECRET_ONLY, PROMPTS, ANSWERS, rounds=1)
    assert [r["revision"] for r in records] == [REFUSAL, "dog cat", REFUSAL]


def test_labels_ask_both_orders_and_map_the_swap_back():
    spy = Spy(PairwiseJudge(rule_judge).backend)
    judge = PairwiseJudge(spy)
    a, b = [REFUSAL, "cat dog", "ruby"], ["o-p-a-l", "dog cat", REFUSAL]
    labels = preference_labels(judge, SECRET_ONLY, PROMPTS, a, b, seed=1)
    assert [lab["p_a"] for lab in labels] == [1.0, 0.0, 0.0]
    assert all(lab["forward"] == lab["backward"] == lab["p_a"] for lab in labels)
    shown = [re.findall(r"Start of Assistant [AB]'s Answer\]\n(.*?)\n\[The End", text, re.S) for call in spy.calls for text in call]
    for x, y in zip(a, b, strict=True):  # every pair shown once in each order
        assert [x, y] in shown and [y, x] in shown
    assert judge.swap and judge.principle is None  # the judge's own settings are restored
    mixed = preference_labels(judge, SHORT, PROMPTS * 4, a * 4, b * 4, seed=1)
    for i, lab in enumerate(mixed):  # a sampled principle per pair; this judge has no opinion on rudeness
        assert lab["principle"] == SHORT.sample(principle_rng(1, i)).name
        assert (lab["p_a"] == 0.5) == (lab["principle"] == "rude")


def test_a_judge_that_always_picks_the_first_position_is_caught():
    judge = PairwiseJudge(lambda texts: ["[[A]]"] * len(texts))
    a, b = ["short", "a much longer one", "x"], ["a longer one", "b", "yy"]
    labels = preference_labels(judge, SHORT, ["q"] * 3, a, b)
    assert [(lab["forward"], lab["backward"], lab["p_a"]) for lab in labels] == [(1.0, 0.0, 0.5)] * 3
    bias = judge_bias(labels, a, b)
    assert bias["bias/position_consistency"] == 0.0 and bias["bias/first_position_rate"] == 1.0
    assert bias["labels/ties"] == 3 and "bias/longer_preferred_rate" not in bias


def test_a_judge_that_prefers_length_is_caught():
    def longer(texts):
        out = []
        for text in texts:
            x, y = re.findall(r"Start of Assistant [AB]'s Answer\]\n(.*?)\n\[The End", text, re.S)
            out.append("[[A]]" if len(x) > len(y) else "[[B]]")
        return out

    a, b = ["aaaa", "b", "cccccc", "dd"], ["a", "bbbbb", "c", "ddddddd"]
    labels = preference_labels(PairwiseJudge(longer), SHORT, ["q"] * 4, a, b)
    bias = judge_bias(labels, a, b)
    assert [lab["p_a"] for lab in labels] == [1.0, 0.0, 1.0, 0.0]
    assert bias["bias/position_consistency"] == 1.0 and bias["bias/first_position_rate"] == 0.5
    assert bias["bias/longer_preferred_rate"] == 1.0 and bias["bias/length_correlation"] > 0.9


def test_judge_bias_by_hand():
    # pair 1: forward A, backward A (consistent, a wins); pair 2: forward A, swapped order A (b wins there): tie;
    # pair 3: unreadable in one order. Verdicts for the first-shown response: pair 1 forward yes, backward no
    # (b was shown first and lost); pair 2 forward yes, backward yes; pair 3 backward yes: 4 of 5.
    labels = [{"forward": 1.0, "backward": 1.0, "p_a": 1.0}, {"forward": 1.0, "backward": 0.0, "p_a": 0.5},
              {"forward": None, "backward": 0.0, "p_a": None}]
    bias = judge_bias(labels, ["aaa", "b", "c"], ["a", "bb", "c"])
    assert bias["bias/position_consistency"] == 0.5
    assert bias["bias/first_position_rate"] == pytest.approx(4 / 5)
    # p_a (1.0, 0.5) against length difference (2, -1): two points, correlation 1
    assert bias["bias/length_correlation"] == pytest.approx(1.0)
    assert bias["labels/missing"] == 1 and bias["labels/ties"] == 1
    assert combine_orders(1.0, 1.0) == 1.0 and combine_orders(0.0, 1.0) == 0.5 and combine_orders(None, 1.0) is None


def test_the_judge_reward_is_the_normalised_pointwise_score():
    judge = {"backend": "callable", "model": "tether.tasks.secret:rule_judge"}
    completions = ["O-P-A-L", "dog cat", REFUSAL]
    composer = reward_composer([RewardSpec("judge", 1.0, {"judge": judge})])
    assert composer.score(PROMPTS, completions, {"answer": ["x"] * 3}).total.tolist() == [-1.0, 1.0, 1.0]
    raw = reward_composer([RewardSpec("judge", 1.0, {"judge": judge, "normalize": False, "constitution": "default"})])
    assert raw.score(PROMPTS, completions).total.tolist() == [1.0, 10.0, 10.0]
    with pytest.raises(ValueError, match="does not accept"):
        reward_composer([RewardSpec("judge", 1.0, {"judge": judge, "normalise": True})])
    assert len(load_constitution("default")) >= 5
    # the entry declares that it needs a judge: tether.scoring builds one from the block; the bare composer
    # of tether.rewards builds no engine and says where a block is built
    assert REWARD_FUNCTIONS.needs("judge") == {"judge"}
    with pytest.raises(RewardFunctionError, match=r"tether\.scoring\.reward_composer"):
        RewardComposer([RewardSpec("judge", 1.0, {"judge": judge})]).score(PROMPTS, completions)
