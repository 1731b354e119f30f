"""Preference pairs from agent episodes: a successful and a failed episode of the same prompt (DMPO's data).

An episode record is ``{"prompt": str | [messages], "completion": [assistant / tool messages], "outcome":
float}`` (optionally ``tools``), as :func:`tether.rollout.agent.episode_record` writes one from a
trajectory. Episodes are grouped by prompt (and tools); in each group those scoring at least
``success_threshold`` are successes, the others failures, and each success is paired with one failure
(disjoint pairs, ``min(successes, failures)`` of them, both sides shuffled with ``seed``). A pair is
``{"prompt", "chosen", "rejected", "chosen_outcome", "rejected_outcome"}``: multi-turn completions whose
tool messages the tokeniser masks, so only the agent's own turns carry loss (``loss: dmpo``, or any
sequence-level loss over the whole trajectory).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

from tether.data.schemas import DataError

EPISODE_FIELDS = ("prompt", "completion", "outcome")


def _outcome(episode: Any, row: int) -> float:
    if not isinstance(episode, dict) or any(k not in episode for k in EPISODE_FIELDS):
        have = sorted(episode) if isinstance(episode, dict) else type(episode).__name__
        raise DataError(f"episode {row}: needs fields {', '.join(EPISODE_FIELDS)}; got {have}", row=row)
    value = episode["outcome"]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DataError(f"episode {row}, field 'outcome': expected a number (the verifier's score), got {value!r}",
                        row=row, field="outcome")
    return float(value)


def episode_pairs(episodes: Sequence[dict], *, success_threshold: float = 1.0, seed: int = 0
                  ) -> tuple[list[dict], dict[str, int]]:
    """Pair successful with failed episodes of the same prompt; see the module docstring.

    Returns ``(pairs, stats)``; stats count ``episodes``, ``prompts``, ``pairs``, prompts with no success
    (``no_success``) or no failure (``no_failure``), and pairs left out because both completions are
    equal (``identical``).
    """
    groups: dict[str, list[tuple[dict, float]]] = {}
    for row, episode in enumerate(episodes, start=1):
        score = _outcome(episode, row)
        key = json.dumps([episode["prompt"], episode.get("tools")], sort_keys=True)
        groups.setdefault(key, []).append((episode, score))
    stats = {"episodes": len(episodes), "prompts": len(groups), "pairs": 0, "no_success": 0, "no_failure": 0,
             "identical": 0}
    pairs = []
    for g, group in enumerate(groups.values()):
        wins = [e for e in group if e[1] >= success_threshold]
        losses = [e for e in group if e[1] < success_threshold]
        stats["no_success"] += not wins
        stats["no_failure"] += not losses
        rng = random.Random(f"episode-pairs:{seed}:{g}")
        rng.shuffle(wins)
        rng.shuffle(losses)
        for (win, win_score), (lose, lose_score) in zip(wins, losses, strict=False):
            if win["completion"] == lose["completion"]:
                stats["identical"] += 1
                continue
            pair = {"prompt": win["prompt"], "chosen": win["completion"], "rejected": lose["completion"],
                    "chosen_outcome": win_score, "rejected_outcome": lose_score}
            if win.get("tools") is not None:
                pair["tools"] = win["tools"]
            pairs.append(pair)
    stats["pairs"] = len(pairs)
    return pairs, stats
