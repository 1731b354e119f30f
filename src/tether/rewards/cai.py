"""AI feedback against a constitution: critique-and-revise chains, position-swapped preference labels
with the judge's biases measured, and a judge's pointwise score as a live reward.

- :func:`critique_and_revise` (SL-CAI; Bai et al. 2022, "Constitutional AI", Sec. 3.1): for each
  (prompt, response), ``rounds`` times: sample a principle, ask the judge for a critique of the
  current response by its critique request (``cai-critique`` template), then for a revision by its
  revision request, given that critique (``cai-revision``); the revision becomes the current response.
  Every step is kept. How it departs: each round is a fresh, zero-shot context holding only the
  current response (Bai et al. prepend few-shot examples and keep the whole chain in context); an
  empty revision keeps the previous response and is counted.
- :func:`preference_labels` (RLAIF; Bai et al. Sec. 4.1, Lee et al. 2023, "RLAIF vs. RLHF", Sec. 2.1):
  a pairwise judge compares two responses against a sampled principle's comparison question, once in
  each order (position swap); two verdicts that agree give the label, disagreeing ones a tie (0.5),
  as :class:`~tether.rewards.judge.PairwiseJudge` combines them. Lee et al. average the two orders'
  preference probabilities; with text verdicts that average is this rule.
- :func:`judge_bias`: position consistency, the first-position preference rate, and the correlation
  of the judge's preference with response length (Zheng et al. 2023, Sec. 3.3; Wang et al. 2023).
- ``judge`` reward (d-RLAIF; Lee et al. 2023, Sec. 2.3): a pointwise judge scores each completion on
  its scale, rescaled to [-1, 1] (``normalize``), inside any RL trainer's reward list.

The judge backend is any of :mod:`tether.rewards.judge`'s: a local model through the rollout engine,
an OpenAI-compatible endpoint (``tether serve``), or a Python function from judge prompts to replies.
Knows nothing about training.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from tether.rewards.constitution import Constitution, Principle, fill, load_constitution
from tether.rewards.judge import PairwiseJudge, PointwiseJudge, as_backend, load_template
from tether.rewards.verifiers import REWARD_FUNCTIONS


def principle_rng(seed: int, index: int, round_: int = 0) -> random.Random:
    """The generator that picks example ``index``'s principle in round ``round_``: a function of the three,
    so a resumed or re-batched run picks the same principles."""
    return random.Random(f"constitution:{seed}:{index}:{round_}")


def _replies(backend: Callable, texts: list[str]) -> list[str]:
    return [(group[0] if group else "").strip() for group in backend(texts, 1)]


def critique_and_revise(backend: Callable, constitution: Constitution | str, prompts: Sequence[str],
                        responses: Sequence[str], *, rounds: int = 1, seed: int = 0,
                        critique_template: str = "cai-critique", revision_template: str = "cai-revision",
                        offset: int = 0) -> tuple[list[dict], dict[str, float]]:
    """SL-CAI chains: ``rounds`` critique -> revision steps per (prompt, response).

    ``backend``: a judge backend (``fn(texts, n) -> [[reply, ...], ...]``) or a plain ``fn(texts) ->
    replies``. ``offset``: the index of the first example (principle sampling is keyed by it). Returns one
    record per example, ``{"prompt", "initial", "revision" (the final one), "chain": [{"round",
    "principle", "critique", "revision"}, ...]}``, and figures: ``chain/revised`` (share whose final
    revision differs from the initial response), ``chain/empty_revisions`` (replies that were empty,
    so the response stayed as it was), ``chain/mean_changes`` (revisions that changed the text, per example).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if len(prompts) != len(responses):
        raise ValueError(f"got {len(prompts)} prompts for {len(responses)} responses")
    constitution = load_constitution(constitution)
    backend = as_backend(backend)
    critique_t, revision_t = load_template(critique_template), load_template(revision_template)
    current = list(responses)
    chains: list[list[dict]] = [[] for _ in prompts]
    empty = changes = 0
    for r in range(rounds):
        principles = [constitution.sample(principle_rng(seed, offset + i, r)) for i in range(len(prompts))]
        critiques = _replies(backend, [fill(critique_t, prompt=p, response=c, critique_request=pr.critique_request)
                                       for p, c, pr in zip(prompts, current, principles, strict=True)])
        revisions = _replies(backend, [
            fill(revision_t, prompt=p, response=c, critique_request=pr.critique_request, critique=k,
                 revision_request=pr.revision_request)
            for p, c, pr, k in zip(prompts, current, principles, critiques, strict=True)])
        for i, (pr, k, v) in enumerate(zip(principles, critiques, revisions, strict=True)):
            chains[i].append({"round": r + 1, "principle": pr.name, "critique": k, "revision": v})
            if not v:
                empty += 1
                continue
            changes += v != current[i]
            current[i] = v
    records = [{"prompt": p, "initial": a, "revision": c, "chain": chain}
               for p, a, c, chain in zip(prompts, responses, current, chains, strict=True)]
    n = max(len(records), 1)
    figures = {"chain/examples": float(len(records)), "chain/rounds": float(rounds),
               "chain/revised": sum(r["revision"] != r["initial"] for r in records) / n,
               "chain/empty_revisions": float(empty), "chain/mean_changes": changes / n}
    return records, figures


# ---- AI preference labels ------------------------------------------------------------------------------

_ORDER = {"A": 1.0, "B": 0.0, "tie": 0.5}


def preference_labels(judge: PairwiseJudge, constitution: Constitution | str, prompts: Sequence[str],
                      responses_a: Sequence[str], responses_b: Sequence[str], *, seed: int = 0, offset: int = 0
                      ) -> list[dict]:
    """Position-swapped AI labels: per pair ``{"principle", "forward", "backward", "p_a"}``.

    ``forward`` is P(a better) read with a shown first, ``backward`` with b shown first (already mapped
    back to a's side); ``p_a`` combines them: the shared value when they agree, 0.5 when they do not,
    None when either reply could not be read. Both orders of every pair go to the judge in one batch
    per principle. The judge's own ``swap`` is not used (the swap is done here, so both orders' verdicts
    are kept for :func:`judge_bias`).
    """
    if not len(prompts) == len(responses_a) == len(responses_b):
        raise ValueError("preference_labels needs as many prompts as responses_a and responses_b")
    constitution = load_constitution(constitution)
    chosen: list[Principle] = [constitution.sample(principle_rng(seed, offset + i)) for i in range(len(prompts))]
    groups: dict[str, list[int]] = defaultdict(list)
    for i, p in enumerate(chosen):
        groups[p.name].append(i)
    labels: list[dict] = [{} for _ in prompts]
    saved = judge.principle, judge.swap
    try:
        judge.swap = False
        for name, idx in groups.items():
            judge.principle = constitution.get(name).comparison_text
            ps, a, b = [prompts[i] for i in idx], [responses_a[i] for i in idx], [responses_b[i] for i in idx]
            both = judge.compare([*ps, *ps], [*a, *b], [*b, *a])
            for k, i in enumerate(idx):
                forward, swapped = both[k], both[len(idx) + k]
                backward = None if swapped is None else 1.0 - swapped
                labels[i] = {"principle": name, "forward": forward, "backward": backward,
                             "p_a": combine_orders(forward, backward)}
    finally:
        judge.principle, judge.swap = saved
    return labels


def combine_orders(forward: float | None, backward: float | None) -> float | None:
    """P(a better) from the two orders' verdicts (each already on a's side): agreement keeps it, a
    disagreement is a tie, a missing verdict makes the label missing."""
    if forward is None or backward is None:
        return None
    return forward if forward == backward else 0.5


def judge_bias(labels: Sequence[dict], responses_a: Sequence[str], responses_b: Sequence[str]) -> dict[str, float]:
    """The judge's biases over a labelling run.

    - ``bias/position_consistency``: share of pairs, both orders read, whose two verdicts agree.
    - ``bias/first_position_rate``: of the single-order verdicts that pick a side, the share picking
      the response shown first (0.5 = no position bias).
    - ``bias/length_correlation``: Pearson correlation between the label ``p_a`` and the length
      difference ``len(a) - len(b)`` (characters) over labelled pairs; 0 = length-blind.
    - ``bias/longer_preferred_rate``: of decided pairs (``p_a`` 0 or 1) of unequal length, the share
      whose chosen response is the longer one.
    """
    read = [lab for lab in labels if lab["forward"] is not None and lab["backward"] is not None]
    firsts = [lab["forward"] for lab in labels if lab["forward"] in (0.0, 1.0)]
    # in the swapped order b was first, so "first wins" is a's backward value being 0
    firsts += [1.0 - lab["backward"] for lab in labels if lab["backward"] in (0.0, 1.0)]
    out = {"labels/pairs": float(len(labels)),
           "labels/missing": float(sum(lab["p_a"] is None for lab in labels)),
           "labels/ties": float(sum(lab["p_a"] == 0.5 for lab in labels))}
    if read:
        out["bias/position_consistency"] = sum(lab["forward"] == lab["backward"] for lab in read) / len(read)
    if firsts:
        out["bias/first_position_rate"] = sum(firsts) / len(firsts)
    pairs = [(lab["p_a"], len(a) - len(b)) for lab, a, b in zip(labels, responses_a, responses_b, strict=True)
             if lab["p_a"] is not None]
    corr = _pearson([p for p, _ in pairs], [float(d) for _, d in pairs])
    if corr is not None:
        out["bias/length_correlation"] = corr
    decided = [(p, d) for p, d in pairs if p in (0.0, 1.0) and d != 0]
    if decided:
        out["bias/longer_preferred_rate"] = sum((p == 1.0) == (d > 0) for p, d in decided) / len(decided)
    return out


def _pearson(x: Sequence[float], y: Sequence[float]) -> float | None:
    n = len(x)
    if n < 2:
        return None
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None


# ---- d-RLAIF: the judge's score as the reward ----------------------------------------------------------

@REWARD_FUNCTIONS.register("judge", needs=("judge",))
def judge_reward(prompts: Sequence[str], completions: Sequence[str], *, judge: PointwiseJudge,
                 normalize: bool = True, constitution: str | None = None, seed: int = 0,
                 **columns: Any) -> list[float | None]:
    """d-RLAIF reward for configs: ``{name: judge, kwargs: {judge: {JudgeConfig fields}, normalize: true}}``.

    A pointwise judge scores each completion; ``normalize`` maps its scale to [-1, 1] as Lee et al. do.
    The entry declares ``needs=("judge",)``: the config's judge block is built into a judge (and kept)
    by :func:`tether.scoring.reward_composer`, which every stage uses. With ``constitution``, each
    completion is judged against a principle drawn from it (its critique request), keyed by a hash of
    the prompt and completion so a repeated sample gets the same principle. A reply with no readable
    score gives None (no reward for that sample)."""
    if not isinstance(judge, PointwiseJudge):
        raise TypeError("the judge reward needs a built pointwise judge; a config's judge block is built by "
                        "tether.scoring.reward_composer")
    scorer = judge
    if constitution is None:
        scores = scorer.score(list(prompts), list(completions))
    else:
        scores = _score_by_principle(scorer, load_constitution(constitution), prompts, completions, seed)
    if not normalize:
        return scores
    low, high = scorer.scale
    return [None if s is None else 2.0 * (s - low) / (high - low) - 1.0 for s in scores]


def _score_by_principle(scorer: PointwiseJudge, constitution: Constitution, prompts: Sequence[str],
                        completions: Sequence[str], seed: int) -> list[float | None]:
    groups: dict[str, list[int]] = defaultdict(list)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        digest = int.from_bytes(hashlib.sha256(f"{seed}\0{p}\0{c}".encode()).digest()[:8], "big")
        groups[constitution.sample(random.Random(digest)).name].append(i)
    out: list[float | None] = [None] * len(completions)
    saved = scorer.principle
    try:
        for name, idx in groups.items():
            scorer.principle = constitution.get(name).critique_request
            for i, s in zip(idx, scorer.score([prompts[i] for i in idx], [completions[i] for i in idx]), strict=True):
                out[i] = s
    finally:
        scorer.principle = saved
    return out
