"""Offline preference losses: the DPO family over (chosen, rejected) pairs, and unpaired KTO.

Every paired loss is ``fn(inputs: PreferenceInputs, *, beta, <own hparams>) -> (loss, metrics)``
registered in ``PREFERENCE_LOSSES`` under the name configs use. Sequence log-probs are *summed*
over completion tokens (``sequence_logprobs(..., average=False)``); losses that need a per-token
average (SimPO, ORPO, IPO with ``length_normalize``) divide by ``chosen_lengths`` /
``rejected_lengths`` themselves. The batch reduction is a weighted mean
``sum_i w_i l_i / sum_i w_i`` (plain mean without weights); weights are treated as constants.

Notation: ``h = (log π(y_c) - log π_ref(y_c)) - (log π(y_r) - log π_ref(y_r))``, the difference of
the chosen and rejected log-ratios, and ``r = β (log π - log π_ref)`` the DPO implicit reward.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tether.core.logprobs import sequence_logprobs
from tether.core.registry import Registry

Metrics = dict[str, Tensor]

PREFERENCE_LOSSES: Registry = Registry("preference loss")
UNPAIRED_LOSSES: Registry = Registry("unpaired preference loss")


@dataclass
class PreferenceInputs:
    """Per-pair sequence statistics of a batch of preference pairs; each tensor has shape (B,) unless noted."""

    chosen_logps: Tensor  # shape (B,), summed log-prob of the chosen completion under the policy
    rejected_logps: Tensor  # shape (B,)
    ref_chosen_logps: Tensor | None = None  # shape (B,), None for reference-free losses
    ref_rejected_logps: Tensor | None = None  # shape (B,)
    chosen_lengths: Tensor | None = None  # shape (B,), completion token counts (SimPO / ORPO / IPO)
    rejected_lengths: Tensor | None = None  # shape (B,)
    chosen_nll: Tensor | None = None  # shape (B,), mean per-token NLL of chosen under the policy (RPO, ORPO)
    weights: Tensor | None = None  # shape (B,), per-pair weights (WPO), applied as a weighted mean
    chosen_win_prob: Tensor | None = None  # shape (B,), P(y_c ≻ π_t) estimated over K samples (SPPO)
    rejected_win_prob: Tensor | None = None  # shape (B,)
    chosen_seq_kl: Tensor | None = None  # shape (B,), Σ_t KL(π_ref(·|x,y<t) ‖ π(·|x,y<t)) over y_c (TDPO)
    rejected_seq_kl: Tensor | None = None  # shape (B,)
    chosen_turn_logps: Tensor | None = None  # shape (B, K), summed policy log-prob of each assistant turn (DMPO)
    rejected_turn_logps: Tensor | None = None  # shape (B, K'), 0 past a trajectory's last turn
    ref_chosen_turn_logps: Tensor | None = None  # shape (B, K), the same under the reference
    ref_rejected_turn_logps: Tensor | None = None  # shape (B, K')
    chosen_turns: Tensor | None = None  # shape (B,), assistant turns of the chosen trajectory
    rejected_turns: Tensor | None = None  # shape (B,)


def _require(inputs: PreferenceInputs, loss: str, *fields: str) -> None:
    missing = [f for f in fields if getattr(inputs, f) is None]
    if missing:
        raise ValueError(f"preference loss {loss!r} needs PreferenceInputs.{', '.join(missing)}")


def _batch_mean(per_pair: Tensor, weights: Tensor | None) -> Tensor:
    if weights is None:
        return per_pair.mean()
    weights = weights.detach().to(per_pair.dtype)
    return (per_pair * weights).sum() / weights.sum().clamp(min=torch.finfo(per_pair.dtype).tiny)


def _logratios(inputs: PreferenceInputs, loss: str) -> tuple[Tensor, Tensor]:
    _require(inputs, loss, "ref_chosen_logps", "ref_rejected_logps")
    return (
        inputs.chosen_logps - inputs.ref_chosen_logps,
        inputs.rejected_logps - inputs.ref_rejected_logps,
    )


def _mean_logps(inputs: PreferenceInputs, loss: str) -> tuple[Tensor, Tensor]:
    _require(inputs, loss, "chosen_lengths", "rejected_lengths")
    return (
        inputs.chosen_logps / inputs.chosen_lengths.clamp(min=1),
        inputs.rejected_logps / inputs.rejected_lengths.clamp(min=1),
    )


def _chosen_nll(inputs: PreferenceInputs, loss: str) -> Tensor:
    if inputs.chosen_nll is not None:
        return inputs.chosen_nll
    # With summed completion log-probs and lengths, the mean NLL is exactly -sum / length.
    if inputs.chosen_lengths is None:
        raise ValueError(f"preference loss {loss!r} needs PreferenceInputs.chosen_nll or chosen_lengths")
    return -inputs.chosen_logps / inputs.chosen_lengths.clamp(min=1)


NLL_NORMS = ("sequence", "token")


def _nll_term(inputs: PreferenceInputs, loss: str, nll_norm: str) -> tuple[Tensor, Tensor]:
    """The chosen NLL of RPO / ORPO: per pair, and the scalar that enters the loss.

    ``sequence``: the mean over pairs of each chosen completion's mean per-token NLL (the papers' 1/|y_c|
    per sequence; pair weights apply). ``token``: the mean over every chosen token of the batch, sum_i NLL_i
    / sum_i |y_c,i| (TRL's DPOTrainer ``rpo_alpha`` and ORPOTrainer convention: long completions weigh more;
    pair weights do not apply). Equal when all chosen completions have the same length.
    """
    nll = _chosen_nll(inputs, loss)
    if nll_norm == "sequence":
        return nll, _batch_mean(nll, inputs.weights)
    if nll_norm != "token":
        raise ValueError(f"nll_norm must be one of {', '.join(NLL_NORMS)}, got {nll_norm!r}")
    _require(inputs, f"{loss} with nll_norm='token'", "chosen_lengths")
    lengths = inputs.chosen_lengths.clamp(min=1).to(nll.dtype)
    return nll, (nll * lengths).sum() / lengths.sum()


def _reward_metrics(chosen: Tensor, rejected: Tensor, inputs: PreferenceInputs) -> Metrics:
    chosen, rejected = chosen.detach(), rejected.detach()
    return {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/margin": (chosen - rejected).mean(),
        "rewards/accuracy": (chosen > rejected).float().mean(),
        "logps/chosen": inputs.chosen_logps.detach().mean(),
        "logps/rejected": inputs.rejected_logps.detach().mean(),
    }


def _ref_based(inputs: PreferenceInputs, loss: str, beta: float) -> tuple[Tensor, Tensor, Tensor, Metrics]:
    """Log-ratios, h, and the implicit-reward metrics shared by every reference-based loss."""
    lr_c, lr_r = _logratios(inputs, loss)
    return lr_c, lr_r, lr_c - lr_r, _reward_metrics(beta * lr_c, beta * lr_r, inputs)


@PREFERENCE_LOSSES.register("sigmoid")
def sigmoid_loss(inputs: PreferenceInputs, *, beta: float = 0.1) -> tuple[Tensor, Metrics]:
    """DPO: the Bradley-Terry likelihood of the implicit reward margin.

    Rafailov et al. 2023, "Direct Preference Optimization", Eq. 7: ``l = -log σ(β h)``.
    As in the paper.
    """
    _, _, h, metrics = _ref_based(inputs, "sigmoid", beta)
    return _batch_mean(-F.logsigmoid(beta * h), inputs.weights), metrics


@PREFERENCE_LOSSES.register("cdpo")
def cdpo_loss(
    inputs: PreferenceInputs, *, beta: float = 0.1, label_smoothing: float = 0.1
) -> tuple[Tensor, Metrics]:
    """Conservative DPO: DPO against labels flipped with probability ε (label smoothing).

    Mitchell 2023, "A note on DPO with noisy preferences and relationship to IPO":
    ``l = (1 - ε)(-log σ(β h)) + ε(-log σ(-β h))``. As in the note; ε = ``label_smoothing``
    in [0, 0.5]. Unlike DPO the optimum is a finite margin (σ(β h) = 1 - ε).
    """
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"cdpo label_smoothing must be in [0, 0.5], got {label_smoothing}")
    _, _, h, metrics = _ref_based(inputs, "cdpo", beta)
    eps = label_smoothing
    per_pair = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    return _batch_mean(per_pair, inputs.weights), metrics


@PREFERENCE_LOSSES.register("robust")
def robust_loss(
    inputs: PreferenceInputs, *, beta: float = 0.1, label_smoothing: float = 0.1
) -> tuple[Tensor, Metrics]:
    """Robust DPO: an unbiased estimate of the clean DPO loss under labels flipped with rate ε.

    Chowdhury et al. 2024, "Provably Robust DPO: Aligning Language Models with Noisy Feedback":
    ``l = ((1 - ε)(-log σ(β h)) - ε(-log σ(-β h))) / (1 - 2ε)``. As in the paper (and TRL's
    ``robust``); ε = ``label_smoothing`` in [0, 0.5). Note the minus: unlike cDPO this loss is
    unbounded below, because it debiases rather than regularises.
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"robust label_smoothing must be in [0, 0.5), got {label_smoothing}")
    _, _, h, metrics = _ref_based(inputs, "robust", beta)
    eps = label_smoothing
    per_pair = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    return _batch_mean(per_pair, inputs.weights), metrics


@PREFERENCE_LOSSES.register("ipo")
def ipo_loss(
    inputs: PreferenceInputs, *, beta: float = 0.1, length_normalize: bool = False
) -> tuple[Tensor, Metrics]:
    """IPO: regress the log-ratio margin onto a fixed target instead of pushing it to infinity.

    Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", Eq. 17: ``l = (h - 1/(2β))²`` (their τ is β here).

    By default h uses summed sequence log-probs, as the paper writes it. TRL instead divides each
    log-ratio by its completion length (it reports the IPO authors confirmed their experiments did
    so); ``length_normalize=True`` does the same, needs ``chosen_lengths`` / ``rejected_lengths``,
    and with it β's scale is per token rather than per sequence.
    """
    lr_c, lr_r, h, metrics = _ref_based(inputs, "ipo", beta)
    if length_normalize:
        _require(inputs, "ipo", "chosen_lengths", "rejected_lengths")
        h = lr_c / inputs.chosen_lengths.clamp(min=1) - lr_r / inputs.rejected_lengths.clamp(min=1)
    return _batch_mean((h - 1 / (2 * beta)) ** 2, inputs.weights), metrics


@PREFERENCE_LOSSES.register("hinge")
def hinge_loss(inputs: PreferenceInputs, *, beta: float = 0.1) -> tuple[Tensor, Metrics]:
    """Hinge loss on the reference-normalised log-likelihood margin.

    Liu et al. 2023, "Statistical Rejection Sampling Improves Preference Optimization" (RSO):
    ``l = max(0, 1 - β h)``. SLiC-HF (Zhao et al. 2023) uses the same hinge on the raw
    policy margin ``max(0, δ - log π(y_c) + log π(y_r))`` plus an SFT term; this is RSO's
    reference-normalised form (margin 1/β), without SLiC's regulariser.
    """
    _, _, h, metrics = _ref_based(inputs, "hinge", beta)
    return _batch_mean(torch.relu(1 - beta * h), inputs.weights), metrics


@PREFERENCE_LOSSES.register("rpo")
def rpo_loss(
    inputs: PreferenceInputs, *, beta: float = 0.1, rpo_alpha: float = 1.0, nll_norm: str = "sequence"
) -> tuple[Tensor, Metrics]:
    """RPO: DPO plus a negative log-likelihood term on the chosen completion.

    Pang et al. 2024, "Iterative Reasoning Preference Optimization" (and Liu et al. 2024,
    "Provably Mitigating Overoptimization in RLHF"): ``l = -log σ(β h) + α · NLL(y_c) / |y_c|``.
    The NLL is the mean per token (``chosen_nll``, or ``-chosen_logps / chosen_lengths`` when only
    lengths are given); α = ``rpo_alpha`` (TRL's name, default 1 as in Pang et al.). ``nll_norm``:
    ``sequence`` (the paper: a mean per sequence, then over pairs) or ``token`` (TRL: over all chosen
    tokens of the batch); see :func:`_nll_term`.
    """
    _, _, h, metrics = _ref_based(inputs, "rpo", beta)
    nll, nll_loss = _nll_term(inputs, "rpo", nll_norm)
    metrics["nll"] = nll.detach().mean()
    return _batch_mean(-F.logsigmoid(beta * h), inputs.weights) + rpo_alpha * nll_loss, metrics


@PREFERENCE_LOSSES.register("simpo")
def simpo_loss(
    inputs: PreferenceInputs, *, beta: float = 2.0, simpo_gamma: float = 1.0
) -> tuple[Tensor, Metrics]:
    """SimPO: reference-free DPO on length-averaged log-probs with a target margin γ.

    Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward",
    Eq. 6: ``l = -log σ(β/|y_c| log π(y_c) - β/|y_r| log π(y_r) - γ)``. As in the paper.
    Defaults differ from the other losses' β = 0.1: rewards here are per-token averages, and the
    paper trains with β around 2 and γ/β of 0.5 to 0.8. Reported rewards are SimPO's
    ``β/|y| log π(y)``.
    """
    avg_c, avg_r = _mean_logps(inputs, "simpo")
    r_c, r_r = beta * avg_c, beta * avg_r
    loss = _batch_mean(-F.logsigmoid(r_c - r_r - simpo_gamma), inputs.weights)
    return loss, _reward_metrics(r_c, r_r, inputs)


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (Mächler 2012)."""
    # Clamp each branch to its own domain so the unused branch of `where` has a finite gradient.
    near_zero = torch.log(-torch.expm1(x.clamp(min=-math.log(2))))
    far = torch.log1p(-torch.exp(x.clamp(max=-math.log(2))))
    return torch.where(x > -math.log(2), near_zero, far)


@PREFERENCE_LOSSES.register("orpo")
def orpo_loss(inputs: PreferenceInputs, *, beta: float = 0.1, nll_norm: str = "sequence") -> tuple[Tensor, Metrics]:
    """ORPO: SFT on the chosen completion plus a log-odds-ratio penalty, no reference model.

    Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model":
    ``l = NLL(y_c) + λ · (-log σ(log odds(y_c) - log odds(y_r)))`` with
    ``odds(y) = p / (1 - p)`` and ``p = exp(mean token log π(y))``. β plays the role of λ (as in
    TRL's ORPOTrainer, default 0.1 as in the paper). NLL is the mean per token (``chosen_nll`` or
    ``-chosen_logps / chosen_lengths``). Mean log-probs are clamped to <= -1e-6 so that the odds
    of a completion the model is certain of stay finite. Rewards reported are the log odds. ``nll_norm``
    as in ``rpo``: ``sequence`` (the paper) or ``token`` (TRL's ORPOTrainer).
    """
    avg_c, avg_r = _mean_logps(inputs, "orpo")
    avg_c, avg_r = avg_c.clamp(max=-1e-6), avg_r.clamp(max=-1e-6)
    log_odds_c = avg_c - _log1mexp(avg_c)
    log_odds_r = avg_r - _log1mexp(avg_r)
    nll, nll_loss = _nll_term(inputs, "orpo", nll_norm)
    metrics = _reward_metrics(log_odds_c, log_odds_r, inputs)
    metrics["nll"] = nll.detach().mean()
    return nll_loss + _batch_mean(-beta * F.logsigmoid(log_odds_c - log_odds_r), inputs.weights), metrics


@PREFERENCE_LOSSES.register("slic")
def slic_loss(inputs: PreferenceInputs, *, beta: float = 1.0, slic_delta: float = 1.0,
              slic_lambda: float = 0.1) -> tuple[Tensor, Metrics]:
    """SLiC-HF: a calibration hinge on the raw sequence log-likelihoods plus a likelihood regulariser.

    Zhao et al. 2023, "SLiC-HF: Sequence Likelihood Calibration with Human Feedback", Eq. 1:
    ``l = max(0, δ - log π(y_c) + log π(y_r)) - λ log π(y_ref)``, log-likelihoods summed over the
    completion's tokens, no reference model. The chosen completion stands in for the SFT target
    ``y_ref`` (the pairs' preferred answer; the paper's "SLiC-HF with y_ref = y+" variant). δ =
    ``slic_delta``, λ = ``slic_lambda`` (the regulariser is per pair, a sequence NLL). Unlike ``hinge``
    (RSO's reference-normalised hinge) nothing here is relative to a reference. β only scales the
    rewards reported (``β log π(y)``).
    """
    margin = inputs.chosen_logps - inputs.rejected_logps
    per_pair = torch.relu(slic_delta - margin) - slic_lambda * inputs.chosen_logps
    metrics = _reward_metrics(beta * inputs.chosen_logps, beta * inputs.rejected_logps, inputs)
    metrics["calibration"] = torch.relu(slic_delta - margin).detach().mean()
    return _batch_mean(per_pair, inputs.weights), metrics


@PREFERENCE_LOSSES.register("sppo_hard")
def sppo_hard_loss(inputs: PreferenceInputs, *, beta: float = 0.1) -> tuple[Tensor, Metrics]:
    """SPPO with hard win probabilities: regress each log-ratio onto ±1/(2β) separately.

    Wu et al. 2024, "Self-Play Preference Optimization for Language Model Alignment", Eq. 4.7:
    ``(log π(y)/π_t(y) - η (P(y ≻ π_t) - 1/2))²``. With P set to 1 for the chosen and 0 for the
    rejected completion and η = 1/β (as TRL's ``sppo_hard``):
    ``l = (log π(y_c)/π_ref(y_c) - 1/(2β))² + (log π(y_r)/π_ref(y_r) + 1/(2β))²``.
    The paper estimates P softly with a preference model over K samples; that estimation is the
    caller's (online loop's) job and is not done here. The reference is the previous iterate π_t.
    """
    lr_c, lr_r, _, metrics = _ref_based(inputs, "sppo_hard", beta)
    target = 1 / (2 * beta)
    per_pair = (lr_c - target) ** 2 + (lr_r + target) ** 2
    return _batch_mean(per_pair, inputs.weights), metrics


@PREFERENCE_LOSSES.register("sppo", needs=("win_probabilities",))
def sppo_loss(inputs: PreferenceInputs, *, beta: float = 0.1) -> tuple[Tensor, Metrics]:
    """SPPO with soft win probabilities: each log-ratio regressed onto η (P(y ≻ π_t) - 1/2).

    Wu et al. 2024, "Self-Play Preference Optimization for Language Model Alignment", Eq. 4.7 with the
    estimate of Eq. 3.10: ``l = (log π(y_c)/π_t(y_c) - η (P̂_c - 1/2))² + (log π(y_r)/π_t(y_r) - η (P̂_r - 1/2))²``,
    η = 1/β, where ``P̂(y) = 1/K Σ_k P(y ≻ y_k)`` is the win probability of ``y`` against the K samples
    of its prompt (``chosen_win_prob`` / ``rejected_win_prob``: a record's columns, or the online
    trainer's estimate, :func:`tether.core.pairing.win_probabilities`). With P̂_c = 1 and P̂_r = 0 it is
    ``sppo_hard``. The reference is the previous iterate π_t (``reference: round`` online).
    """
    _require(inputs, "sppo", "chosen_win_prob", "rejected_win_prob")
    lr_c, lr_r, _, metrics = _ref_based(inputs, "sppo", beta)
    eta = 1 / beta
    per_pair = (lr_c - eta * (inputs.chosen_win_prob - 0.5)) ** 2 + (lr_r - eta * (inputs.rejected_win_prob - 0.5)) ** 2
    metrics["win_prob/chosen"] = inputs.chosen_win_prob.detach().float().mean()
    metrics["win_prob/rejected"] = inputs.rejected_win_prob.detach().float().mean()
    return _batch_mean(per_pair, inputs.weights), metrics


def wpo_weights(
    chosen_token_logps: Tensor,
    chosen_mask: Tensor,
    rejected_token_logps: Tensor,
    rejected_mask: Tensor,
    *,
    normalize: bool = True,
) -> Tensor:
    """WPO pair weights: how likely the current policy is to have produced both completions.

    Zhou et al. 2024, "WPO: Enhancing RLHF with Weighted Preference Optimization", with the
    length-normalised sequence probability:
    ``w = exp(mean_t log π(y_c,t) + mean_t log π(y_r,t))``, computed without gradient.

    Differs from the paper in two documented ways. (1) It implements the length-normalised weight,
    not the "sampled alignment" variant that also subtracts ``log sum_v π(v | ·)²`` per token (as
    TRL's ``use_weighting`` does): that needs full-vocabulary distributions this function does not
    see. (2) With ``normalize`` (default) weights are rescaled to batch mean 1, computed in log
    space (``B · softmax(log w)``): raw weights of off-policy text are tiny (e^-10 is common) and
    underflow, and only their ratios matter under the losses' weighted mean ``sum w l / sum w``.
    The rescaling makes the weights relative to the (micro-)batch they were computed on.

    Args:
        chosen_token_logps: shape (B, T), per-token log-probs of the chosen completion.
        chosen_mask: shape (B, T), bool or 0/1, completion tokens.
        rejected_token_logps: shape (B, T).
        rejected_mask: shape (B, T).

    Returns:
        shape (B,), detached; pass as ``PreferenceInputs.weights``.
    """
    with torch.no_grad():
        mean_c = sequence_logprobs(chosen_token_logps, chosen_mask, average=True)
        mean_r = sequence_logprobs(rejected_token_logps, rejected_mask, average=True)
        log_w = (mean_c + mean_r).float()
        if not normalize:
            return log_w.exp()
        return torch.softmax(log_w, dim=0) * log_w.numel()


def mixed_preference_loss(
    inputs: PreferenceInputs, losses: dict[str, float], **hparams: float | bool
) -> tuple[Tensor, Metrics]:
    """Weighted sum of registered preference losses, e.g. ``{"sigmoid": 0.8, "hinge": 0.2}``.

    ``l = sum_k c_k l_k(inputs)``, as in TRL's ``loss_type`` lists with ``loss_weights`` (used by
    MPO, Wang et al. 2024). Each loss receives only the keyword hyperparameters its signature
    names (so ``beta`` is shared by all that take it); a hyperparameter no selected loss accepts
    is an error, to catch typos. Metrics are prefixed with the loss name, and ``<name>/loss``
    holds each unweighted component.
    """
    if not losses:
        raise ValueError("mixed_preference_loss needs at least one loss")
    total: Tensor | None = None
    metrics: Metrics = {}
    used: set[str] = set()
    for name, coef in losses.items():
        fn = PREFERENCE_LOSSES.get(name)
        accepted = inspect.signature(fn).parameters
        kwargs = {k: v for k, v in hparams.items() if k in accepted}
        used.update(kwargs)
        loss, sub = fn(inputs, **kwargs)
        total = coef * loss if total is None else total + coef * loss
        metrics[f"{name}/loss"] = loss.detach()
        metrics.update({f"{name}/{k}": v for k, v in sub.items()})
    unused = sorted(set(hparams) - used)
    if unused:
        raise TypeError(f"hyperparameters {unused} are not accepted by any of {sorted(losses)}")
    return total, metrics


@UNPAIRED_LOSSES.register("kto")
def kto_loss(
    logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    kl_logps: Tensor,
    kl_ref_logps: Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, Metrics]:
    """KTO: a prospect-theoretic value of each completion's implicit reward relative to a KL baseline.

    Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization":
    with ``r = log π(y|x) - log π_ref(y|x)`` and ``z0 = max(0, mean(log π(y'|x) - log π_ref(y'|x)))``,
    desirable: ``w_d (1 - σ(β (r - z0)))``, undesirable: ``w_u (1 - σ(β (z0 - r)))``, mean over the
    batch. As in the paper and TRL: z0 is estimated on mismatched (x, y') pairs from the same batch
    and detached, so no gradient flows through the baseline. The paper's λ_D n_D / (λ_U n_U)
    balance is the caller's choice of weights.

    Args:
        logps: shape (B,), summed completion log-probs under the policy.
        ref_logps: shape (B,), under the reference.
        desirable: shape (B,), bool; True for desirable (thumbs-up) completions.
        kl_logps: shape (B',), policy log-probs of the mismatched KL pairs.
        kl_ref_logps: shape (B',), reference log-probs of the same.
    """
    desirable = desirable.bool()
    z0 = (kl_logps - kl_ref_logps).mean().clamp(min=0).detach()
    logratio = logps - ref_logps
    per_example = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (logratio - z0))),
        undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratio))),
    )
    rewards = (beta * logratio).detach()
    n_d, n_u = desirable.sum(), (~desirable).sum()
    metrics = {
        "kl": z0,
        "rewards/chosen": torch.where(desirable, rewards, 0).sum() / n_d.clamp(min=1),
        "rewards/rejected": torch.where(desirable, 0, rewards).sum() / n_u.clamp(min=1),
        "fraction_desirable": desirable.float().mean(),
    }
    return per_example.mean(), metrics
