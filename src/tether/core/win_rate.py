"""Win rates of model A against model B from a pairwise judge asked in both orders, and from a verifier.

Each prompt's two answers are judged twice (Zheng et al. 2023, "Judging LLM-as-a-Judge with MT-Bench and
Chatbot Arena", Sec. 3.4, "swap positions"): once with A's answer shown first (the *forward* order) and
once with B's shown first (the *backward* order). A verdict names a **position**, ``"A"`` (the first
answer shown), ``"B"`` (the second) or ``"tie"``, or is None (the reply could not be parsed). Per prompt:

- **A wins** / **B wins**: both orders pick the same model;
- **tie** otherwise, split in ``both_tie`` (both orders say tie), ``inconsistent`` (the orders disagree:
  the verdict followed the position, not the answer) and ``unparseable`` (an order gave no verdict);
- ``win_rate = (a_wins + ties / 2) / n``, every tie counted half (no evidence for either model);
- ``position_consistency``: the share of prompts with both verdicts parsed whose orders agree (both-tie
  included), as ``judge/consistency`` of :class:`~tether.rewards.judge.PairwiseJudge`;
- ``first_position_rate``: of the single verdicts that pick a position (ties and None aside, both orders),
  the share that picks the first one. Each model is shown first equally often, so answer quality cancels
  and 0.5 means no position bias (Zheng et al. report the same bias as a share of inconsistent pairs).

Self-preference bias (Panickssery et al. 2024, "LLM Evaluators Recognize and Favor Their Own
Generations"): when the judge is one of the two models, ``judge win rate of its own model - verifier win
rate of that model`` on the same prompts; positive: the judge favours itself beyond what correctness
justifies. The verifier's outcome per prompt is 1 (only A correct), 0 (only B correct) or 1/2 (both or
neither), so both win rates count ties the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

from tether.core.statistics import wilson_interval

Verdict = Literal["A", "B", "tie"] | None
Outcome = Literal["a_wins", "b_wins", "both_tie", "inconsistent", "unparseable"]
VERDICTS = ("A", "B", "tie", None)


def _check(verdict: Verdict) -> None:
    if verdict not in VERDICTS:
        raise ValueError(f"a verdict is 'A', 'B', 'tie' or None (unparseable), got {verdict!r}")


def swapped_outcome(forward: Verdict, backward: Verdict) -> Outcome:
    """One prompt's outcome from the verdict with A's answer first (``forward``) and with B's answer first
    (``backward``, where position ``"A"`` holds model B's answer)."""
    _check(forward)
    _check(backward)
    if forward is None or backward is None:
        return "unparseable"
    picked_forward = {"A": "a", "B": "b", "tie": "tie"}[forward]
    picked_backward = {"A": "b", "B": "a", "tie": "tie"}[backward]
    if picked_forward != picked_backward:
        return "inconsistent"
    return {"a": "a_wins", "b": "b_wins", "tie": "both_tie"}[picked_forward]  # type: ignore[return-value]


def outcome_value(outcome: Outcome) -> float:
    """Model A's score for one prompt: 1 (A wins), 0 (B wins), 1/2 (any tie)."""
    return {"a_wins": 1.0, "b_wins": 0.0}.get(outcome, 0.5)


@dataclass(frozen=True)
class SwapCounts:
    """Counts over ``n`` prompts judged in both orders; ``ties = both_tie + inconsistent + unparseable``."""

    n: int
    a_wins: int
    b_wins: int
    both_tie: int
    inconsistent: int
    unparseable: int
    first_chosen: int  # single verdicts that picked the first position shown
    decisive: int  # single verdicts that picked a position (not a tie, not None)

    @property
    def ties(self) -> int:
        return self.both_tie + self.inconsistent + self.unparseable

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "ties": self.ties}


def count_swapped_verdicts(forward: Sequence[Verdict], backward: Sequence[Verdict]) -> SwapCounts:
    """:class:`SwapCounts` of prompts whose verdicts in the two orders are ``forward[i]`` and ``backward[i]``."""
    if len(forward) != len(backward):
        raise ValueError(f"need one verdict per order per prompt, got {len(forward)} forward and "
                         f"{len(backward)} backward")
    outcomes = [swapped_outcome(f, b) for f, b in zip(forward, backward, strict=True)]
    singles = [*forward, *backward]
    return SwapCounts(n=len(outcomes), a_wins=outcomes.count("a_wins"), b_wins=outcomes.count("b_wins"),
                      both_tie=outcomes.count("both_tie"), inconsistent=outcomes.count("inconsistent"),
                      unparseable=outcomes.count("unparseable"), first_chosen=singles.count("A"),
                      decisive=singles.count("A") + singles.count("B"))


def win_rate(wins: float, ties: float, n: int) -> float:
    """``(wins + ties / 2) / n``: a tie counts half a win."""
    if n <= 0 or wins < 0 or ties < 0 or wins + ties > n:
        raise ValueError(f"need n > 0 and 0 <= wins + ties <= n, got wins={wins}, ties={ties}, n={n}")
    return (wins + ties / 2) / n


def win_rate_interval(wins: float, ties: float, n: int) -> tuple[float, float]:
    """95% Wilson interval of :func:`win_rate`, on the fractional count ``wins + ties / 2``. A prompt's score
    is 0, 1/2 or 1, whose variance is at most ``p(1 - p)`` (the Bernoulli one), so the interval is
    conservative when there are ties."""
    win_rate(wins, ties, n)  # the same checks
    return wilson_interval(wins + ties / 2, n)  # type: ignore[arg-type]


def position_consistency(counts: SwapCounts) -> float | None:
    """Share of prompts with both verdicts parsed whose two orders agree; None when none was parsed."""
    judged = counts.n - counts.unparseable
    return (counts.a_wins + counts.b_wins + counts.both_tie) / judged if judged else None


def first_position_rate(counts: SwapCounts) -> float | None:
    """Share of position-picking verdicts that pick the first answer shown (0.5: no position bias)."""
    return counts.first_chosen / counts.decisive if counts.decisive else None


def verifier_outcome(correct_a: bool, correct_b: bool) -> float:
    """Model A's score for one prompt by a verifier: 1 (only A correct), 0 (only B), 1/2 (both or neither)."""
    return 0.5 if bool(correct_a) == bool(correct_b) else float(bool(correct_a))


def judge_verifier_agreement(judge: Sequence[float], verifier: Sequence[float]) -> tuple[float | None, int]:
    """On the prompts both decide (judge score and verifier score each 0 or 1, see :func:`outcome_value` and
    :func:`verifier_outcome`), the share where they pick the same model, and how many such prompts there are."""
    if len(judge) != len(verifier):
        raise ValueError(f"need one judge and one verifier score per prompt, got {len(judge)} and {len(verifier)}")
    decided = [(j, v) for j, v in zip(judge, verifier, strict=True) if j != 0.5 and v != 0.5]
    return (sum(j == v for j, v in decided) / len(decided) if decided else None), len(decided)


def self_preference_bias(judge_win_rate_own: float, verifier_win_rate_own: float) -> float:
    """Panickssery et al. 2024: the judge's win rate for its own model minus the verifier's win rate for that
    model on the same prompts; positive: the judge favours its own answers beyond their correctness."""
    return judge_win_rate_own - verifier_win_rate_own


def verdict_accuracy(counts: SwapCounts) -> dict[str, float]:
    """A judge's agreement with known labels, from :class:`SwapCounts` of pairs whose model A is the right
    answer and model B the wrong one (each asked in both orders, so the right answer is shown first half the
    time; Zheng et al. 2023, Sec. 3.4):

    - ``verdict_accuracy = a_wins / n``: pairs whose combined verdict names the right answer (a tie,
      inconsistent orders and an unparseable reply all count as not right);
    - ``decisive_rate = (a_wins + b_wins) / n``: pairs with a combined verdict that picks a side, the pairs an
      online preference loop (OAIF) trains on;
    - ``decisive_accuracy = a_wins / (a_wins + b_wins)``: of those, the share the right way round (1 when
      every pair trained on is labelled right; 0.5 is a coin), absent when none is decisive;
    - ``position_consistency`` and ``first_position_rate`` as :func:`position_consistency` and
      :func:`first_position_rate`, absent where undefined.
    """
    if counts.n <= 0:
        raise ValueError("verdict_accuracy needs at least one pair")
    decided = counts.a_wins + counts.b_wins
    out = {"verdict_accuracy": counts.a_wins / counts.n, "decisive_rate": decided / counts.n}
    if decided:
        out["decisive_accuracy"] = counts.a_wins / decided
    for name, value in (("position_consistency", position_consistency(counts)),
                        ("first_position_rate", first_position_rate(counts))):
        if value is not None:
            out[name] = value
    return out
