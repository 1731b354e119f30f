"""Reward functions returning anything, generated: NaN, inf, None, huge or odd numbers, wrong lengths,
wrong types, tensors and arrays of any shape, or raising. The composer either returns rewards that are
finite or NaN (NaN exactly where ``valid`` is False, each case counted) or raises RewardFunctionError
naming the function; never another exception, never an infinite reward reaching the advantages."""

import math
import os

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tether.rewards import RewardComposer, RewardFunctionError, RewardSpec

EXAMPLES = int(os.environ.get("TETHER_FUZZ_EXAMPLES", "60")) * 2
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
N = 4

values = st.one_of(
    st.none(), st.floats(), st.floats(width=32), st.booleans(), st.integers(-10**400, 10**400),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -1e39, 3.5e38, np.float64(2.0), np.float32("nan"),
                     np.int64(7), torch.tensor(1.5), torch.tensor(float("inf")), np.array(2.0), np.array("x"),
                     torch.tensor([1.0, 2.0]), "0.5", b"1", [1.0], {"r": 1}, complex(1, 1)]),
)
outputs = st.one_of(
    st.lists(values, min_size=N, max_size=N),
    st.lists(values, max_size=6),  # wrong lengths too
    st.builds(np.array, st.lists(st.floats(), min_size=N, max_size=N)),
    st.builds(torch.tensor, st.lists(st.floats(width=32), min_size=N, max_size=N)),
    st.builds(lambda: torch.zeros(N, 2)), st.builds(lambda: np.zeros((2, N))),
    st.sampled_from([None, 1.0, "1,2,3,4", {"a": 1}, (x for x in range(N)), torch.tensor(1.0)]),
    st.just("raise"),
)


def make_function(output, name):
    def reward(prompts, completions, **columns):
        if isinstance(output, str) and output == "raise":
            raise RuntimeError("reward server unreachable")
        return output

    reward.__name__ = name
    return reward


@FUZZ
@given(outputs=st.lists(outputs, min_size=1, max_size=3),
       weights=st.lists(st.floats(-1e20, 1e20) | st.sampled_from([0.0, 1.0, 1e38]), min_size=3, max_size=3),
       on_error=st.sampled_from(["raise", "zero"]))
def test_any_reward_output_is_handled_and_counted(outputs, weights, on_error):
    specs = [RewardSpec(make_function(out, f"f{i}"), weight=weights[i]) for i, out in enumerate(outputs)]
    composer = RewardComposer(specs, on_error=on_error)
    try:
        result = composer.score([f"p{i}" for i in range(N)], [f"c{i}" for i in range(N)])
    except RewardFunctionError as err:
        assert err.function in {f"f{i}" for i in range(len(outputs))} and err.function in str(err)
        return
    total = result.total
    assert total.shape == (N,) and total.dtype == torch.float32
    assert not torch.isinf(total).any(), total
    assert torch.equal(result.valid, ~torch.isnan(total))
    for label, per in result.per_function.items():
        assert not torch.isinf(per).any(), (label, per)
    metrics = result.metrics()
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    if on_error == "zero":
        for i, out in enumerate(outputs):
            if isinstance(out, str) and out == "raise":
                assert result.errors[f"f{i}"] == N


def test_values_beyond_float32_count_as_non_finite():
    """1e300 is a finite Python float but inf in the float32 reward tensor; 10**400 does not fit a float."""
    composer = RewardComposer([RewardSpec(make_function([1e300, 10**400, -1e39, 0.5], "big"))])
    result = composer.score(["p"] * 4, ["c"] * 4)
    assert result.nonfinite["big"] == 3
    assert torch.isnan(result.total[:3]).all() and result.total[3] == 0.5


def test_a_weighted_sum_that_overflows_is_no_reward():
    composer = RewardComposer([RewardSpec(make_function([3e38, 1.0, None, 1.0], "a"), weight=10.0),
                               RewardSpec(make_function([1.0, 1.0, None, None], "b"))])
    result = composer.score(["p"] * 4, ["c"] * 4)
    assert torch.isnan(result.total[0]) and not result.valid[0]
    assert result.total[1] == 11.0 and torch.isnan(result.total[2]) and result.total[3] == 10.0
