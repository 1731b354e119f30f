"""Built-in reward functions, each against values worked out by hand."""

import threading

import pytest

from tether.rewards.verifiers import (
    REWARD_FUNCTIONS,
    exact_match_reward,
    format_reward,
    length_reward,
    math_reward,
    normalize_answer,
    regex_reward,
    task_reward,
)


def test_registry_names():
    for name in ("accuracy", "task", "math", "exact_match", "format", "regex", "length"):
        assert name in REWARD_FUNCTIONS
    with pytest.raises(KeyError, match=r"valid names: .*exact_match"):
        REWARD_FUNCTIONS.get("nope")


def test_task_reward_uses_the_task_verifier():
    completions = ["<think>7+5=12 c1|4+8+1=13 c1|</think>132", "<think>x</think>131", "132", "1,32", "", "x"]
    answers = ["132", "132", "132", "132", "132", None]
    assert task_reward([""] * 6, completions, answers) == [1.0, 0.0, 1.0, 1.0, 0.0, None]
    # options reach the task constructor; unrelated dataset columns pass through
    assert task_reward(["1+2="], ["3"], ["3"], task="arithmetic", task_options={"digits": 3}, id=[7]) == [1.0]
    with pytest.raises(KeyError, match="unknown task"):
        task_reward([""], ["3"], ["3"], task="nope")


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("The answer is $\\frac{1}{2}$.", "1/2", 1.0),
        ("1/2", "0.5", 1.0),
        ("3", "3.0", 1.0),
        ("3.0", "3", 1.0),
        ("<think>2+2 is 4, so maybe 5? no</think>\\boxed{4}", "4", 1.0),
        ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),  # bare LaTeX gold still parses
        ("\\boxed{2}", "\\frac{4}{2}", 1.0),
        ("The answer is 1,000", "1000", 1.0),
        ("\\boxed{4}", "5", 0.0),
        ("<think>the answer is 5</think>4", "5", 0.0),  # only the text after </think> counts
        ("0.51", "0.5", 0.0),
        ("no idea", "3", 0.0),
        ("", "3", 0.0),
    ],
)
def test_math_reward_equivalences(completion, gold, expected):
    assert math_reward([""], [completion], [gold]) == [expected]


def test_math_reward_none_for_missing_or_unparsable_gold():
    assert math_reward(["", "", ""], ["3", "3", "3"], [None, "", "3"]) == [None, None, 1.0]


def test_math_reward_works_off_the_main_thread():
    """math-verify's signal-based timeout raises off the main thread unless it is switched off."""
    result: list = []
    thread = threading.Thread(
        target=lambda: result.append(math_reward(["", ""], ["\\boxed{0.5}", "2"], ["1/2", "1"]))
    )
    thread.start()
    thread.join()
    assert result == [[1.0, 0.0]]


def test_normalize_answer():
    assert normalize_answer("  The  Answer\n is 1,234,567. ") == "the answer is 1234567"
    assert normalize_answer("3.14.") == "3.14"
    assert normalize_answer("1,2") == "1,2"  # not a thousands separator
    assert normalize_answer("12,3456") == "12,3456"


def test_exact_match_reward():
    completions = [
        "<think>...</think> Paris.",
        "paris",
        "PARIS  ",
        "<think>paris</think>Lyon",
        "1,000",
        "1000.5",
        "x",
    ]
    answers = ["Paris", "Paris", "paris", "Paris", "1000", "1000", None]
    assert exact_match_reward([""] * 7, completions, answers) == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, None]
    # extract=False compares the whole completion
    assert exact_match_reward([""], ["<think>a</think>b"], ["b"], extract=False) == [0.0]


def test_format_reward_r1():
    completions = [
        "<think>3+4=7</think>7",  # 1: think block + answer
        "  <think>\nsteps\n</think>\n\n 7 \n",  # 1: whitespace around is fine
        "<think></think>7",  # 1: empty reasoning is allowed
        "<think>3+4=7</think>",  # 0: no answer
        "<think>3+4=7</think>   \n",  # 0: whitespace-only answer
        "7",  # 0: no think block
        "<think>3+4=7",  # 0: unclosed
        "hello <think>a</think>7",  # 0: text before the block
        "<think>a</think>7</think>",  # 0: stray closing tag
        "<think>a<think>b</think>7",  # 0: nested open tag
        "<think>a</think>7<think>b</think>8",  # 0: two blocks
    ]
    assert format_reward([""] * len(completions), completions) == [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]


def test_format_reward_partial_credit_and_answer_tags():
    completions = [
        "<think>a</think>",
        "<think>a</think>7",
        "<think>a",
        "<think>a</think><answer>7</answer>",
        "<think>a</think> <answer> 7 </answer>\n",
        "<think>a</think><answer> </answer>",
        "<think>a</think><answer>7</answer>x",
        "<think>a</think><answer>7</answer></answer>",
    ]
    prompts = [""] * len(completions)
    assert format_reward(prompts, completions, partial_credit=0.5) == [0.5, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert format_reward(prompts, completions, answer_tags=True, partial_credit=0.5) == [
        0.5,
        0.5,
        0.0,
        1.0,
        1.0,
        0.5,
        0.5,
        0.5,
    ]
    with pytest.raises(ValueError, match="partial_credit"):
        format_reward([""], ["x"], partial_credit=2.0)


def test_format_reward_prompt_opens_think_block():
    """R1-Zero template: the prompt ends in <think>, so the completion continues the block."""
    prompts = ["Assistant: <think>", "Assistant: <think>\n", "Assistant:"]
    completions = ["3+4=7</think>7", "<think>3+4=7</think>7", "3+4=7</think>7"]
    assert format_reward(prompts, completions) == [1.0, 0.0, 0.0]


def test_regex_reward():
    completions = ["The answer is 42.", "answer: 42", "ANSWER IS 7", "line1\nanswer is 3"]
    prompts = [""] * 4
    assert regex_reward(prompts, completions, pattern=r"answer is \d+") == [1.0, 0.0, 0.0, 1.0]
    assert regex_reward(prompts, completions, pattern=r"answer is \d+", ignore_case=True) == [
        1.0,
        0.0,
        1.0,
        1.0,
    ]
    assert regex_reward(prompts, completions, pattern=r"answer: \d+", mode="fullmatch") == [
        0.0,
        1.0,
        0.0,
        0.0,
    ]
    assert regex_reward(prompts, completions, pattern=r"line1.answer.*", mode="fullmatch") == [0, 0, 0, 1]
    assert (
        regex_reward(prompts, completions, pattern=r"line1.answer.*", mode="fullmatch", dotall=False)
        == [0] * 4
    )
    with pytest.raises(ValueError, match="mode"):
        regex_reward(prompts, completions, pattern="x", mode="match")


def test_length_reward():
    completions = ["abcde", "ab", "abcdefgh", "one two three", ""]
    assert length_reward([""] * 5, completions, target=5) == [0.0, -3.0, -3.0, -8.0, -5.0]
    assert length_reward([""] * 5, completions, target=2, unit="words", scale=0.5) == [
        -0.5,
        -0.5,
        -0.5,
        -0.5,
        -1.0,
    ]
    with pytest.raises(ValueError, match="unit"):
        length_reward([""], ["x"], target=1, unit="tokens")


def test_worked_solution_checks_every_step_not_only_the_answer():
    from tether.rewards.verifiers import worked_solution_reward

    right = "<think>7+5=12 c1|4+8+1=13 c1|</think>132"
    lucky = "<think>7+5=11 c1|4+8+1=13 c1|</think>132"  # a wrong column sum, the right answer anyway
    scores = worked_solution_reward(["47+85=", "47+85=", "47+85=", "what?"], [right, lucky, " " + right + "\n", right])
    assert scores == [1.0, 0.0, 1.0, None]
    assert task_reward(["47+85="], [lucky], answer=["132"]) == [1.0]  # the answer-only checker is fooled


def _timing_out_parse(pred, *args, **kwargs):
    """math-verify's own behaviour on a timeout: a warning, and an empty parse."""
    import logging

    logging.getLogger("math_verify.parser").warning(f"Timeout during parsing: {pred}")
    return []


def test_a_math_verify_timeout_raises_instead_of_scoring_zero(monkeypatch):
    import math_verify

    from tether.rewards import RewardComposer
    from tether.rewards.verifiers import VerificationTimeout

    gold = math_verify.parse("$2$")
    monkeypatch.setattr("tether.rewards.verifiers._parse_gold", lambda key, timeout: gold)
    monkeypatch.setattr(math_verify, "parse", _timing_out_parse)
    with pytest.raises(VerificationTimeout, match="ran out of time"):
        math_reward(["p"], ["\\boxed{2}"], ["2"])
    # a composer that scores failures 0 counts the timeout apart from other errors
    composer = RewardComposer([{"name": "math"}], on_error="zero")
    metrics = composer.score(["p", "p"], ["\\boxed{2}", "\\boxed{3}"], {"answer": ["2", "2"]}).metrics()
    assert metrics["reward/math/timeouts"] == 2.0 and metrics["reward/math/errors"] == 2.0


def test_an_overlong_answer_scores_zero_without_being_parsed(monkeypatch):
    import math_verify

    def never(*args, **kwargs):
        raise AssertionError("parsed an answer longer than max_answer_chars")

    assert math_reward(["p"], ["\\boxed{2}"], ["2"]) == [1.0]
    monkeypatch.setattr(math_verify, "parse", never)
    monkeypatch.setattr("tether.rewards.verifiers._parse_gold", lambda key, timeout: [2, "2"])
    assert math_reward(["p"], ["\\boxed{" + "1+" * 300 + "1}"], ["2"], max_answer_chars=512) == [0.0]


def test_language_consistency_reward_by_hand():
    from tether.rewards.verifiers import REWARD_FUNCTIONS

    fn = REWARD_FUNCTIONS.get("language_consistency")
    completions = ["<think>7+5=12 c1|</think>12", "<think>H+F=BC cB|1+1=2</think>12", "12", "<think>ok</think>1"]
    # 4 of 4 own; H F BC B letters, 1 1 2 digits -> 3 of 7; no block; no number word
    assert fn(["EH+IF="] * 4, completions) == [1.0, pytest.approx(3 / 7), None, None]
    # a prompt that opens the block: the completion continues it
    assert fn(["7+5=<think>"], ["A+B=C</think>3"]) == [0.0]
    assert fn(["p"], ["<think>ab 1</think>"], own="ab", other="0123456789") == [0.5]
