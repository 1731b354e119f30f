"""PPO-RLHF, the InstructGPT loop: policy, frozen reference, reward model and a learned critic.

One step reads: sample a prompt batch -> ``rollout.group_size`` completions per prompt (1 by
default) -> score them with the reward functions (the reward model) -> old and reference log-probs
and the critic's values -> per-token rewards r_t = -beta * KL_t, plus the shaped score on the last
completion token -> GAE advantages and returns (the ``gae`` registry estimator) -> ``num_iterations``
(PPO's epochs) passes of ``mini_batches`` updates of the clipped surrogate + the clipped value loss
-> the KL controller moves beta. All of it is :class:`~tether.trainers.rl.RLTrainer`'s machinery with
the config's critic switched on (as in verl); this module adds PPO's held-out figures: the proxy and
gold rewards of sampled and greedy completions and their KL to the reference.

Papers: Ziegler et al. 2019 (KL in the reward per token, the adaptive controller), Stiennon et
al. 2020 and Ouyang et al. 2022 (InstructGPT), Schulman et al. 2017 (PPO) and 2016 (GAE).

How it departs from them:

- policy and critic form one module trained on ``pg_loss + critic.coef * value_loss`` by one
  optimiser (a parameter group each, with its own learning rate) under one gradient-norm clip,
  as TRL's PPO trainer does; lm-human-preferences and OpenRLHF step two optimisers.
- no pretraining-mix term (InstructGPT's PPO-ptx).
- the KL in the reward uses the behaviour policy's log-probs, recomputed by a forward pass after
  generation (as ``RLTrainer`` does), not the sampler's.
- advantage whitening and reward normalisation use the whole job's batch under torchrun, as in one
  process.
- the score is shaped before it enters the reward, in this order: normalised (``reward_norm``:
  batch whitening, or running mean / std as lm-human-preferences' reward normalisation, which fixes
  its gain once on the initial policy), clipped to ``[-reward_clip, reward_clip]``, then
  ``missing_eos_penalty`` subtracted from completions cut at ``rollout.max_new_tokens`` (TRL's).
"""

from __future__ import annotations

import torch

from tether.config.rl import PPOConfig
from tether.core.kl import kl_penalty
from tether.data.sources import record_columns
from tether.data.tokenize import tokenize_prompts
from tether.evaluation import evaluate_task
from tether.rollout import SamplingParams
from tether.tasks import eval_records, get_task
from tether.trainers.rl import RLTrainer


class PPOTrainer(RLTrainer):
    """:class:`RLTrainer` with PPO's critic (from the config) and PPO's held-out figures."""

    config: PPOConfig

    def needs_reference(self) -> bool:
        """Always: the held-out figures report the KL to the reference, also at beta = 0."""
        return True

    # ---- evaluation -------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out figures: greedy task accuracy (``evaluate_task``); the proxy (reward) and gold means of
        ``eval.samples`` completions per prompt sampled as in training (``rollout`` temperature, top-p,
        top-k) and of the greedy completion (``*_greedy``); the sampled completions' KL to the reference
        per completion (k1, summed over tokens)."""
        cfg = self.config
        if cfg.eval is None:
            return {}
        # greedy accuracy only: the sampled figures below are this stage's own (no pass@k)
        figures = evaluate_task(self.policy, self.tokenizer, cfg.eval.model_copy(update={"samples": 1}),
                                progress=cfg.train.progress and self.dist.is_main, label=f"{self.stage} eval")
        records = eval_records(get_task(cfg.eval.task, **cfg.eval.options), cfg.eval.n, seed=cfg.eval.seed)
        prompts = [cfg.data.prompt_template.format(prompt=r["prompt"]) for r in records]
        ids = tokenize_prompts(prompts, self.tokenizer, chat=cfg.data.chat)
        r = cfg.rollout
        sampled = self.engine.generate(ids, SamplingParams(n=cfg.eval.samples, temperature=r.temperature, top_p=r.top_p,
                                                           top_k=r.top_k, max_new_tokens=cfg.eval.max_new_tokens,
                                                           seed=cfg.eval.seed))
        greedy = self.engine.generate(ids, SamplingParams(greedy=True, max_new_tokens=cfg.eval.max_new_tokens))
        for suffix, rollout in (("", sampled), ("_greedy", greedy)):
            prompt_of = [prompts[i] for i in rollout.prompt_index]
            columns = record_columns([records[i] for i in rollout.prompt_index])
            for name, composer in (("proxy", self.rewards), ("gold", self.gold)):
                if composer is not None:
                    figures[name + suffix] = float(composer.score(prompt_of, rollout.texts, columns).total.nanmean())
        mask = sampled.to_padded(self.tokenizer.pad_token_id, self.device)["completion_mask"].float()
        kl = kl_penalty(self.frozen_logprobs(sampled, reference=False),
                        self.frozen_logprobs(sampled, reference=True), "k1")
        figures["kl"] = float((kl * mask).sum(1).mean())
        return figures
