"""A lean decode step with a static KV cache for Llama-architecture models (Llama, Qwen2, Mistral).

Per new token, a Hugging Face forward spends most of its time in Python on a small model: module
hooks and wrappers, cache objects that grow by concatenation, mask construction. This module runs
the same arithmetic as ``LlamaDecoderLayer`` with the live model's own parameters and rotary
module, over key / value buffers allocated once for the whole decode:

- q, k and v come from one matmul with the three projection weights concatenated, and gate and up
  from one matmul likewise (weights gathered once per ``generate`` call, so the decoder always
  uses the current weights), each a :class:`~tether.rollout.projection.Projection` that wide models
  prepack for the CPU's matrix-product kernels;
- rotary embedding is one complex multiply: the q and k projection rows of every head are reordered
  once so that each rotated pair (i, i + head_dim / 2) sits side by side, and q . k is unchanged by
  the same reordering of both; the rotated k is written straight into its cache column, and q's
  rotation carries the attention scale;
- RMSNorm is ``torch.nn.functional.rms_norm``'s arithmetic (:func:`rms_norm`); attention over the filled
  prefix of the buffers is ``baddbmm`` (scores plus the additive padding mask, built once), softmax and ``bmm``;
- each step writes one column of the buffers in place, through views of every layer's column and attention
  window taken once per step; dropping finished rows is one index select.

The prompts' prefill runs here too (:meth:`StaticDecoder.prefill`): their real tokens only, packed into one
matrix through the projections, attention per prompt, keys rotated straight into the buffers, and the last
layer's output projection and MLP for each prompt's last token only (the one the logits read); a cache from
an ordinary model forward can be copied in instead (continuous batching does). :func:`supports` decides
whether a model qualifies (plain Llama-style modules, no adapters, no sliding window, no biases beyond
q/k/v); anything else keeps the generic path. Tests check that greedy decoding gives the same tokens and
logits as the generic path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tether.rollout.projection import REPACK_MIN_STEPS, Projection, packing_pays

SUPPORTED_TYPES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")

# Drop finished rows from the batch once the running rows are at most this fraction of it. Measured on the
# tiny model (batch 64, 64 new tokens, ragged EOS): 0.75 beat 0.5 by ~10% and never compacting by ~35%.
COMPACT_FRACTION = 0.75
# ...and only when the batch is at least this large (smaller batches are overhead-bound anyway).
COMPACT_MIN_BATCH = 8


def supports(model: Any, total_length: int) -> bool:
    """True when ``model`` is a plain Llama-architecture causal LM this decoder reproduces exactly
    for sequences of up to ``total_length`` tokens (prompt width + new tokens)."""
    if type(model).__name__ not in SUPPORTED_TYPES:
        return False
    cfg = model.config
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    if window is not None and total_length > window:
        return False
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
        return False
    if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return False
    for layer in model.model.layers:
        projections = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                       layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
        if any(type(p) is not torch.nn.Linear for p in projections) or layer.self_attn.o_proj.bias is not None:
            return False  # adapters (LoRA) or quantised layers wrap these: keep the generic path
    if type(model.lm_head) is not torch.nn.Linear:
        return False
    return _rotary_pairs_share_an_angle(model)


def _rotation_is_static(model: Any) -> bool:
    """Whether the model's rotary angles depend on the position alone (not on the sequence length, as
    ``dynamic`` and ``longrope`` scaling do), so that one table serves every step."""
    rope_type = str(getattr(model.model.rotary_emb, "rope_type", "default"))
    return "dynamic" not in rope_type and rope_type != "longrope"


def _rotary_pairs_share_an_angle(model: Any) -> bool:
    """The complex-multiply rotation needs dimensions i and i + head_dim / 2 rotated by one angle (Hugging
    Face's ``rotate_half`` layout, every rope type of these models): checked on a probe."""
    probe = model.lm_head.weight.new_zeros((1, 2, model.config.hidden_size))
    positions = torch.arange(2, device=probe.device)[None]
    cos, sin = model.model.rotary_emb(probe, positions)
    half = cos.shape[-1] // 2
    return bool(torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:]))


@dataclass
class _Layer:
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    input_norm: torch.Tensor
    post_norm: torch.Tensor

    def projections(self) -> tuple[Projection, ...]:
        return self.qkv, self.o, self.gate_up, self.down


def pair_order(head_dim: int) -> torch.Tensor:
    """The head-dimension order that puts each rotary pair (i, i + head_dim / 2) side by side:
    0, h, 1, h + 1, ... (h = head_dim / 2), so a rotation is a complex multiply of adjacent pairs."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=-1).flatten()


def _pairs_adjacent(projection: torch.Tensor | None, heads: int, order: torch.Tensor) -> torch.Tensor | None:
    """Reorder each head's rows (weight (heads * D, H) or bias (heads * D,)) by ``order``."""
    if projection is None:
        return None
    grouped = projection.reshape(heads, len(order), *projection.shape[1:])
    return grouped[:, order].reshape(projection.shape)


def _gather_layers(model: Any, heads: int, kv_heads: int, order: torch.Tensor) -> list[_Layer]:
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        biases = [_pairs_adjacent(attn.q_proj.bias, heads, order), _pairs_adjacent(attn.k_proj.bias, kv_heads, order),
                  attn.v_proj.bias]
        qkv_weight = torch.cat([_pairs_adjacent(attn.q_proj.weight, heads, order),
                                _pairs_adjacent(attn.k_proj.weight, kv_heads, order), attn.v_proj.weight])
        layers.append(_Layer(
            qkv=Projection(qkv_weight, torch.cat(biases) if all(b is not None for b in biases) else None),
            o=Projection(attn.o_proj.weight),
            gate_up=Projection(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
            down=Projection(mlp.down_proj.weight),
            input_norm=layer.input_layernorm.weight,
            post_norm=layer.post_attention_layernorm.weight,
        ))
    return layers


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             constants: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dimension, scaled by ``weight``: ``F.rms_norm``'s values.

    For float32 on a CPU, given ``constants`` (0-dim float32 tensors of the width and of ``eps`` on ``x``'s
    device), the operations of ``F.rms_norm``'s CPU composite written out (``pow(x, 2)`` is ``x * x`` there,
    ``mean`` a sum divided by the width): bitwise its result in 8 dispatches against its 24, which add
    wrappers and a copy for each Python scalar (a decode step of the tiny model runs 9 norms). Anything
    else goes to ``F.rms_norm``."""
    if constants is None or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu":
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    mean_square = torch.mul(x, x).sum(-1, keepdim=True).div_(constants[0]).add_(constants[1])
    return torch.mul(x, mean_square.rsqrt_()).mul_(weight)


def _complex_pairs(x: torch.Tensor) -> torch.Tensor:
    """(..., D) with adjacent rotary pairs -> a complex view (..., D / 2) of the same memory."""
    return torch.view_as_complex(x.unflatten(-1, (-1, 2)))


def _rotate(x: torch.Tensor, rotation: torch.Tensor, out: torch.Tensor | None = None,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rotary embedding of ``x`` (B, heads, D), pairs adjacent: ``x * rotation`` as complex numbers
    (``rotation`` (B, 1, D / 2), complex64), written to ``out`` when given, else returned in ``dtype``
    (default ``x``'s). Other than float32 / float64, the multiply runs in float32."""
    if x.dtype in (torch.float32, torch.float64):
        rotated = torch.mul(_complex_pairs(x), rotation, out=None if out is None else _complex_pairs(out))
        return torch.view_as_real(rotated).flatten(-2) if out is None else out
    rotated = torch.view_as_real(_complex_pairs(x.float()) * rotation).flatten(-2)
    return rotated.to(dtype or x.dtype) if out is None else out.copy_(rotated)


def cache_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the decode KV cache and of attention over it: the model's, except float32 for a 16-bit
    model on a CPU. There a bfloat16 ``baddbmm`` / ``bmm`` first copies a key or value window that is not
    contiguous in memory (the filled columns of a larger buffer), and those copies made up about a third
    of a bfloat16 decode step of the small model; float32 products read the strided window in place
    (docs/performance.md: 0.45 against 1.5 ms per layer of the small model at batch 64)."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


class StaticDecoder:
    """Decode steps for one batch: buffers of shape (layers, B, kv_heads, capacity, head_dim).

    ``cache`` is the model's cache after an ordinary prefill forward (keys already rotated), or None for
    buffers that :meth:`prefill` fills; ``mask`` is the (B, width) 0/1 padding mask of the prompts (left
    padding), ``steps`` how many tokens will be decoded at most. ``capacity``
    (columns, at least width + steps) leaves room for sequences put into finished rows later
    (:meth:`insert`, continuous batching); :meth:`make_room` drops columns no live row attends to.
    """

    def __init__(self, model: Any, cache: Any | None, mask: torch.Tensor, steps: int,
                 capacity: int | None = None) -> None:
        cfg = model.config
        self.model = model
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.order = pair_order(self.head_dim).to(model.lm_head.weight.device)
        self.layers = _gather_layers(model, self.heads, self.kv_heads, self.order)
        self.eps = cfg.rms_norm_eps
        self.norm_constants = tuple(torch.tensor(float(c), device=model.lm_head.weight.device)
                                    for c in (cfg.hidden_size, self.eps))
        self.scale = self.head_dim ** -0.5
        self.final_norm = model.model.norm.weight
        batch, width = mask.shape
        weight = model.lm_head.weight
        columns = max(capacity or 0, width + steps)
        shape = (len(self.layers), batch, self.kv_heads, columns, self.head_dim)
        dtype = cache_dtype(weight.dtype, weight.device)
        self.keys = torch.empty(shape, dtype=dtype, device=weight.device)
        self.values = torch.empty(shape, dtype=dtype, device=weight.device)
        for i, layer in enumerate(cache.layers if cache is not None else ()):
            self.keys[i, :, :, :width].copy_(layer.keys[..., self.order])
            self.values[i, :, :, :width].copy_(layer.values)
        self.length = width
        bias = torch.zeros((batch, 1, 1, columns), dtype=dtype, device=weight.device)
        bias[:, 0, 0, :width].masked_fill_(mask == 0, torch.finfo(dtype).min)
        self.bias = bias
        self.start = width - mask.sum(-1).long()  # per row, the first column it attends to
        self.first = 0  # no row attends left of this column: attention reads from here on
        self.steps = steps
        self.remaining = steps  # decode steps the running rows may still take
        self.packs = packing_pays(self.layers[0].qkv.weight, cfg.hidden_size)
        self.packed_rows = 0  # the batch size the projections were last prepared for
        self.tabulated = _rotation_is_static(model)
        self.rotations: tuple[torch.Tensor, torch.Tensor] | None = None  # (positions, 1, D / 2) for k and q

    def prefill(self, prompts: list[list[int]], group: int = 1) -> torch.Tensor:
        """Run the prompts (the batch's ``B`` rows, in groups of ``group`` identical ones) through the model
        into the buffers, and return the last position's logits (B, V) in float32.

        Only one prompt per group is computed and only its real tokens: the projections, norms and MLP
        multiply the ``N`` tokens of the distinct prompts, packed as one (N, H) matrix, instead of a
        left-padded (B, width, H) batch, and attention runs per prompt (the padded (prompts, heads, width,
        width) layout, as a padded forward does) with the keys rotated straight into their columns. In the
        last layer only each prompt's last token goes on through the output projection and the MLP: the
        other tokens' keys and values are all the decode needs of them. Same logits bitwise on this
        project's CPU (a product's rows do not depend on the others; attention still runs for every query,
        whose single-row form rounds differently); 1.10x faster for 32 prompts of 150-250 tokens on the small model."""
        unique = prompts[::group]
        device, dtype = self.keys.device, self.keys.dtype
        width = self.length
        lengths = torch.tensor([len(p) for p in unique], device=device)
        if int(lengths.max()) > width:
            raise ValueError(f"a prompt of {int(lengths.max())} tokens does not fit {width} columns")
        tokens = torch.tensor([t for p in unique for t in p], device=device)
        prompt = torch.repeat_interleave(torch.arange(len(unique), device=device), lengths)  # (N,)
        ends = lengths.cumsum(0)
        position = torch.arange(len(tokens), device=device) - (ends - lengths)[prompt]
        column = width - lengths[prompt] + position
        hidden = self.model.model.embed_tokens(tokens)  # (N, H)
        rotation, rotation_q = self._rotations(position, width, hidden.dtype)  # (N, 1, D / 2)
        columns = torch.arange(width, device=device)
        first = (width - lengths)[:, None, None, None]  # (P, 1, 1, 1): each prompt's first column
        # causal within the prompt; a padding column's query sees itself only (its output is never read)
        allowed = (columns[None, :] <= columns[:, None]) & ((columns[None, :] >= first) | torch.eye(
            width, dtype=torch.bool, device=device))  # (P, 1, width, width)
        padded = (len(unique), width, self.heads, self.head_dim)
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for i, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, self.eps, self.norm_constants)
            qkv = layer.qkv(x)
            q = hidden.new_zeros(padded, dtype=dtype)
            keys = hidden.new_zeros((*padded[:2], self.kv_heads, self.head_dim), dtype=dtype)
            values = torch.zeros_like(keys)
            q[prompt, column] = _rotate(qkv[:, :q_size].unflatten(-1, (self.heads, self.head_dim)), rotation_q,
                                        dtype=dtype)
            keys[prompt, column] = _rotate(qkv[:, q_size : q_size + kv_size].unflatten(
                -1, (self.kv_heads, self.head_dim)), rotation, dtype=dtype)
            values[prompt, column] = qkv[:, q_size + kv_size :].unflatten(-1, (self.kv_heads, self.head_dim)).to(dtype)
            keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # (P, kv_heads, width, D)
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=allowed, scale=1.0,
                                                  enable_gqa=self.heads != self.kv_heads)
            # each prompt's keys / values to every row of its group, without a repeated copy first
            self.keys[i, :, :, :width].unflatten(0, (-1, group)).copy_(keys[:, None])
            self.values[i, :, :, :width].unflatten(0, (-1, group)).copy_(values[:, None])
            if i == len(self.layers) - 1:
                # only each prompt's last token (column width - 1) feeds the logits: the other tokens' output
                # projection and MLP in this layer would be computed and dropped
                hidden, attn = hidden[ends - 1], attn[:, :, width - 1]  # (P, H), (P, heads, D)
            else:
                attn = attn.transpose(1, 2)[prompt, column]  # (N, heads, D)
            hidden = self._feed_forward(layer, hidden + layer.o(attn.reshape(len(hidden), q_size).to(hidden.dtype)))
        logits = self._logits(hidden)
        return logits.repeat_interleave(group, 0) if group > 1 else logits

    def select(self, keep: torch.Tensor) -> None:
        """Keep only the batch rows ``keep`` (indices into the current batch)."""
        self.keys = self.keys.index_select(1, keep)
        self.values = self.values.index_select(1, keep)
        self.bias = self.bias.index_select(0, keep)
        self.start = self.start.index_select(0, keep)

    def insert(self, rows: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
               mask: torch.Tensor) -> None:
        """Start new sequences in batch ``rows``: their prefilled keys / values (per layer (k, kv_heads, w,
        head_dim), left-padded as ``mask`` (k, w) says) are written to end at the current column, and
        every column before them is masked, so a row's old sequence is invisible to the new one. Rotary
        attention depends only on positions, never on columns, so the new sequence decodes as if alone."""
        width, t = mask.shape[1], self.length
        if width > t:
            raise ValueError(f"a prompt of {width} tokens does not fit left of column {t}")
        for i in range(len(self.layers)):
            self.keys[i, rows, :, t - width : t] = keys[i][..., self.order]
            self.values[i, rows, :, t - width : t] = values[i]
        low = torch.finfo(self.bias.dtype).min
        bias = torch.zeros((len(rows), self.bias.shape[-1]), dtype=self.bias.dtype, device=self.bias.device)
        bias[:, : t - width] = low
        bias[:, t - width : t].masked_fill_(mask == 0, low)
        self.bias[rows, 0, 0] = bias
        self.start[rows] = t - mask.sum(-1).long()
        self.remaining = self.steps

    def make_room(self, live: torch.Tensor, keep: int) -> None:
        """Make sure the next step has a free column: when the buffers are full, drop the columns left of
        every ``live`` row's first one (keeping at least ``keep`` columns, the room :meth:`insert` needs),
        or grow the buffers when nothing can be dropped."""
        columns = self.keys.shape[3]
        first = int(self.start[live].min()) if bool(live.any()) else self.length
        self.first = min(first, self.length)
        if self.length < columns:
            return
        drop = min(first, self.length - keep)
        if drop <= 0:
            grow = max(1, columns // 2)
            extra = (*self.keys.shape[:3], grow, self.head_dim)
            self.keys = torch.cat([self.keys, self.keys.new_zeros(extra)], 3)
            self.values = torch.cat([self.values, self.values.new_zeros(extra)], 3)
            self.bias = torch.cat([self.bias, self.bias.new_zeros((*self.bias.shape[:3], grow))], 3)
            return
        kept = self.length - drop
        self.keys[:, :, :, :kept] = self.keys[:, :, :, drop : self.length].clone()
        self.values[:, :, :, :kept] = self.values[:, :, :, drop : self.length].clone()
        self.bias[..., : columns - drop] = self.bias[..., drop:].clone()
        self.bias[..., columns - drop :] = 0
        self.start = (self.start - drop).clamp_(min=0)
        self.first -= drop
        self.length = kept

    def _pack(self, rows: int) -> None:
        """Prepare every projection for ``rows`` rows: prepacked (:mod:`tether.rollout.projection`), or plain
        when fewer than ``REPACK_MIN_STEPS`` steps are left to pay for a pack."""
        pack = self.remaining >= REPACK_MIN_STEPS
        for layer in self.layers:
            for projection in layer.projections():
                if not pack:
                    projection.unpack()
                elif not projection.serves(rows):
                    projection.pack(rows)
        self.packed_rows = rows

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) for the next token after feeding ``tokens`` (B,) at ``positions`` (B,)."""
        hidden = self.model.model.embed_tokens(tokens)  # (B, H)
        t, first = self.length, self.first
        rotation, rotation_q = self._rotations(positions, t + 1, hidden.dtype)  # (B, 1, D / 2)
        batch, width = tokens.shape[0], t + 1 - first
        if self.packs and batch != self.packed_rows:
            self._pack(batch)
        self.remaining -= 1
        groups = self.heads // self.kv_heads
        bias = self.bias[..., first : t + 1].expand(batch, self.kv_heads, 1, width).reshape(-1, 1, width)
        q_size, head_counts = self.heads * self.head_dim, (self.heads, self.kv_heads, self.kv_heads)  # q, k, v
        # every layer's new column and attention window as views taken once per step, not once per layer
        key_column, value_column = self.keys[:, :, :, t], self.values[:, :, :, t]  # (layers, B, kv_heads, D)
        # float32 keys are rotated straight into the column's complex view (one view per step)
        complex_keys = _complex_pairs(key_column) if hidden.dtype == key_column.dtype == torch.float32 else None
        key_window = self.keys[:, :, :, first : t + 1].flatten(1, 2).transpose(2, 3)  # (layers, B * kv, D, width)
        value_window = self.values[:, :, :, first : t + 1].flatten(1, 2)  # (layers, B * kv_heads, width, D)
        for i, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, self.eps, self.norm_constants)
            q, k, v = layer.qkv(x).unflatten(-1, (-1, self.head_dim)).split(head_counts, dim=1)
            q = _rotate(q, rotation_q, dtype=self.keys.dtype)
            if complex_keys is None:
                _rotate(k, rotation, out=key_column[i])
            else:
                torch.mul(_complex_pairs(k), rotation, out=complex_keys[i])
            value_column[i] = v
            scores = torch.baddbmm(bias, q.reshape(-1, groups, self.head_dim), key_window[i])
            attn = torch.bmm(scores.softmax(-1), value_window[i])  # (B * kv_heads, groups, D)
            attn = attn.reshape(batch, q_size)
            attn = attn if attn.dtype == hidden.dtype else attn.to(hidden.dtype)
            hidden = self._feed_forward(layer, hidden + layer.o(attn))
        self.length = t + 1
        return self._logits(hidden)

    def _rotations(self, positions: torch.Tensor, bound: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary rotations of ``positions`` (any shape, every one below ``bound``) as complex numbers of
        shape (*positions.shape, 1, D / 2): for keys, and for queries with the attention scale folded in.

        The model's rotary module computes cos and sin element-wise in the position, so it runs once for a
        table of every position below ``bound`` (doubled when a later call needs more) and each step looks
        its rows up: the same values as a call per step, without the module's per-call work (about a
        tenth of a tiny-model step). A rotary type that rescales with the sequence length (``dynamic``,
        ``longrope``) is computed per call."""
        if not self.tabulated:
            return self._rotate_positions(positions, dtype)
        if self.rotations is None or self.rotations[0].shape[0] < bound:
            size = max(bound, 2 * (0 if self.rotations is None else self.rotations[0].shape[0]))
            self.rotations = self._rotate_positions(torch.arange(size, device=positions.device), dtype)
        keys, queries = self.rotations
        return keys[positions], queries[positions]

    def _rotate_positions(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` (any shape) through the model's rotary module: (*shape, 1, D / 2) for keys and queries."""
        probe = torch.empty((), dtype=dtype, device=positions.device)
        cos, sin = self.model.model.rotary_emb(probe, positions.reshape(1, -1))  # (1, n, D)
        half = self.head_dim // 2
        rotation = torch.complex(cos[0, :, :half].float(), sin[0, :, :half].float())
        rotation = rotation.reshape(*positions.shape, 1, half)
        return rotation, rotation * self.scale

    def _feed_forward(self, layer: _Layer, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's second half: ``hidden + down(silu(gate) * up)`` of the post-attention RMSNorm."""
        x = rms_norm(hidden, layer.post_norm, self.eps, self.norm_constants)
        gate, up = layer.gate_up(x).chunk(2, dim=-1)
        return hidden + layer.down(F.silu(gate).mul_(up))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the final RMSNorm of ``hidden`` (rows, H)."""
        return self.model.lm_head(rms_norm(hidden, self.final_norm, self.eps, self.norm_constants)).float()
