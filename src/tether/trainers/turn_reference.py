"""Reference log-probs of preference pairs, summed per sequence and, for turn-level losses (DMPO), per
assistant turn: computed once from the initial weights and cached like the summed ones.

A turn is a maximal run of loss tokens of a tokenised example (:func:`tether.core.turn_preference.turn_sums`):
with chat records, the assistant messages carry the loss and the tool / user messages between them do
not, so each assistant message is one turn. Per-turn sums are kept as one (N, K) tensor per side,
K the most turns of any pair, zero-padded; a micro-batch takes its rows and the first K' columns, K'
its own most turns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tether.config.data import PrefixSharing
from tether.core.logprobs import sequence_logprobs
from tether.core.preference import PreferenceInputs
from tether.core.turn_preference import turn_sums
from tether.data.pairs import PairExample
from tether.data.schedule import chunks
from tether.models.logprobs import pair_logprobs


def _cat_padded(parts: list[torch.Tensor]) -> torch.Tensor:
    width = max(p.shape[1] for p in parts)
    return torch.cat([F.pad(p, (0, width - p.shape[1])) for p in parts])


@torch.no_grad()
def pair_reference_logprobs(model: torch.nn.Module, pairs: Sequence[PairExample], *, batch_size: int,
                            turns: bool, row_tokens: int, pad_token_id: int, packing: bool,
                            prefix_sharing: PrefixSharing) -> dict[str, torch.Tensor]:
    """``{"chosen": (N,), "rejected": (N,)}`` summed completion log-probs under ``model``'s current weights
    (call it in eval mode), in chunks of ``batch_size`` pairs laid out as in training; with ``turns`` also
    ``"chosen_turns"`` (N, K) and ``"rejected_turns"`` (N, K'), each assistant turn's sum, and the turn counts
    ``"chosen_turn_counts"`` / ``"rejected_turn_counts"`` (N,). On the CPU."""
    sums: list[torch.Tensor] = []
    per_turn: dict[str, list[torch.Tensor]] = {"chosen_turns": [], "rejected_turns": [], "chosen_turn_counts": [],
                                               "rejected_turn_counts": []}
    for chunk in chunks(list(pairs), batch_size):
        tok, mask = pair_logprobs(model, chunk, row_tokens=row_tokens, pad_token_id=pad_token_id, packing=packing,
                                  prefix_sharing=prefix_sharing)
        sums.append(sequence_logprobs(tok, mask, average=False).cpu().view(2, -1))
        if turns:
            b = len(chunk)
            for side, rows in (("chosen", slice(None, b)), ("rejected", slice(b, None))):
                values, counts = turn_sums(tok[rows], mask[rows])
                per_turn[f"{side}_turns"].append(values.cpu())
                per_turn[f"{side}_turn_counts"].append(counts.cpu())
    if not sums:
        return {"chosen": torch.zeros(0), "rejected": torch.zeros(0)}
    chosen, rejected = torch.cat(sums, dim=1)
    out = {"chosen": chosen, "rejected": rejected}
    if turns:
        out.update({k: _cat_padded(v) if k.endswith("_turns") else torch.cat(v) for k, v in per_turn.items()})
    return out


def with_reference_turns(inputs: PreferenceInputs, chosen: torch.Tensor, rejected: torch.Tensor) -> PreferenceInputs:
    """``inputs`` (with the policy's per-turn sums) given the reference's rows of the same pairs, cut to the
    policy's widths: a pair's turns are the same under both, so only zero padding is dropped."""
    if inputs.chosen_turn_logps is None or inputs.rejected_turn_logps is None:
        raise ValueError("per-turn reference log-probs need the policy's per-turn sums: call preference_inputs "
                         "with turns=True")
    device = inputs.chosen_turn_logps.device
    return dataclasses.replace(
        inputs,
        ref_chosen_turn_logps=_fit(chosen, inputs.chosen_turn_logps.shape[1]).to(device),
        ref_rejected_turn_logps=_fit(rejected, inputs.rejected_turn_logps.shape[1]).to(device))


def held_out_inputs(policy: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> PreferenceInputs:
    """Turn-level inputs of held-out pairs: ``policy`` from :func:`pair_reference_logprobs` under the current
    weights, ``reference`` the cache (its ``eval_*`` entries, same pairs and order)."""
    return PreferenceInputs(
        policy["chosen"], policy["rejected"], reference["eval_chosen"], reference["eval_rejected"],
        chosen_turn_logps=policy["chosen_turns"], rejected_turn_logps=policy["rejected_turns"],
        ref_chosen_turn_logps=_fit(reference["eval_chosen_turns"], policy["chosen_turns"].shape[1]),
        ref_rejected_turn_logps=_fit(reference["eval_rejected_turns"], policy["rejected_turns"].shape[1]),
        chosen_turns=policy["chosen_turn_counts"], rejected_turns=policy["rejected_turn_counts"])


def _fit(rows: torch.Tensor, width: int) -> torch.Tensor:
    if rows.shape[1] >= width:
        return rows[:, :width]
    return F.pad(rows, (0, width - rows.shape[1]))
