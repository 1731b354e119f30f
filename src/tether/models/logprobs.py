"""Log-probabilities under a model, from one forward pass: the entry point every trainer and evaluator calls.

:func:`token_logprobs` is the one place a model is run to score tokens: sequences packed
padding-free (sequences of one group sharing their common prefix, :mod:`tether.data.prefix_sharing`),
the per-token log-probs ``log pi(x_t | x_<t)`` (temperature-scaled) of the tokens from a given
position on, and optionally their entropies, read with :func:`tether.core.logprobs.selective_log_softmax`
(the same definition a sampler reports). The others are its shapes for each caller:

- :func:`completion_logprobs`: completions given their prompts (the RL trainers: old, reference and
  current policy log-probs);
- :func:`example_logprobs`: tokenised examples' loss tokens (offline preference losses, KTO);
- :func:`pair_logprobs` / :func:`preference_inputs`: a pair's chosen and rejected in one forward
  (the DPO family), with summed log-probs, lengths and WPO weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from tether.config.data import PrefixSharing
from tether.core.logprobs import entropy_from_logits, selective_log_softmax, sequence_logprobs
from tether.core.preference import PreferenceInputs, wpo_weights
from tether.core.token_preference import position_kl
from tether.core.turn_preference import turn_sums
from tether.data.packing import pack_sequences
from tether.data.pairs import PairExample
from tether.data.prefix_sharing import (
    attention_pair_cost,
    pack_prefix_groups,
    sharing_pays,
    supports_custom_masks,
)
from tether.data.tokenize import TokenizedExample
from tether.models.cascade_attention import cascade_forward, cascade_pays, supports_cascade
from tether.models.output_head import head_at, output_head
from tether.models.reward_model import layout_sequences


@dataclass
class ScoredForward:
    """One packed forward pass and where each scored token sits in it: ``logits`` (rows, width, V), or (1, K, V)
    at the K scored positions only (a large vocabulary: :mod:`tether.models.output_head`); the
    flat logits position predicting each scored token (``keys``) and the token (``targets``), both in the
    order of ``valid`` (N, W)'s True entries; ``primary``: the token is that position's own label (False
    where a shared prefix position predicts two tokens, at a branch point)."""

    logits: torch.Tensor
    keys: torch.Tensor
    targets: torch.Tensor
    valid: torch.Tensor
    primary: torch.Tensor

    def logprobs(self, temperature: float = 1.0) -> torch.Tensor:
        """``log π(x_t | x_<t)`` at every scored token, (N, W), 0 where not ``valid``."""
        logits, keys, targets = self.logits, self.keys, self.targets
        labels = torch.full((logits.shape[0] * logits.shape[1],), -100, dtype=torch.long, device=logits.device)
        labels[keys] = targets
        values = selective_log_softmax(logits, labels.view(logits.shape[:2]), temperature=temperature).view(-1)[keys]
        if not bool(self.primary.all()):  # the other tokens of a branch point, from a gathered copy of their rows
            extra = (~self.primary).nonzero().squeeze(-1)
            flat_logits = logits.reshape(-1, logits.shape[-1])
            scored = selective_log_softmax(flat_logits[keys[extra]], targets[extra], temperature=temperature)
            values = torch.where(self.primary, values, torch.zeros_like(values).index_put((extra,), scored))
        return self.scatter(values)

    def entropy(self, temperature: float = 1.0, *, grad: bool = False) -> torch.Tensor:
        """The entropy of the distribution each scored token was drawn from, (N, W)."""
        with nullcontext() if grad else torch.no_grad():
            ent = entropy_from_logits(self.logits, temperature=temperature).view(-1)[self.keys]
            return self.scatter(ent)

    def log_distributions(self, temperature: float = 1.0) -> torch.Tensor:
        """``log π(· | x_<t)`` over the vocabulary at every scored token (logits / ``temperature``), (number
        scored, V), float32."""
        logits = self.logits.reshape(-1, self.logits.shape[-1])[self.keys].float()
        return torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """Values in scored-token order laid out as (N, W), 0 where not ``valid``."""
        return torch.zeros(self.valid.shape, dtype=values.dtype, device=values.device).masked_scatter(self.valid, values)


def scored_forward(model: torch.nn.Module, sequences: Sequence[Sequence[int]], *, first_targets: Sequence[int],
                   groups: Sequence[int] | None = None, row_tokens: int, pad_token_id: int,
                   prefix_sharing: PrefixSharing = True) -> ScoredForward:
    """Each sequence's tokens from ``first_targets[i]`` on, scored by one packed forward of ``model``
    (see :func:`token_logprobs`)."""
    device = next(model.parameters()).device
    lengths = torch.tensor([len(s) for s in sequences])
    first = torch.as_tensor(list(first_targets), dtype=torch.long)
    if bool((first < 1).any()) or bool((first > lengths).any()):
        raise ValueError("first_targets must lie in [1, len(sequence)]: the first token has no prediction")
    if prefix_sharing not in (True, False, "auto", "cascade", "mask"):
        raise ValueError(f"prefix_sharing must be true, false, 'auto', 'cascade' or 'mask', not {prefix_sharing!r}")
    cascade = (groups is not None
               and (prefix_sharing == "cascade"
                    or (prefix_sharing is True and cascade_pays(device, len(groups) / len(set(groups)))))
               and supports_cascade(model))
    masked = (groups is not None and prefix_sharing is not False and not cascade and supports_custom_masks(model)
              and (prefix_sharing != "auto"
                   or sharing_pays(sequences, groups, row_tokens=row_tokens, pair_cost=attention_pair_cost(model))))
    if cascade or masked:
        packed = pack_prefix_groups(sequences, groups, row_tokens=row_tokens, pad_token_id=pad_token_id)
        rows, columns, width_in = packed.rows, packed.columns, packed.input_ids.shape[1]
        inputs = {} if cascade else packed.model_inputs(model)
    else:
        plain = pack_sequences(sequences, row_tokens=row_tokens, pad_token_id=pad_token_id)
        inputs, rows = plain.model_inputs(), plain.rows
        steps = torch.arange(int(lengths.max()))
        columns = torch.where(steps[None, :] < lengths[:, None], plain.starts[:, None] + steps[None, :], -1)
        width_in = plain.input_ids.shape[1]
    width = int((lengths - first).max())
    j = torch.arange(width)
    valid = j[None, :] < (lengths - first)[:, None]
    targets_at = (first[:, None] + j[None, :]).clamp(max=columns.shape[1] - 1)
    padded = torch.full(columns.shape, pad_token_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        padded[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    targets = padded.gather(1, targets_at)[valid].to(device)
    predicted_at = columns.gather(1, targets_at - 1)[valid]
    keys = (rows[:, None].expand_as(valid)[valid] * width_in + predicted_at).to(device)

    head = output_head(model)
    positions = None
    if head is not None:  # the head at the scored positions only: logits (1, K, V), keys index them
        positions, keys = torch.unique(keys, return_inverse=True)
    with nullcontext() if positions is None else head_at(head, positions):
        if cascade:
            logits = cascade_forward(model, packed).logits
        else:
            logits = model(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}).logits
    # one label per logits position: the first token a position predicts is its primary one
    labels = torch.full((logits.shape[0] * logits.shape[1],), -100, dtype=torch.long, device=device)
    labels[keys] = targets
    return ScoredForward(logits, keys, targets, valid.to(device), labels[keys] == targets)


def token_logprobs(model: torch.nn.Module, sequences: Sequence[Sequence[int]], *,
                            first_targets: Sequence[int], groups: Sequence[int] | None = None,
                            temperature: float = 1.0, row_tokens: int, pad_token_id: int,
                            with_entropy: bool = False, entropy_grad: bool = False,
                            prefix_sharing: PrefixSharing = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of each sequence's tokens from ``first_targets[i]`` on, one packed forward.

    Returns ``(logps, valid, entropy)``, each (N, W) with W the most scored tokens of any sequence:
    ``logps[i, j] = log π(x_t | x_<t) / temperature-scaled`` for ``t = first_targets[i] + j`` where
    ``valid[i, j]``, 0 elsewhere; ``entropy[i, j]`` the entropy of the distribution x_t was drawn
    from (with ``with_entropy``; gradients only with ``entropy_grad``). Sequences with the same
    ``groups`` id share their common prefix as ``prefix_sharing`` says (:data:`PrefixSharing`): by cascade
    attention (``"cascade"``, or True where :func:`~tether.models.cascade_attention.cascade_pays`) when the
    model dispatches attention through transformers' ``AttentionInterface``, else under a dense row mask
    when the model takes custom masks (with ``"auto"`` only when :func:`sharing_pays`); otherwise (or with
    ``groups=None``) they are packed side by side.
    """
    scored = scored_forward(model, sequences, first_targets=first_targets, groups=groups, row_tokens=row_tokens,
                            pad_token_id=pad_token_id, prefix_sharing=prefix_sharing)
    entropy = scored.entropy(temperature, grad=entropy_grad) if with_entropy else None
    return scored.logprobs(temperature), scored.valid, entropy


def completion_logprobs(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], *,
                        temperature: float, row_tokens: int, pad_token_id: int, with_entropy: bool = False,
                        entropy_grad: bool = False, share_prompts: PrefixSharing = True
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of each completion given its prompt, shape (N, C).

    The prompt+completion sequences are packed; with ``share_prompts`` the completions of one prompt
    (a group) share it, so it goes through the model once (:mod:`tether.data.prefix_sharing`), by the
    attention :data:`PrefixSharing` names; ``"auto"``: only where that is cheaper than plain packing (:func:`~tether.data.prefix_sharing.sharing_pays`);
    ``"cascade"``: always, with cascade attention (:mod:`tether.models.cascade_attention`).
    Position j of row i scores ``completions[i][j]``; positions past a completion's length are 0.
    """
    index: dict[tuple[int, ...], int] = {}
    groups = [index.setdefault(tuple(p), len(index)) for p in prompts] if share_prompts else None
    logps, _, entropy = token_logprobs(
        model, [p + c for p, c in zip(prompts, completions, strict=True)], first_targets=[len(p) for p in prompts],
        groups=groups, temperature=temperature, row_tokens=row_tokens, pad_token_id=pad_token_id,
        with_entropy=with_entropy, entropy_grad=entropy_grad, prefix_sharing=share_prompts)
    return logps, entropy


def example_logprobs(model: torch.nn.Module, examples: Sequence[TokenizedExample], *, row_tokens: int,
                         pad_token_id: int, packing: bool = True, groups: Sequence[int] | None = None,
                         prefix_sharing: PrefixSharing = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of each example's loss tokens, from one forward pass.

    Returns ``(token_logps, mask)``, both shape (N, T): ``token_logps[i, j]`` is the log-prob of the
    j-th token of example i from its first loss token on, where ``mask[i, j]`` (that token is a loss
    token), 0 elsewhere. Packed by default; examples with the same ``groups`` id (a pair's chosen and
    rejected) then share their common prefix as ``prefix_sharing`` says (:data:`PrefixSharing`). With
    ``packing=False`` one right-padded row per example.
    """
    if not packing:
        return _padded_example_logprobs(model, examples, pad_token_id=pad_token_id)
    first = _first_loss_tokens(examples)
    logps, valid, _ = token_logprobs(model, [e.input_ids for e in examples], first_targets=first,
                                              groups=groups, row_tokens=row_tokens, pad_token_id=pad_token_id,
                                              prefix_sharing=prefix_sharing)
    mask = _loss_mask(examples, first, valid)
    return torch.where(mask, logps, 0.0), mask


def _first_loss_tokens(examples: Sequence[TokenizedExample]) -> list[int]:
    return [next((t for t, label in enumerate(e.labels) if t > 0 and label != -100), len(e)) for e in examples]


def _loss_mask(examples: Sequence[TokenizedExample], first: list[int], valid: torch.Tensor) -> torch.Tensor:
    scored = torch.zeros(valid.shape, dtype=torch.bool)
    for i, (e, f) in enumerate(zip(examples, first, strict=True)):
        scored[i, : len(e) - f] = torch.tensor(e.labels[f:], dtype=torch.long) != -100
    return scored.to(valid.device) & valid


def example_sequential_kl(model: torch.nn.Module, reference_model: torch.nn.Module,
                          examples: Sequence[TokenizedExample], *, row_tokens: int, pad_token_id: int,
                          groups: Sequence[int] | None = None, prefix_sharing: PrefixSharing = True
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`example_logprobs` under ``model`` and each example's sequential KL to ``reference_model``:
    ``Σ_t KL(π_ref(·|x, y<t) ‖ π(·|x, y<t))`` over its loss tokens (TDPO; :func:`~tether.core.token_preference.position_kl`),
    shape (N,), differentiable in ``model``. Both models see the same packed layout; the reference's
    forward runs without gradients. Packed layouts only (``data.packing: true``)."""
    first = _first_loss_tokens(examples)
    kwargs = {"first_targets": first, "groups": groups, "row_tokens": row_tokens, "pad_token_id": pad_token_id,
              "prefix_sharing": prefix_sharing}
    policy = scored_forward(model, [e.input_ids for e in examples], **kwargs)
    with torch.no_grad():
        reference = scored_forward(reference_model, [e.input_ids for e in examples], **kwargs)
    if not torch.equal(policy.keys, reference.keys):
        raise ValueError("the policy and the reference model laid the sequences out differently (prefix sharing on "
                         "one only); use models of the same architecture")
    mask = _loss_mask(examples, first, policy.valid)
    kl = policy.scatter(position_kl(reference.log_distributions(), policy.log_distributions()))
    return torch.where(mask, policy.logprobs(), 0.0), mask, (kl * mask).sum(-1)


def _padded_example_logprobs(model: torch.nn.Module, examples: Sequence[TokenizedExample], *, pad_token_id: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    device = next(model.parameters()).device
    packed, attention_mask = layout_sequences([e.input_ids for e in examples], packing=False,
                                              row_tokens=0, pad_token_id=pad_token_id)
    labels = torch.full_like(packed.input_ids, -100)
    for i, e in enumerate(examples):
        labels[i, : len(e) - 1] = torch.tensor(e.labels[1:], dtype=torch.long)
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in packed.model_inputs().items()}
    logits = model(**inputs, attention_mask=attention_mask.to(device)).logits
    token_logps = selective_log_softmax(logits, labels.to(device))[:, :-1]
    mask = (labels != -100)[:, :-1].to(device)
    return torch.where(mask, token_logps, 0.0), mask


def preference_inputs(model: torch.nn.Module, pairs: Sequence[PairExample], ref_chosen: torch.Tensor | None,
                ref_rejected: torch.Tensor | None, *, wpo: bool, row_tokens: int, pad_token_id: int,
                packing: bool = True, prefix_sharing: PrefixSharing = True,
                reference_model: torch.nn.Module | None = None, turns: bool = False) -> PreferenceInputs:
    """Summed completion log-probs of chosen and rejected under ``model`` (one forward pass; packed,
    a pair's common prefix computed once with ``prefix_sharing``), with the given reference log-probs
    (shape (B,) each, or None), lengths, the records' win probabilities when every pair has them, and,
    with ``wpo``, WPO weights; with ``reference_model``, each completion's sequential KL to it (TDPO);
    with ``turns``, each assistant turn's summed log-prob and the turn counts (DMPO; the reference's
    per-turn sums are the caller's)."""
    b = len(pairs)
    seq_kl = None
    if reference_model is None:
        tok, mask = pair_logprobs(model, pairs, row_tokens=row_tokens, pad_token_id=pad_token_id, packing=packing,
                                  prefix_sharing=prefix_sharing)
    else:
        if not packing:
            raise ValueError("the sequential KL (tdpo) is computed on packed rows: set data.packing: true")
        groups = list(range(b)) * 2 if prefix_sharing else None
        tok, mask, seq_kl = example_sequential_kl(model, reference_model, [p.chosen for p in pairs]
                                                  + [p.rejected for p in pairs], row_tokens=row_tokens,
                                                  pad_token_id=pad_token_id, groups=groups,
                                                  prefix_sharing=prefix_sharing)
    logps = sequence_logprobs(tok, mask, average=False)
    lengths = mask.sum(-1).float()
    weights = wpo_weights(tok[:b], mask[:b], tok[b:], mask[b:]) if wpo else None
    wins = None
    if pairs and all(p.win_probs is not None for p in pairs):
        wins = torch.tensor([p.win_probs for p in pairs], dtype=logps.dtype, device=logps.device)
    per_turn: dict[str, torch.Tensor] = {}
    if turns:
        for side, rows in (("chosen", slice(None, b)), ("rejected", slice(b, None))):
            per_turn[f"{side}_turn_logps"], per_turn[f"{side}_turns"] = turn_sums(tok[rows], mask[rows])
    return PreferenceInputs(logps[:b], logps[b:], ref_chosen, ref_rejected, lengths[:b], lengths[b:],
                            weights=weights, chosen_win_prob=None if wins is None else wins[:, 0],
                            rejected_win_prob=None if wins is None else wins[:, 1],
                            chosen_seq_kl=None if seq_kl is None else seq_kl[:b],
                            rejected_seq_kl=None if seq_kl is None else seq_kl[b:], **per_turn)


def pair_logprobs(model: torch.nn.Module, pairs: Sequence[PairExample], *, row_tokens: int, pad_token_id: int,
                     packing: bool = True, prefix_sharing: PrefixSharing = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``example_logprobs`` of the chosen (rows ``:B``) then the rejected (rows ``B:``) of ``pairs``, each
    pair's common prefix shared as ``prefix_sharing`` says (:data:`PrefixSharing`)."""
    groups = list(range(len(pairs))) * 2 if prefix_sharing else None
    return example_logprobs(model, [p.chosen for p in pairs] + [p.rejected for p in pairs], row_tokens=row_tokens,
                            pad_token_id=pad_token_id, packing=packing, groups=groups,
                            prefix_sharing=prefix_sharing)
