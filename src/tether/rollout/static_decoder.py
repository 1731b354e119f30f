"""A lean decode step with a static KV cache for Llama-architecture models (Llama, Qwen2, Mistral).

Per new token, a Hugging Face forward spends most of its time in Python on a small model: module
hooks and wrappers, cache objects that grow by concatenation, mask construction. This module runs
the same arithmetic as ``LlamaDecoderLayer`` with the live model's own parameters and rotary
module, over key / value buffers allocated once for the whole decode:

- q, k and v come from one matmul with the three projection weights concatenated, and gate and up
  from one matmul likewise (weights gathered once per ``generate`` call, so the decoder always
  uses the current weights);
- RMSNorm is ``torch.nn.functional.rms_norm``; attention is ``scaled_dot_product_attention`` over
  the filled prefix of the buffers with one additive padding mask built once;
- each step writes one column of the buffers in place; dropping finished rows is one index select.

Only the decode steps run here; the prompt's prefill is an ordinary model forward, whose cache is
copied into the buffers. :func:`supports` decides whether a model qualifies (plain Llama-style
modules, no adapters, no sliding window, no biases beyond q/k/v); anything else keeps the generic
path. Tests check that greedy decoding gives the same tokens and logits as the generic path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_TYPES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


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
    return type(model.lm_head) is torch.nn.Linear


@dataclass
class _Layer:
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    gate_up_weight: torch.Tensor
    down_weight: torch.Tensor
    input_norm: torch.Tensor
    post_norm: torch.Tensor


def _gather_layers(model: Any) -> list[_Layer]:
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        layers.append(_Layer(
            qkv_weight=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
            qkv_bias=torch.cat(biases) if all(b is not None for b in biases) else None,
            o_weight=attn.o_proj.weight,
            gate_up_weight=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
            down_weight=mlp.down_proj.weight,
            input_norm=layer.input_layernorm.weight,
            post_norm=layer.post_attention_layernorm.weight,
        ))
    return layers


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One query per row: softmax(q k^T * scale + bias) v with plain batched matmuls, (B, heads, D).

    For a single query the fused SDPA kernels cost more than the two small matmuls (measured ~1.3x
    on the tiny models, 1 thread). Query heads are grouped over their key-value head (GQA).
    """
    batch, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    q = q.reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale).add_(bias)
    return torch.matmul(scores.softmax(-1), values).reshape(batch, heads, dim)


class StaticDecoder:
    """Decode steps for one batch: buffers of shape (layers, B, kv_heads, width + steps, head_dim).

    ``cache`` is the model's cache after the prefill (keys already rotated), ``mask`` the (B, width)
    0/1 padding mask of the prompt, ``steps`` how many tokens will be decoded at most.
    """

    def __init__(self, model: Any, cache: Any, mask: torch.Tensor, steps: int) -> None:
        cfg = model.config
        self.model = model
        self.layers = _gather_layers(model)
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.final_norm = model.model.norm.weight
        batch, width = mask.shape
        first = cache.layers[0].keys
        shape = (len(self.layers), batch, self.kv_heads, width + steps, self.head_dim)
        self.keys = first.new_empty(shape)
        self.values = first.new_empty(shape)
        for i, layer in enumerate(cache.layers):
            self.keys[i, :, :, :width].copy_(layer.keys)
            self.values[i, :, :, :width].copy_(layer.values)
        self.length = width
        bias = torch.zeros((batch, 1, 1, width + steps), dtype=first.dtype, device=first.device)
        bias[:, 0, 0, :width].masked_fill_(mask == 0, torch.finfo(first.dtype).min)
        self.bias = bias

    def select(self, keep: torch.Tensor) -> None:
        """Keep only the batch rows ``keep`` (indices into the current batch)."""
        self.keys = self.keys.index_select(1, keep)
        self.values = self.values.index_select(1, keep)
        self.bias = self.bias.index_select(0, keep)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) for the next token after feeding ``tokens`` (B,) at ``positions`` (B,)."""
        hidden = self.model.model.embed_tokens(tokens)[:, None, :]  # (B, 1, H)
        cos, sin = self.model.model.rotary_emb(hidden, positions[:, None])
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, 1, D)
        t = self.length
        bias = self.bias[..., : t + 1]
        batch = tokens.shape[0]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for i, layer in enumerate(self.layers):
            x = F.rms_norm(hidden, (hidden.shape[-1],), layer.input_norm, self.eps)
            qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias)
            q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
            q = q.view(batch, 1, self.heads, self.head_dim).transpose(1, 2)
            k = k.view(batch, 1, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            self.keys[i, :, :, t : t + 1] = k * cos + _rotate_half(k) * sin
            self.values[i, :, :, t : t + 1] = v.view(batch, 1, self.kv_heads, self.head_dim).transpose(1, 2)
            attn = _decode_attention(q, self.keys[i, :, :, : t + 1], self.values[i, :, :, : t + 1], bias, self.scale)
            hidden = hidden + F.linear(attn.reshape(batch, 1, q_size), layer.o_weight)
            x = F.rms_norm(hidden, (hidden.shape[-1],), layer.post_norm, self.eps)
            gate, up = F.linear(x, layer.gate_up_weight).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, layer.down_weight)
        self.length = t + 1
        hidden = F.rms_norm(hidden[:, 0], (hidden.shape[-1],), self.final_norm, self.eps)
        return self.model.lm_head(hidden).float()
