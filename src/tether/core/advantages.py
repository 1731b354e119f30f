"""Advantage estimators: sequence rewards (and optional per-token terms) -> per-token advantages.

Each estimator is ``fn(inputs: AdvantageInputs, *, <its own hyperparameters>) ->
AdvantageOutputs`` in ``ADVANTAGE_ESTIMATORS``; trainers call ``compute_advantages(name,
inputs, **all_config_knobs)``, which hands each estimator only the knobs it names.

Conventions shared by every estimator:

- ``inputs`` holds the whole global batch (the trainer gathers before calling), so group and
  batch statistics are exact; advantages are computed once per step, never per micro-batch.
- Group estimators read groups as contiguous blocks of ``group_size`` rows.
- Group statistics use every row's reward, including rows whose mask is empty; the mask only
  decides where the advantage lands. Advantages are exactly 0 where mask == 0.
- A group whose rewards are all equal carries no signal: its centred rewards are set to
  exactly 0 (floating-point means of equal numbers need not reproduce the number, and
  dividing that residue by a ~0 std would invent a signal).
- Everything is computed in float32 without gradient: advantages are targets, not outputs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tether.core.aggregation import masked_mean
from tether.core.registry import Registry


@dataclass
class AdvantageInputs:
    """What an estimator may read; B = num_prompts * group_size with groups contiguous."""

    rewards: Tensor  # shape (B,), sequence-level outcome reward
    mask: Tensor  # shape (B, T), 1 on trained completion tokens
    group_size: int
    token_rewards: Tensor | None = None  # shape (B, T), per-token terms added to the outcome (e.g. -beta*KL)
    baseline_rewards: Tensor | None = None  # shape (B,), e.g. the reward of ReMax's greedy rollout
    values: Tensor | None = None  # shape (B, T), critic values V(s_t) (GAE)
    running_baseline: Tensor | None = None  # scalar, REINFORCE state carried across steps by the trainer
    step_rewards: Tensor | None = None  # shape (B, S), a process reward model's score of each step
    step_ends: Tensor | None = None  # shape (B, S), long: the token index each step ends at; -1: no such step

    def __post_init__(self) -> None:
        if self.rewards.dim() != 1:
            raise ValueError(f"rewards must be shape (B,), got {tuple(self.rewards.shape)}")
        batch = self.rewards.shape[0]
        if self.mask.dim() != 2 or self.mask.shape[0] != batch:
            raise ValueError(f"mask must be shape (B={batch}, T), got {tuple(self.mask.shape)}")
        if self.group_size < 1 or batch % self.group_size != 0:
            raise ValueError(f"group_size {self.group_size} must be >= 1 and divide the batch size {batch}")
        for name in ("token_rewards", "values"):
            tensor = getattr(self, name)
            if tensor is not None and tensor.shape != self.mask.shape:
                raise ValueError(
                    f"{name} must match mask {tuple(self.mask.shape)}, got {tuple(tensor.shape)}"
                )
        if (self.step_rewards is None) != (self.step_ends is None) or (
                self.step_rewards is not None and (self.step_rewards.shape != self.step_ends.shape
                                                   or self.step_rewards.shape[0] != batch)):
            raise ValueError("step_rewards and step_ends come together, both shape (B, S)")
        if self.baseline_rewards is not None and self.baseline_rewards.shape != self.rewards.shape:
            raise ValueError(
                f"baseline_rewards must be shape ({batch},), got {tuple(self.baseline_rewards.shape)}"
            )


@dataclass
class AdvantageOutputs:
    advantages: Tensor  # shape (B, T), zero where mask == 0
    returns: Tensor | None  # shape (B, T) where meaningful (GAE), else None
    metrics: dict[str, Tensor]
    state: dict[str, Tensor] = field(default_factory=dict)  # passed back by the trainer next step


AdvantageEstimator = Callable[..., AdvantageOutputs]

ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def compute_advantages(name: str, inputs: AdvantageInputs, **hparams: object) -> AdvantageOutputs:
    """Run the named estimator with the subset of ``hparams`` its signature names.

    Trainers pass every config knob; knobs another estimator uses are dropped here, so the
    estimators keep explicit signatures. An unknown name raises KeyError listing the valid ones.
    """
    fn = ADVANTAGE_ESTIMATORS.get(name)
    accepted = inspect.signature(fn).parameters
    return fn(inputs, **{k: v for k, v in hparams.items() if k in accepted})


# ----------------------------------------------------------------------------- helpers


def _rewards(inputs: AdvantageInputs) -> Tensor:
    return inputs.rewards.detach().to(torch.float32)


def _sequence_rewards(inputs: AdvantageInputs) -> Tensor:
    """Outcome reward plus the row's summed ``token_rewards`` (e.g. -beta * KL in the reward).

    Sequence-level estimators (GRPO, RLOO, REINFORCE, ReMax) see the whole trajectory's return
    as one number, as in Ahmadian et al. 2024 (RLOO) where r(x, y) - beta * KL(y) is the reward.
    """
    rewards = _rewards(inputs)
    if inputs.token_rewards is not None:
        mask = _mask(inputs)
        rewards = rewards + torch.where(mask != 0, inputs.token_rewards.detach().to(torch.float32), 0.0).sum(1)
    return rewards


def _mask(inputs: AdvantageInputs) -> Tensor:
    return (inputs.mask != 0).to(torch.float32)


def _centred_groups(rewards: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """(r - group mean) with equal-reward groups exactly 0, shape (P, G); and the (P,) flat-group flags."""
    groups = rewards.view(-1, group_size)
    flat = (groups == groups[:, :1]).all(dim=1)
    centred = torch.where(flat[:, None], 0.0, groups - groups.mean(dim=1, keepdim=True))
    return centred, flat


def _broadcast(per_seq: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask != 0, per_seq[:, None], 0.0)


def _masked_std(x: Tensor, mask: Tensor) -> Tensor:
    """Unbiased (Bessel-corrected) std over masked positions; 0 with fewer than two."""
    n = mask.sum()
    mean = masked_mean(x, mask)
    var = (torch.where(mask != 0, x - mean, 0.0).square().sum() / (n - 1).clamp(min=1)).where(n > 1, 0.0)
    return var.sqrt()


def _whiten(x: Tensor, mask: Tensor, eps: float) -> Tensor:
    return torch.where(mask != 0, (x - masked_mean(x, mask)) / (_masked_std(x, mask) + eps), 0.0)


def _token_rewards(inputs: AdvantageInputs, rewards: Tensor, mask: Tensor) -> Tensor:
    """token_rewards on masked tokens plus each row's outcome reward on its last masked token, (B, T)."""
    per_token = torch.zeros_like(mask)
    if inputs.token_rewards is not None:
        per_token = torch.where(mask != 0, inputs.token_rewards.detach().to(torch.float32), 0.0)
    last = mask.shape[1] - 1 - mask.flip(dims=[1]).argmax(dim=1)
    outcome = rewards * (mask.sum(dim=1) > 0)  # an all-masked row has no last token to credit
    return per_token.scatter_add(1, last[:, None], outcome[:, None])


def _metrics(advantages: Tensor, mask: Tensor, rewards: Tensor, **extra: Tensor) -> dict[str, Tensor]:
    return {
        "advantage_mean": masked_mean(advantages, mask),
        "advantage_std": _masked_std(advantages, mask),
        "advantage_abs_max": advantages.abs().max(),
        "reward_mean": rewards.mean(),
        "reward_std": rewards.std(correction=0),
        **extra,
    }


def _group_outputs(per_seq: Tensor, flat: Tensor, mask: Tensor, rewards: Tensor) -> AdvantageOutputs:
    advantages = _broadcast(per_seq, mask)
    metrics = _metrics(advantages, mask, rewards, frac_zero_std_groups=flat.float().mean())
    return AdvantageOutputs(advantages=advantages, returns=None, metrics=metrics)


# -------------------------------------------------------------------------- estimators


@ADVANTAGE_ESTIMATORS.register("grpo")
@torch.no_grad()
def grpo(inputs: AdvantageInputs, *, eps: float = 1e-6) -> AdvantageOutputs:
    """GRPO outcome advantage: A_i = (r_i - mean_group(r)) / (std_group(r) + eps).

    Shao et al. 2024 (DeepSeekMath), section 4.1.2, "outcome supervision". The std is the
    unbiased (Bessel-corrected, n - 1) group std, as torch.std's default, TRL and verl use.
    Differs from the paper: the +eps (1e-6, verl's) guards the division; groups of one or with
    all-equal rewards get exactly 0 instead of 0/0.
    """
    rewards, mask, size = _sequence_rewards(inputs), _mask(inputs), inputs.group_size
    centred, flat = _centred_groups(rewards, size)
    if size > 1:
        centred = centred / (rewards.view(-1, size).std(dim=1, keepdim=True) + eps)
    return _group_outputs(centred.reshape(-1), flat, mask, rewards)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
@torch.no_grad()
def dr_grpo(inputs: AdvantageInputs) -> AdvantageOutputs:
    """Dr. GRPO advantage: A_i = r_i - mean_group(r), no division by the group std.

    Liu et al. 2025, "Understanding R1-Zero-Like Training", the Dr. GRPO objective. Its other half,
    dropping 1/|o_i|, is a loss aggregation: pair this with ``seq-mean-token-sum-norm``.
    """
    rewards, mask = _sequence_rewards(inputs), _mask(inputs)
    centred, flat = _centred_groups(rewards, inputs.group_size)
    return _group_outputs(centred.reshape(-1), flat, mask, rewards)


@ADVANTAGE_ESTIMATORS.register("rloo")
@torch.no_grad()
def rloo(inputs: AdvantageInputs) -> AdvantageOutputs:
    """RLOO: A_i = r_i - mean_{j != i} r_j, the leave-one-out baseline within the group.

    Ahmadian et al. 2024, "Back to Basics" (after Kool et al. 2019). Computed as
    G / (G - 1) * (r_i - mean_group(r)), which is algebraically the same. A group of one has no
    other sample to form a baseline: its advantage is 0.
    """
    rewards, mask, size = _sequence_rewards(inputs), _mask(inputs), inputs.group_size
    centred, flat = _centred_groups(rewards, size)
    per_seq = centred * (size / (size - 1)) if size > 1 else torch.zeros_like(centred)
    return _group_outputs(per_seq.reshape(-1), flat, mask, rewards)


@ADVANTAGE_ESTIMATORS.register("reinforce")
@torch.no_grad()
def reinforce(inputs: AdvantageInputs, *, baseline_momentum: float = 0.9,
              baseline: str = "moving_average") -> AdvantageOutputs:
    """REINFORCE with a baseline carried across steps: A_i = r_i - b.

    Williams 1992, the REINFORCE update dw = alpha * (r - b) * dlog pi/dw with reinforcement
    baseline b. ``baseline``:

    - ``moving_average`` (default): b <- m*b + (1-m)*mean(r), m = ``baseline_momentum``;
      ``inputs.running_baseline`` is b from the previous step.
    - ``mean``: b = the mean of every reward received before this step (b_k = (1/N) sum_{j<k} r_j,
      "the average of all rewards so far", the simplest baseline of Williams' paper);
      ``inputs.running_baseline`` is ``[b, N]``.

    The updated state is returned in ``state["running_baseline"]``. Differs: on the first step
    (running_baseline None) b starts at this batch's mean reward rather than 0, so the first update
    is not a plain "raise everything" push.
    """
    if not 0.0 <= baseline_momentum <= 1.0:
        raise ValueError(f"baseline_momentum must be in [0, 1], got {baseline_momentum}")
    if baseline not in ("moving_average", "mean"):
        raise ValueError(f"baseline must be moving_average or mean, got {baseline!r}")
    rewards, mask = _sequence_rewards(inputs), _mask(inputs)
    batch_mean = rewards.mean()
    state = None if inputs.running_baseline is None else \
        inputs.running_baseline.detach().to(rewards.device, torch.float32)
    if baseline == "mean":
        if state is not None and state.numel() != 2:
            raise ValueError("reinforce baseline 'mean' carries [mean, count]; the run's state holds another "
                             "baseline (was it started with baseline: moving_average?)")
        b, seen = (batch_mean, 0.0) if state is None else (state[0], state[1])
        count = rewards.numel()
        new_state = torch.stack([(b * seen + rewards.sum()) / (seen + count),
                                 torch.as_tensor(seen + count, dtype=torch.float32, device=rewards.device)])
    else:
        b = batch_mean if state is None else state.reshape(())
        new_state = baseline_momentum * b + (1.0 - baseline_momentum) * batch_mean
    advantages = _broadcast(rewards - b, mask)
    return AdvantageOutputs(
        advantages=advantages,
        returns=None,
        metrics=_metrics(advantages, mask, rewards, baseline=b),
        state={"running_baseline": new_state},
    )


def _discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = sum_{k >= t, masked} gamma^(#masked tokens between) r_k; unmasked positions are skipped."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        # An unmasked position (e.g. a tool observation mid-trajectory) passes the return through.
        running = torch.where(mask[:, t] != 0, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
@torch.no_grad()
def reinforce_pp(
    inputs: AdvantageInputs, *, gamma: float = 1.0, eps: float = 1e-6, group_baseline: bool = False
) -> AdvantageOutputs:
    """REINFORCE++: per-token discounted return, normalised over all masked tokens of the batch.

    Hu 2025, "REINFORCE++", the token-level return and global advantage normalisation:
    A_t = sum_{k >= t} gamma^(k-t) r_k, r_k = token_rewards_k (+ outcome reward at the last
    masked token), then A <- (A - mean) / (std + eps) with the unbiased std over every masked
    token of the (global) batch. ``group_baseline`` (REINFORCE++-baseline) first subtracts the
    group mean from the outcome reward. Differs: unmasked positions inside a row are skipped
    by the discounting; an all-equal group under ``group_baseline`` still gets the small
    non-zero advantage global normalisation gives it, as in the paper.
    """
    rewards, mask = _rewards(inputs), _mask(inputs)
    outcome, extra = rewards, {}
    if group_baseline:
        centred, flat = _centred_groups(rewards, inputs.group_size)
        outcome, extra = centred.reshape(-1), {"frac_zero_std_groups": flat.float().mean()}
    returns = _discounted_returns(_token_rewards(inputs, outcome, mask), mask, gamma)
    advantages = _whiten(returns, mask, eps)
    return AdvantageOutputs(
        advantages=advantages, returns=None, metrics=_metrics(advantages, mask, rewards, **extra)
    )


@ADVANTAGE_ESTIMATORS.register("remax", needs=("baseline_rewards",))
@torch.no_grad()
def remax(inputs: AdvantageInputs) -> AdvantageOutputs:
    """ReMax: A_i = r_i - r(greedy_i), the reward of a greedy rollout of the same prompt as baseline.

    Li et al. 2023, "ReMax". Needs ``inputs.baseline_rewards``; matches the paper.
    """
    if inputs.baseline_rewards is None:
        raise ValueError("remax needs inputs.baseline_rewards: the reward of a greedy rollout per sample")
    rewards, mask = _sequence_rewards(inputs), _mask(inputs)
    baseline = inputs.baseline_rewards.detach().to(torch.float32)
    advantages = _broadcast(rewards - baseline, mask)
    metrics = _metrics(advantages, mask, rewards, baseline_reward_mean=baseline.mean())
    return AdvantageOutputs(advantages=advantages, returns=None, metrics=metrics)


@ADVANTAGE_ESTIMATORS.register("gae", needs=("values",))
@torch.no_grad()
def gae(
    inputs: AdvantageInputs, *, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True, eps: float = 1e-6
) -> AdvantageOutputs:
    """GAE: A_t = delta_t + gamma*lam*A_{t+1}, delta_t = r_t + gamma*V_{t+1} - V_t; returns = A + V.

    Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", section 3.
    r_t = token_rewards_t plus the outcome reward at each row's last masked token; V after the
    last masked token is 0. ``returns`` are the critic's targets, taken before ``whiten``
    (masked mean/unbiased-std whitening of the advantages, as InstructGPT-style PPO does).
    Differs: only masked tokens are steps of the recursion; unmasked ones (padding, tool
    observations) are skipped, carrying V_{t+1} and A_{t+1} across them.
    """
    if inputs.values is None:
        raise ValueError("gae needs inputs.values: critic values of shape (B, T)")
    rewards, mask = _rewards(inputs), _mask(inputs)
    values = torch.where(mask != 0, inputs.values.detach().to(torch.float32), 0.0)
    token_rewards = _token_rewards(inputs, rewards, mask)
    advantages = torch.zeros_like(mask)
    next_value = next_adv = torch.zeros_like(rewards)
    for t in reversed(range(mask.shape[1])):
        step = mask[:, t] != 0
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        advantages[:, t] = adv_t
        next_adv = torch.where(step, adv_t, next_adv)
        next_value = torch.where(step, values[:, t], next_value)
    advantages = advantages * mask
    returns = advantages + values
    if whiten:
        advantages = _whiten(advantages, mask, eps)
    metrics = _metrics(
        advantages,
        mask,
        rewards,
        returns_mean=masked_mean(returns, mask),
        value_mean=masked_mean(values, mask),
    )
    return AdvantageOutputs(advantages=advantages, returns=returns, metrics=metrics)


@ADVANTAGE_ESTIMATORS.register("grpo_process", needs=("step_rewards",))
@torch.no_grad()
def grpo_process(inputs: AdvantageInputs, *, eps: float = 1e-6, outcome_weight: float = 0.0) -> AdvantageOutputs:
    """GRPO with process supervision: each token's advantage is the sum of the normalised rewards of the
    steps from its own onward.

    Shao et al. 2024 (DeepSeekMath), section 4.1.3: a process reward model scores every step of the G
    outputs of a prompt; the step rewards are normalised by the mean and std of all step rewards of the
    group, ``r̃_i^j = (r_i^j - mean(R)) / std(R)``, and ``A_{i,t} = sum_{index(j) >= t} r̃_i^j``, where
    index(j) is the token step j ends at. As in the paper, the outcome ``rewards`` do not enter (they are
    logged by the trainer) unless ``outcome_weight`` > 0: then ``outcome_weight`` x GRPO's outcome advantage
    of the same group (:func:`grpo`) is added to every token, process and outcome supervision together
    (as PRIME, Cui et al. 2025, sums its outcome and process advantages), which anchors a learned process
    reward to the verifier. ``token_rewards`` (a KL in the reward) are refused: keep the KL in the loss.
    Differs from the paper as :func:`grpo` does: the unbiased std plus eps, and a group whose step rewards
    are all equal (or has fewer than two) gets 0. Tokens after a row's last step end get 0.
    """
    if inputs.token_rewards is not None:
        raise ValueError("grpo_process takes no per-token rewards; keep the KL in the loss (kl.in_reward: false)")
    mask, size = _mask(inputs), inputs.group_size
    steps = inputs.step_rewards.detach().to(torch.float32)
    present = inputs.step_ends >= 0
    by_group, kept = steps.reshape(-1, size * steps.shape[1]), present.reshape(-1, size * steps.shape[1])
    count = kept.sum(1, keepdim=True)
    mean = torch.where(kept, by_group, 0.0).sum(1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(kept, by_group - mean, 0.0)
    std = (centred.square().sum(1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    spread = centred.abs().amax(1, keepdim=True)
    flat = (count < 2) | (spread <= eps)
    normalised = torch.where(flat | ~kept, 0.0, centred / (std + eps)).view_as(steps)
    positions = torch.arange(mask.shape[1], device=mask.device)
    reaches = present[:, :, None] & (inputs.step_ends[:, :, None] >= positions[None, None, :])  # (B, S, T)
    advantages = (normalised[:, :, None] * reaches).sum(1) * mask
    if outcome_weight < 0:
        raise ValueError(f"grpo_process outcome_weight must be >= 0, got {outcome_weight}")
    if outcome_weight:
        advantages = advantages + outcome_weight * grpo(inputs, eps=eps).advantages
    metrics = _metrics(advantages, mask, _rewards(inputs), frac_zero_std_groups=flat.float().mean(),
                       step_reward_mean=steps[present].mean() if bool(present.any()) else torch.tensor(0.0),
                       steps_per_sample=present.sum(1).float().mean())
    return AdvantageOutputs(advantages=advantages, returns=None, metrics=metrics)
