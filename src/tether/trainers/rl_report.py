"""What an RL step reports about its rollouts: reward, length and return figures, and sample completions."""

from __future__ import annotations

from typing import Any

from tether.core.aggregation import masked_mean


class RolloutReport:
    """Mixed into :class:`~tether.trainers.rl.RLTrainer` (which owns ``gold``, ``records`` and ``columns``)."""

    def rollout_metrics(self, batch: Any) -> dict[str, Any]:
        """What the rollout looked like: rewards (and the gold reward beside the proxy), lengths, the critic's
        returns."""
        present = batch.scores[batch.valid]
        lengths = batch.mask.new_tensor([len(c) for c in batch.rollout.completion_ids])
        out: dict[str, Any] = {
            "reward/mean": present.mean() if present.numel() else float("nan"),
            "reward/std": present.std() if present.numel() > 1 else 0.0,
            "completion/length_mean": lengths.mean(), "completion/length_max": lengths.max(),
            "completion/truncated_frac": batch.truncated.float().mean(),
        }
        if self.gold is not None:
            prompts, columns = self.columns(batch.prompt_indices, batch.rollout)
            batch.gold = self.gold.score(prompts, batch.rollout.texts, columns).total
            out.update({"reward/proxy": out["reward/mean"],
                        "reward/proxy_std": present.std(correction=0) if present.numel() else float("nan"),
                        "reward/gold": batch.gold.nanmean()})
        if batch.returns is not None:
            out["returns/mean"] = masked_mean(batch.returns, batch.mask)
        return out

    def samples(self, batch: Any) -> list[dict[str, Any]]:
        """A few of the step's completions with their rewards, for ``samples.jsonl``."""
        gold = batch.gold
        return [{"prompt": self.records[batch.prompt_indices[batch.rollout.prompt_index[i]]]["prompt"],
                 "completion": batch.rollout.texts[i], "reward": float(batch.scores[i]),
                 **({"gold": float(gold[i])} if gold is not None else {})} for i in range(min(8, len(batch)))]
