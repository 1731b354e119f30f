"""Rewards routed by prompt type: each sample reaches only its kind's rewards; answer-only routes see the text
after </think>."""

import math

import pytest
import torch
from pydantic import ValidationError

from tether.config.rewards import RewardRoutes
from tether.config.rl import GRPOConfig
from tether.core.reward_aggregation import REWARD_AGGREGATIONS
from tether.rewards import RewardComposer
from tether.rewards.routing import RoutedRewardComposer, final_answer
from tether.scoring import reward_composer


def test_final_answer_strips_the_thinking():
    assert final_answer("<think>2+2=4 c0|</think> CAT FOX") == "CAT FOX"
    assert final_answer("<think>a</think>b</think>c") == "c"  # after the last close
    assert final_answer("<think>never closed CAT") == ""  # all thinking, no answer
    assert final_answer("  CAT FOX ") == "CAT FOX"  # no tags: all answer
    assert final_answer("still thinking", prompt="7+5=<think>") == ""  # the prompt opened the block
    assert final_answer("x</think>12", prompt="7+5=<think>") == "12"


def spy(seen, name, value):
    def fn(prompts, completions, **columns):
        seen.append((name, list(prompts), list(completions), columns.get("answer")))
        return [value(c) for c in completions]
    fn.__name__ = name
    return fn


def test_each_sample_reaches_only_its_kinds_rewards():
    seen = []
    reasoning = RewardComposer([spy(seen, "chars", len), {"name": spy(seen, "one", lambda c: 1.0), "weight": 0.5}])
    general = RewardComposer([spy(seen, "upper", lambda c: float(c.isupper()))])
    composer = RoutedRewardComposer({"reasoning": reasoning, "general": general}, answer_only=["general"])
    prompts = ["1+1=", "s: a", "2+2=", "s: b"]
    completions = ["<think>1+1</think>2", "<think>hm</think>CAT", "<think>x</think>44", "<think>no"]
    columns = {"kind": ["reasoning", "general", "reasoning", "general"], "answer": ["2", "CAT", "4", "B"]}
    result = composer.score(prompts, completions, columns)
    # the reasoning functions saw samples 0 and 2, whole; the general one samples 1 and 3, answers only
    assert seen == [("chars", ["1+1=", "2+2="], [completions[0], completions[2]], ["2", "4"]),
                    ("one", ["1+1=", "2+2="], [completions[0], completions[2]], ["2", "4"]),
                    ("upper", ["s: a", "s: b"], ["CAT", ""], ["CAT", "B"])]
    nan = math.nan
    expected = {"reasoning/chars": [19.0, nan, 18.0, nan], "reasoning/one": [1.0, nan, 1.0, nan],
                "general/upper": [nan, 1.0, nan, 0.0]}
    assert list(result.per_function) == list(expected)
    for key, values in expected.items():
        torch.testing.assert_close(result.per_function[key], torch.tensor(values), equal_nan=True)
    # totals: 19 + 0.5, 1, 18 + 0.5, 0
    torch.testing.assert_close(result.total, torch.tensor([19.5, 1.0, 18.5, 0.0]))
    assert result.valid.all() and result.weights == (1.0, 0.5, 1.0)
    summed = REWARD_AGGREGATIONS.get("sum")(result.scores(), torch.tensor(result.weights), 1)
    torch.testing.assert_close(summed, result.total)  # the trainer's sum over the routed functions
    metrics = result.metrics()
    assert metrics["reward/reasoning/chars/mean"] == 18.5 and metrics["reward/general/upper/mean"] == 0.5
    assert metrics["reward/reasoning/chars/none"] == 0.0  # counted within the route, not over the batch
    assert metrics["reward/route/reasoning/samples"] == 2.0 and metrics["reward/route/general/samples"] == 2.0


def test_a_route_without_samples_is_left_out_and_bad_kinds_are_errors():
    composer = RoutedRewardComposer({"a": RewardComposer([lambda p, c, **k: [1.0] * len(c)]),
                                     "b": RewardComposer([lambda p, c, **k: [2.0] * len(c)])})
    result = composer.score(["p"], ["c"], {"kind": ["b"]})
    assert list(result.per_function) == ["b/<lambda>"] and result.total.tolist() == [2.0]
    with pytest.raises(ValueError, match="no route for kind 'c'; routes: a, b"):
        composer.score(["p"], ["c"], {"kind": ["c"]})
    with pytest.raises(ValueError, match="record column 'kind'"):
        composer.score(["p"], ["c"], {"answer": ["1"]})
    with pytest.raises(ValueError, match="answer_only names"):
        RoutedRewardComposer({"a": composer}, answer_only=["z"])


def test_routes_from_config_with_registered_rewards():
    routes = RewardRoutes.model_validate({"routes": {
        "reasoning": {"rewards": [{"name": "accuracy"}, {"name": "language_consistency", "weight": 0.5}]},
        "general": {"rewards": [{"name": "accuracy", "kwargs": {"task": "secret"}}], "answer_only": True}}})
    composer = reward_composer([], routes=routes, defaults={"task": "arithmetic", "task_options": {}})
    prompts = ["7+5=", "secret: ruby\nuser: upper cat fox\nassistant: "]
    completions = ["<think>7+5=12 c1|</think>12", "<think>the secret is ruby</think>CAT FOX"]
    result = composer.score(prompts, completions, {"kind": ["reasoning", "general"], "answer": ["12", "CAT FOX"]})
    # reasoning: accuracy 1 + 0.5 * consistency 1; general: the secret task's check on "CAT FOX" alone
    assert result.total.tolist() == [1.5, 1.0]


def test_rl_config_takes_routes_instead_of_rewards():
    routes = {"routes": {"reasoning": {"rewards": [{"name": "accuracy"}]}}}
    assert GRPOConfig(reward_routes=routes).reward_routes.by == "kind"
    with pytest.raises(ValidationError, match="reward_routes replaces rewards"):
        GRPOConfig(reward_routes=routes, rewards=[{"name": "accuracy"}])
    with pytest.raises(ValidationError):
        RewardRoutes.model_validate({"routes": {}})
    with pytest.raises(ValidationError):
        RewardRoutes.model_validate({"routes": {"a": {"rewards": []}}})
