"""Evaluation figures read from the policy's own likelihoods: held-out perplexity, and whether ranking a
prompt's sampled completions by likelihood agrees with ranking them by reward.

Each entry of ``LIKELIHOOD_METRICS`` is ``fn(**inputs) -> {name: value}`` and declares with ``needs`` which
inputs it reads, so an evaluation computes only those (an extra forward pass each):

- ``reference``: :class:`SequenceLikelihoods` of held-out texts (a task's reference completions given
  their prompts, or the user's records);
- ``samples``: :class:`SequenceLikelihoods` of the sampled completions, with their rewards and the prompt
  each belongs to (needs ``eval.samples`` > 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tether.core.registry import Registry

if TYPE_CHECKING:  # tensor methods only: the config layer reads this registry's names without loading torch
    from torch import Tensor

LIKELIHOOD_METRICS: Registry = Registry("likelihood metric")


@dataclass(frozen=True)
class SequenceLikelihoods:
    """Per-sequence likelihoods under the policy, each shape (N,).

    ``logprob``: the summed log-probability of the scored tokens, ``sum_t log pi(y_t | x, y_<t)``;
    ``tokens``: how many tokens were scored; ``rewards`` / ``groups`` (sampled completions only): each
    one's reward and the index of its prompt."""

    logprob: Tensor
    tokens: Tensor
    rewards: Tensor | None = None
    groups: Tensor | None = None


def perplexity(nll: Tensor, tokens: Tensor) -> Tensor:
    """Token-weighted perplexity ``exp(sum_i NLL_i / sum_i T_i)`` of a corpus of sequences.

    ``nll``: shape (N,), each sequence's summed negative log-likelihood; ``tokens``: shape (N,), its
    scored tokens. This is the exponent of the per-token cross-entropy of the whole corpus (Jelinek et
    al. 1977; the definition language-modelling papers report), the same token mean the SFT loss
    takes, so ``log perplexity`` is comparable with the training loss. It is *not* the mean of
    per-sequence perplexities: that mean weights a 3-token answer like a 300-token one and, exp being
    convex, is pulled up by the short, noisy sequences.
    """
    total = tokens.sum()
    if not bool(total > 0):
        raise ValueError("perplexity needs at least one scored token; give held-out texts with non-empty "
                         "completions")
    return (nll.sum() / total).exp()


def pairwise_concordance(scores: Tensor, rewards: Tensor, groups: Tensor) -> tuple[Tensor, Tensor]:
    """Share of same-prompt pairs with different rewards that ``scores`` order as the rewards do.

    ``scores``, ``rewards``, ``groups``: shape (N,), one per completion; ``groups[i]`` is its prompt.
    Over every pair (i, j) with ``groups[i] == groups[j]`` and ``rewards[i] > rewards[j]`` (pairs tied
    in reward, or with a NaN reward, carry no order and are left out) a pair counts 1 when
    ``scores[i] > scores[j]``, 1/2 when the scores tie and 0 otherwise. This is Kendall's (1938)
    concordance restricted to pairs within a prompt -- Harrell's C, or ``(1 + tau) / 2`` without
    ties -- pooled over prompts, so every informative pair weighs the same: 1 is perfect agreement,
    0.5 chance (or a constant score), 0 a reversed ranking. Returns ``(concordance, pairs)``;
    concordance is NaN when there is no such pair.
    """
    if not scores.shape == rewards.shape == groups.shape or scores.dim() != 1:
        raise ValueError(f"scores, rewards and groups must be 1-D of one length, got {tuple(scores.shape)}, "
                         f"{tuple(rewards.shape)} and {tuple(groups.shape)}")
    ordered = (groups[:, None] == groups[None, :]) & (rewards[:, None] > rewards[None, :])
    diff = scores[:, None].double() - scores[None, :].double()
    credit = (diff > 0).double() + 0.5 * (diff == 0).double()
    pairs = ordered.sum()
    return (credit * ordered).sum() / pairs if bool(pairs > 0) else scores.new_tensor(float("nan"), dtype=credit.dtype), pairs


@LIKELIHOOD_METRICS.register("perplexity", needs=("reference",))
def perplexity_metric(*, reference: SequenceLikelihoods, **_: SequenceLikelihoods) -> dict[str, Tensor]:
    """``perplexity`` of the held-out texts (:func:`perplexity`) and ``perplexity/tokens``, the tokens it
    averages over."""
    return {"perplexity": perplexity(-reference.logprob, reference.tokens), "perplexity/tokens": reference.tokens.sum()}


@LIKELIHOOD_METRICS.register("likelihood_reward_agreement", needs=("samples",))
def likelihood_reward_agreement(*, samples: SequenceLikelihoods, **_: SequenceLikelihoods) -> dict[str, Tensor]:
    """:func:`pairwise_concordance` of likelihood with reward over each prompt's sampled completions.

    The headline ``likelihood_reward_agreement`` ranks by the length-normalised log-likelihood (mean
    log-prob per token, as SimPO and length-normalised best-of-n score): the summed log-likelihood
    falls with every token, so it mostly ranks by shortness; ``likelihood_reward_agreement/summed``
    reports that ranking beside it, and ``/pairs`` the number of pairs with different rewards.
    """
    if samples.rewards is None or samples.groups is None:
        raise ValueError("likelihood_reward_agreement needs sampled completions with rewards; set eval.samples > 1")
    normalised = samples.logprob / samples.tokens.clamp(min=1)
    agreement, pairs = pairwise_concordance(normalised, samples.rewards, samples.groups)
    summed, _ = pairwise_concordance(samples.logprob, samples.rewards, samples.groups)
    return {"likelihood_reward_agreement": agreement, "likelihood_reward_agreement/summed": summed,
            "likelihood_reward_agreement/pairs": pairs}
