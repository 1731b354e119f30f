"""The RL trainer's critic side: the critic's values, its clipped value loss, and the critic warm-up.

**Critic warm-up** (``critic.warmup_steps: N``, default 0): the first N training steps collect and score
fresh rollouts, take the frozen passes and run GAE exactly as a PPO step does, then make the same
``num_iterations`` x ``mini_batches`` optimiser updates on the clipped value loss alone. The policy
loss, the KL and entropy terms are not computed, so no gradient reaches the actor: AdamW skips
parameters without a gradient (no weight decay, no moment update), and the actor's weights stay
bitwise what they were. The KL controller holds beta during warm-up (the policy does not move).

Why: InstructGPT initialises the value function from the reward model (Ouyang et al. 2022, appendix
C.4; Stiennon et al. 2020 likewise), but the RM scores whole completions, not partial ones, and a
critic started from the policy has a fresh head: either way the first GAE advantages are mostly the
critic's error. Fitting the value function to the initial policy's returns before the policy moves
is OpenRLHF's ``--freezing_actor_steps`` ("used for critic initialization": the actor trains only
after that many steps) and VC-PPO's value pretraining (Yuan et al. 2025, "What's Behind PPO's
Collapse in Long-CoT? Value Optimization Holds the Secret", sec. 4.1).

What counts as a step: a warm-up step is a training step like any other. It counts in
``train.max_steps`` (the actor gets ``max_steps - N`` steps of updates), in the logged step numbers
and ``log_every`` / ``save_every`` / ``eval_every`` / ``sample_every``, and in the checkpointed step
a resume continues from; whether a step warms up is a function of that step number alone, so a
run resumed inside the warm-up reproduces the uninterrupted one exactly. Its optimiser updates
advance the learning-rate schedule as PPO's do (one schedule over all ``max_steps``, both parameter
groups), so a policy ``optim.warmup_steps`` or a decay partly elapses during the critic warm-up.
Under torchrun (DDP) the warm-up's loss reaches the critic without the wrapper's forward, which is what
arms DDP's gradient averaging, so the trainer averages the critic's gradients over the ranks itself
(:func:`~tether.trainers.parallel.average_unsynced_gradients`): 2 ranks give the one-process run (tested).
The warm-up loss is the value loss unweighted (``critic.coef`` weighs it against a policy loss that is
absent here). How it departs from OpenRLHF: there actor and critic have their own optimisers and
schedules, and the frozen actor's schedule does not advance; here the one joint optimiser's critic
group takes the updates and the shared schedule advances.
"""

from __future__ import annotations

from typing import Any

import torch

from tether.config.rl import CriticConfig
from tether.core.policy_losses import value_loss_clipped
from tether.models.value_model import completion_values
from tether.rollout import Rollout


def in_critic_warmup(critic: CriticConfig | None, step: int) -> bool:
    """Whether training step ``step`` (0-based: the number of steps completed before it) updates the critic only."""
    return critic is not None and step < critic.warmup_steps


def warmup_metrics(critic: CriticConfig | None, warmup: bool) -> dict[str, float]:
    """``critic/warmup``: 1 on a warm-up step, 0 after; logged only when a warm-up is configured."""
    return {"critic/warmup": float(warmup)} if critic is not None and critic.warmup_steps > 0 else {}


class CriticSteps:
    """The critic's share of :class:`~tether.trainers.rl.RLTrainer`: values, value loss, warm-up loss."""

    config: Any
    model: torch.nn.Module
    tokenizer: Any
    micro_batches: Any  # RLTrainer's: rows -> the micro-batches of a forward pass
    frozen_pass: Any  # the Trainer's: a pass that trains nothing, in the training forward's precision

    def values(self, rollout: Rollout, rows: torch.Tensor) -> torch.Tensor:
        """V(s_t) of the given samples' completion tokens, shape (len(rows), longest completion of the rollout).
        Every completion position gets a value; the mask decides which ones GAE and the loss read."""
        ids = rows.tolist()
        width = max(len(c) for c in rollout.completion_ids)
        values = completion_values(self.model, [rollout.prompt_ids[i] for i in ids],
                                   [rollout.completion_ids[i] for i in ids], row_tokens=self.config.row_tokens,
                                   pad_token_id=self.tokenizer.pad_token_id)
        return torch.nn.functional.pad(values, (0, width - values.shape[1]))

    def frozen_values(self, rollout: Rollout) -> torch.Tensor:
        with self.frozen_pass():
            return torch.cat([self.values(rollout, rows) for rows in self.micro_batches(torch.arange(len(rollout)))])

    def value_loss(self, batch: Any, rows: torch.Tensor, denominators: dict[str, float]
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped value loss of the given samples over their masked tokens (``agg_loss`` with the
        minibatch's global counts) and its ``value/*`` metrics. Alone, it is the critic warm-up's loss."""
        cfg = self.config
        vf_loss, vf = value_loss_clipped(
            self.values(batch.rollout, rows), batch.values[rows], batch.returns[rows], batch.mask[rows],
            clip_range=cfg.critic.clip_range, loss_agg=cfg.loss_agg, global_tokens=denominators["global_tokens"],
            global_seqs=denominators["global_seqs"], norm_constant=cfg.rollout.max_new_tokens)
        return vf_loss, {"value/loss": vf_loss.detach(), "value/clip_frac": vf["value_clip_frac"],
                         "value/explained_variance": vf["explained_variance"], "value/mean": vf["value_mean"]}
