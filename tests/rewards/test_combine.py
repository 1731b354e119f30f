"""RewardComposer: weighting, None handling, error modes, protocol checks; reward-function resolution."""

import math
import textwrap

import pytest
import torch

from tether.rewards.combine import (
    RewardComposer,
    RewardFunctionError,
    RewardSpec,
    resolve_reward_function,
)
from tether.rewards.verifiers import REWARD_FUNCTIONS, format_reward

PROMPTS = ["1+2=", "3+4=", "5+5="]
COMPLETIONS = ["<think>1+2=3 c0|</think>3", "<think>3+4=7 c0|</think>8", "10"]
ANSWERS = ["3", "7", "10"]


def const(values):
    def fn(prompts, completions, **_):
        return list(values)

    return fn


def test_weighted_sum_of_builtins():
    """accuracy = [1, 0, 1], format = [1, 1, 0]; total = 2*acc + 0.5*fmt = [2.5, 0.5, 2.0]."""
    composer = RewardComposer([RewardSpec("accuracy", 2.0), {"name": "format", "weight": 0.5}])
    result = composer.score(PROMPTS, COMPLETIONS, {"answer": ANSWERS, "id": [0, 1, 2]})
    assert result.per_function["accuracy"].tolist() == [1.0, 0.0, 1.0]
    assert result.per_function["format"].tolist() == [1.0, 1.0, 0.0]
    assert result.total.tolist() == [2.5, 0.5, 2.0]
    assert result.valid.tolist() == [True, True, True]
    assert result.total.shape == (3,) and result.total.dtype == torch.float32
    assert result.errors == {"accuracy": 0, "format": 0}
    metrics = result.metrics()
    assert metrics["reward/accuracy/mean"] == pytest.approx(2 / 3)
    assert metrics["reward/accuracy/std"] == pytest.approx(math.sqrt(2 / 9))  # population std of [1, 0, 1]
    assert metrics["reward/total/mean"] == pytest.approx(5 / 3)
    assert metrics["reward/format/none"] == 0.0


def test_none_is_left_out_of_the_sum_and_the_statistics():
    """a = [1, None, None], b = [None, 2, None], weights 1 and 3: total = [1, 6, NaN]."""
    composer = RewardComposer(
        [RewardSpec(const([1.0, None, None]), 1.0), RewardSpec(const([None, 2, None]), 3.0)]
    )
    result = composer.score(PROMPTS, COMPLETIONS)
    assert result.total[:2].tolist() == [1.0, 6.0]
    assert math.isnan(result.total[2])
    assert result.valid.tolist() == [True, True, False]
    assert list(result.per_function) == ["fn", "fn_2"]  # duplicate names made unique
    metrics = result.metrics()
    assert (
        metrics["reward/fn/mean"] == 1.0
        and metrics["reward/fn/std"] == 0.0
        and metrics["reward/fn/none"] == 2.0
    )
    assert metrics["reward/fn_2/mean"] == 2.0
    assert metrics["reward/total/mean"] == 3.5 and metrics["reward/total/none"] == 1.0


def test_all_none_leaves_means_out_of_the_metrics():
    result = RewardComposer([RewardSpec(const([None, None, None]))]).score(PROMPTS, COMPLETIONS)
    assert torch.isnan(result.total).all() and not result.valid.any()
    metrics = result.metrics()
    assert "reward/fn/mean" not in metrics and "reward/total/mean" not in metrics
    assert metrics["reward/total/none"] == 3.0
    assert not any(isinstance(v, float) and math.isnan(v) for v in metrics.values())


def test_nonfinite_values_count_as_none():
    result = RewardComposer([RewardSpec(const([math.nan, math.inf, 0.5]))]).score(PROMPTS, COMPLETIONS)
    assert result.valid.tolist() == [False, False, True]
    assert result.nonfinite == {"fn": 2}
    assert result.metrics()["reward/fn/nonfinite"] == 2.0 and result.metrics()["reward/fn/none"] == 2.0


def test_tensor_returns_are_accepted():
    """A (N,) tensor, or a list of 0-d tensors, is read as a list of floats; weight 0 still counts as valid."""
    tensor = RewardSpec(lambda p, c, **_: torch.tensor([1.0, 0.0, 1.0]))
    scalars = RewardSpec(lambda p, c, **_: [torch.tensor(2.0)] * len(c), weight=0.0)
    result = RewardComposer([tensor, scalars]).score(PROMPTS, COMPLETIONS)
    assert result.total.tolist() == [1.0, 0.0, 1.0]
    assert result.per_function["<lambda>_2"].tolist() == [2.0, 2.0, 2.0]


def fails_on_eight(prompts, completions, **_):
    return [1 / 0 if c.endswith("8") else 1.0 for c in completions]


def test_on_error_raise_names_the_function_and_the_sample():
    composer = RewardComposer([RewardSpec("format"), RewardSpec(fails_on_eight)])
    with pytest.raises(RewardFunctionError) as info:
        composer.score(PROMPTS, COMPLETIONS)
    message = str(info.value)
    assert "'fails_on_eight'" in message and "ZeroDivisionError" in message
    assert repr(COMPLETIONS[1]) in message and repr(PROMPTS[1]) in message
    assert info.value.function == "fails_on_eight" and info.value.index == 1
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_on_error_raise_truncates_long_samples():
    completion = "x" * 1000 + "8"
    with pytest.raises(RewardFunctionError, match=r"more chars") as info:
        RewardComposer([RewardSpec(fails_on_eight)]).score(["p"], [completion])
    assert len(str(info.value)) < 1000


def test_on_error_raise_when_no_single_sample_fails():
    def batch_only(prompts, completions, **_):
        if len(completions) > 1:
            raise RuntimeError("batch too big")
        return [1.0]

    with pytest.raises(RewardFunctionError, match="no single sample: batch too big"):
        RewardComposer([RewardSpec(batch_only)]).score(PROMPTS, COMPLETIONS)


def test_on_error_zero_scores_zero_and_counts():
    composer = RewardComposer([RewardSpec(fails_on_eight, 2.0), RewardSpec("format")], on_error="zero")
    result = composer.score(PROMPTS, COMPLETIONS)
    assert result.per_function["fails_on_eight"].tolist() == [1.0, 0.0, 1.0]
    assert result.errors == {"fails_on_eight": 1, "format": 0}
    assert result.total.tolist() == [3.0, 1.0, 2.0]
    assert result.metrics()["reward/fails_on_eight/errors"] == 1.0


def test_protocol_violations_raise_in_both_modes():
    for on_error in ("raise", "zero"):
        with pytest.raises(RewardFunctionError, match=r"'short' returned 2 values for 3"):
            RewardComposer([{"name": short, "weight": 1.0}], on_error=on_error).score(PROMPTS, COMPLETIONS)
    with pytest.raises(RewardFunctionError, match=r"returned str 'yes' for sample 1"):
        RewardComposer([RewardSpec(const([1.0, "yes", 0.0]))]).score(PROMPTS, COMPLETIONS)
    with pytest.raises(RewardFunctionError, match="must return a list"):
        RewardComposer([RewardSpec(lambda p, c: 1.0)]).score(PROMPTS, COMPLETIONS)


def short(prompts, completions):
    return [1.0, 2.0]


def test_batch_shape_and_column_checks():
    composer = RewardComposer([RewardSpec("accuracy")])
    with pytest.raises(ValueError, match="2 prompts for 3 completions"):
        composer.score(PROMPTS[:2], COMPLETIONS, {"answer": ANSWERS})
    with pytest.raises(ValueError, match="column 'answer' has 2 values for 3"):
        composer.score(PROMPTS, COMPLETIONS, {"answer": ANSWERS[:2]})
    with pytest.raises(ValueError, match=r"'accuracy' needs dataset column\(s\) \['answer'\]"):
        composer.score(PROMPTS, COMPLETIONS, {"gold": ANSWERS})
    with pytest.raises(ValueError, match="same name as dataset columns"):
        RewardComposer([RewardSpec("accuracy", kwargs={"task": "arithmetic"})]).score(
            PROMPTS, COMPLETIONS, {"answer": ANSWERS, "task": ["a"] * 3}
        )


def test_columns_are_passed_by_signature():
    """A function without **kwargs gets only the columns it names."""

    def needs_answer(prompts, completions, answer):
        return [float(c.endswith(a)) for c, a in zip(completions, answer, strict=True)]

    result = RewardComposer([RewardSpec(needs_answer)]).score(
        PROMPTS, COMPLETIONS, {"answer": ANSWERS, "id": [1, 2, 3]}
    )
    assert result.total.tolist() == [1.0, 0.0, 1.0]


def test_builtin_options_are_checked():
    with pytest.raises(ValueError, match=r"'format' does not accept option\(s\) \['partial'\]"):
        RewardComposer([RewardSpec("format", kwargs={"partial": 0.5})])
    composer = RewardComposer([RewardSpec("format", kwargs={"partial_credit": 0.5})])
    assert composer.score(["p"], ["<think>a</think>"]).total.tolist() == [0.5]
    with pytest.raises(ValueError, match="on_error"):
        RewardComposer([RewardSpec("format")], on_error="ignore")
    with pytest.raises(ValueError, match="weight must be finite"):
        RewardSpec("format", weight=math.nan)


def test_resolve_registered_and_callable():
    assert resolve_reward_function("format") is format_reward
    assert resolve_reward_function(short) is short
    with pytest.raises(ValueError, match=r"not a registered name .*exact_match"):
        resolve_reward_function("formatt")


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent("""
        def ends_in_seven(prompts, completions, **columns):
            return [float(c.endswith("7")) for c in completions]

        class Holder:
            @staticmethod
            def half(prompts, completions, **columns):
                return [0.5] * len(completions)

        NOT_CALLABLE = 3
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_resolve_dotted_paths(reward_module):
    fn = resolve_reward_function(f"{reward_module}:ends_in_seven")
    assert resolve_reward_function(f"{reward_module}.ends_in_seven") is fn
    assert resolve_reward_function(f"{reward_module}:Holder.half")(["p"], ["c"]) == [0.5]
    result = RewardComposer([RewardSpec(f"{reward_module}:ends_in_seven")]).score(["p", "p"], ["17", "18"])
    assert result.per_function[f"{reward_module}:ends_in_seven"].tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        resolve_reward_function("no_such_module:fn")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        resolve_reward_function(f"{reward_module}:missing")
    with pytest.raises(TypeError, match="not a callable"):
        resolve_reward_function(f"{reward_module}:NOT_CALLABLE")


def test_registry_is_the_one_lookup():
    assert set(REWARD_FUNCTIONS.names()) >= {"accuracy", "math", "exact_match", "format", "regex", "length"}
