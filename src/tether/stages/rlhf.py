"""The synthetic InstructGPT pipeline's two study stages: gold-labelled data, and reward over-optimisation.

``gold_data`` writes what human labellers give InstructGPT, produced by the hidden gold reward of
``tether.tasks.gold``: demonstrations for SFT (``STAGE/sft.jsonl``, a share of them with the
labellers' slips) and comparisons for the reward model (``STAGE/pairs.jsonl`` and held-out
``STAGE/pairs_eval.jsonl``).

``overoptimization`` is PPO against a learned reward model at several KL coefficients (Gao,
Schulman and Hilton 2022, "Scaling Laws for Reward Model Overoptimization"): optimise a proxy (a
reward model trained on gold labels) and measure both as the policy moves away from its start. The
proxy keeps rising with KL(pi || pi_init); the gold reward rises, peaks and falls. Each beta is one
PPO run from the same SFT model (``PPOConfig`` with ``kl.coef = beta``, fixed controller), ending
with the PPO trainer's held-out evaluation: sampled completions of held-out prompts scored by proxy
and gold, and their KL to the SFT model per completion (k1, summed over tokens). The stage writes
``RUN_DIR/overoptimization.png`` (gold and proxy against KL: one point per beta, and the best-of-n
curve from the SFT model, ``best_of_n``) and returns the figures keyed ``beta=B/gold``, ``bon/n=N/gold``
etc. Differs from the
paper: Gao et al. follow KL along one long run (and best-of-n); a beta sweep reaches the large-KL
end in few steps on a CPU. Their x axis is sqrt(KL); ours is KL.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from tether.config.rlhf import GoldDataConfig, OverOptimizationConfig
from tether.data import tokenize_prompts
from tether.data.files import write_jsonl_atomic
from tether.data.sources import record_columns
from tether.models.loading import resolve_model
from tether.rollout import HFEngine, SamplingParams
from tether.scoring import reward_composer
from tether.stages.api import train_ppo
from tether.tasks import eval_records, get_task
from tether.tasks.gold import gold_comparisons, noisy_demonstrations
from tether.trainers import checkpoint as ckpt

log = logging.getLogger(__name__)

PLOT_FILE = "overoptimization.png"


# ---- gold-labelled data --------------------------------------------------------------------------------
def gold_data(cfg: GoldDataConfig, out_dir: str | Path) -> dict[str, float]:
    """Write ``sft.jsonl``, ``pairs.jsonl`` and ``pairs_eval.jsonl`` into ``out_dir``; returns their counts."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    task = get_task(cfg.task.name, **cfg.task.options)
    demos = noisy_demonstrations(task, cfg.sft_n, noise=cfg.noise, error=cfg.noise_error,
                                                   seed=cfg.seed) if cfg.sft_n else []
    pairs = gold_comparisons(task, cfg.pairs_n, errors=cfg.errors, seed=cfg.seed)
    held = gold_comparisons(task, cfg.eval_pairs_n, errors=cfg.errors, seed=cfg.seed, split="eval") \
        if cfg.eval_pairs_n else []
    for name, records in (("sft.jsonl", demos), ("pairs.jsonl", pairs), ("pairs_eval.jsonl", held)):
        write_jsonl_atomic(out_dir / name, records)
    return {"demonstrations": len(demos), "pairs": len(pairs), "eval_pairs": len(held),
            "pairs_dropped_carry": sum(p["error"] == "dropped_carry" for p in pairs) / max(len(pairs), 1)}


def run_gold_data(cfg: GoldDataConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    stage_dir = run_dir / (cfg.name or cfg.type)
    results = gold_data(cfg, stage_dir)
    ckpt.mark_done(stage_dir, {"stage": cfg.name, "type": cfg.type, "results": results})
    return results


# ---- the over-optimisation sweep -----------------------------------------------------------------------


@torch.no_grad()
def best_of_n(cfg: OverOptimizationConfig) -> dict[str, float]:
    """Best-of-n from the starting model on the held-out prompts: for each n, the gold and proxy reward
    of the completion the proxy ranks first among n, and KL = log n - (n - 1) / n.

    Stiennon et al. 2020, appendix G.3 and Gao et al. 2022, eq. 1, for the KL (an upper bound, Beirami
    et al. 2024). ``max(n)`` samples are drawn per prompt once and cut into disjoint blocks of n, so
    every n uses them all; ties go to the earlier sample.
    """
    model, tokenizer = resolve_model(None, None, cfg.model)
    task = get_task(cfg.eval.task, **cfg.eval.options)
    records = eval_records(task, cfg.eval.n, seed=cfg.eval.seed)
    prompts = [cfg.data.prompt_template.format(prompt=r["prompt"]) for r in records]
    size = max(cfg.best_of_n)
    rollout = HFEngine(model, tokenizer, batch_size=cfg.rollout.engine_batch_size).generate(
        tokenize_prompts(prompts, tokenizer, chat=cfg.data.chat),
        SamplingParams(n=size, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                       top_k=cfg.rollout.top_k, max_new_tokens=cfg.eval.max_new_tokens, seed=cfg.eval.seed))
    prompt_of = [prompts[i] for i in rollout.prompt_index]
    columns = record_columns([records[i] for i in rollout.prompt_index])
    defaults = cfg.reward_defaults()
    proxy = reward_composer(cfg.rewards, defaults=defaults).score(prompt_of, rollout.texts, columns).total
    proxy = proxy.nan_to_num(float("-inf"))
    gold = reward_composer([cfg.gold], defaults=defaults).score(prompt_of, rollout.texts, columns).total
    results = {}
    for n in sorted(set(cfg.best_of_n)):
        starts = torch.arange(len(records))[:, None] * size + torch.arange(size // n)[None, :] * n
        blocks = starts.reshape(-1, 1) + torch.arange(n)[None, :]  # a prompt's samples are contiguous
        best = blocks.gather(1, proxy[blocks].argmax(1, keepdim=True)).squeeze(1)
        results.update({f"bon/n={n}/gold": float(gold[best].nanmean()),
                        f"bon/n={n}/proxy": float(proxy[best].mean()),
                        f"bon/n={n}/kl": math.log(n) - (n - 1) / n})
    return results


def sweep(cfg: OverOptimizationConfig, run_dir: str | Path, *, resume: bool = True) -> dict[str, float]:
    """Best-of-n, then one PPO run per beta (a finished run is read back, not redone); writes the plot."""
    run_dir = Path(run_dir)
    results: dict[str, float] = best_of_n(cfg) if cfg.best_of_n else {}
    for i, beta in enumerate(cfg.betas):
        done = ckpt.read_done(run_dir / cfg.run_name(beta))
        figures = done["results"] if done else train_ppo(cfg.ppo_config(beta, first=i == 0), out=run_dir,
                                                         resume=resume)
        for key in ("gold", "proxy", "kl", "accuracy"):
            if key in figures:
                results[f"beta={beta:g}/{key}"] = figures[key]
            if f"before/{key}" in figures:
                results[f"start/{key}"] = figures[f"before/{key}"]
    golds = {b: results[f"beta={b:g}/gold"] for b in cfg.betas}
    best = max(golds, key=golds.get)
    results.update({"peak_beta": best, "peak_gold": golds[best], "peak_kl": results[f"beta={best:g}/kl"]})
    plot_overoptimization(results, cfg.betas, sorted(set(cfg.best_of_n)), run_dir / PLOT_FILE)
    return results


def _panel(ax: Any, points: list[tuple[float, float, float, str]], title: str,
           spread: list[tuple[float, float, float]] | None = None) -> None:
    """Gold (left axis) and proxy (right axis) against KL, each point labelled; ``spread`` (per point, the
    standard deviations of KL, gold and proxy over seeds) draws error bars."""
    right = ax.twinx()
    order = sorted(range(len(points)), key=lambda i: points[i])
    kl, gold, proxy, labels = zip(*(points[i] for i in order), strict=True)
    kl_sd, gold_sd, proxy_sd = zip(*(spread[i] for i in order), strict=True) if spread else (None, None, None)
    ax.errorbar(kl, gold, yerr=gold_sd, xerr=kl_sd, fmt="o-", color="tab:green", capsize=3, label="gold reward")
    right.errorbar(kl, proxy, yerr=proxy_sd, xerr=kl_sd, fmt="s--", color="tab:blue", capsize=3,
                   label="proxy (reward model)")
    for x, y, label in zip(kl, gold, labels, strict=True):
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(3, 5), fontsize=7)
    ax.set_xlabel("KL(π ‖ π_SFT) per completion, nats")
    ax.set_ylabel("gold reward", color="tab:green")
    right.set_ylabel("proxy reward (RM score)", color="tab:blue")
    ax.set_title(title, fontsize=10)
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="lower center", fontsize=7)


def plot_overoptimization(results: dict[str, float], betas: list[float], ns: list[int], path: Path, *,
                          spread: dict[str, float] | None = None, runs: int = 1) -> Path:
    """PPO (one point per beta, held-out figures; the SFT model at KL 0) and, when ``ns``, best-of-n.
    Over seeds, ``results`` holds the means and ``spread`` the standard deviations of the same keys (error
    bars), ``runs`` how many seeds they summarise."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sd = spread or {}

    def point(prefix: str, label: str) -> tuple[tuple[float, float, float, str], tuple[float, float, float]]:
        keys = [f"{prefix}/{k}" for k in ("kl", "gold", "proxy")]
        return (*(results[k] for k in keys), label), tuple(sd.get(k, 0.0) for k in keys)

    ppo = [point(f"beta={b:g}", f"β={b:g}") for b in betas]
    if "start/gold" in results:  # the SFT model, at KL 0
        ppo.append(((0.0, results["start/gold"], results["start/proxy"], "SFT"),
                    (0.0, sd.get("start/gold", 0.0), sd.get("start/proxy", 0.0))))
    fig = Figure(figsize=(12 if ns else 6.5, 4.3), dpi=100)  # on the Agg canvas: no pyplot, no global backend switch
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2 if ns else 1, squeeze=False)
    _panel(axes[0, 0], [p for p, _ in ppo], "PPO against the reward model, one run per KL coefficient β",
           [sd for _, sd in ppo] if spread else None)
    if ns:
        bon = [point(f"bon/n={n}", f"n={n}") for n in ns]
        _panel(axes[0, 1], [p for p, _ in bon], "best-of-n from the SFT model, ranked by the reward model",
               [sd for _, sd in bon] if spread else None)
    over = f", mean +- std of {runs} seeds" if runs > 1 else ""
    fig.suptitle("Reward over-optimisation (Gao, Schulman and Hilton 2022): gold and proxy reward against KL "
                 f"to the SFT model (held-out prompts{over})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_overoptimization_over_seeds(figures: dict[str, dict[str, Any]], run_dir: Path) -> Path | None:
    """The over-optimisation figure of a run over seeds, ``run_dir/overoptimization.png``: ``figures`` is the
    stage's aggregated results (``{"beta=B/gold": {"mean", "std", "n", ...}, ...}``); None when it holds no
    PPO point."""
    betas = sorted({float(k[5:-5]) for k in figures if k.startswith("beta=") and k.endswith("/gold")}, reverse=True)
    if not betas:
        return None
    ns = sorted({int(k[6:-5]) for k in figures if k.startswith("bon/n=") and k.endswith("/gold")})
    means = {k: v["mean"] for k, v in figures.items() if isinstance(v, dict) and "mean" in v}
    stds = {k: v["std"] for k, v in figures.items() if isinstance(v, dict) and "std" in v}
    runs = max(int(v.get("n", 1)) for v in figures.values() if isinstance(v, dict))
    return plot_overoptimization(means, betas, ns, Path(run_dir) / PLOT_FILE, spread=stds, runs=runs)


def run_overoptimization(cfg: OverOptimizationConfig, run_dir: Path, resume: bool) -> dict[str, Any]:
    results = sweep(cfg, run_dir, resume=resume)
    stage_dir = run_dir / (cfg.name or cfg.type)
    stage_dir.mkdir(parents=True, exist_ok=True)
    ckpt.mark_done(stage_dir, {"stage": cfg.name, "type": cfg.type, "results": results})
    return results
