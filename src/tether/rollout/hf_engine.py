"""A KV-cached sampler for any Hugging Face causal LM: the CPU / small-model rollout engine.

``HFEngine`` wraps the live model object (no copy), so after an optimizer step the next
``generate`` already samples from the new weights. It is a hand-written batched decode loop rather
than ``model.generate``:

1. prompts (each repeated ``n`` times, samples of one prompt contiguous) are left-padded into
   one batch; the attention mask for prompt + every new token is allocated once and sliced;
2. one prefill forward computes the KV cache and only the last position's logits
   (``logits_to_keep=1``); when a chunk holds whole groups of ``n`` samples the prefill runs on
   the distinct prompts and the cache is repeated ``n`` times. For models the static decoder
   reproduces (:mod:`tether.rollout.static_decoder`), its own prefill replaces the forward: the
   distinct prompts' real tokens only, packed into one matrix (no padding rows through the
   projections), written straight into its buffers;
3. one forward per new token with the cache (the model's ``DynamicCache``; for long decodes its
   layers write in place into buffers allocated once, see :class:`PreallocatedLayer`); sampling
   applies temperature, top-k then top-p, with a seeded ``torch.Generator`` when ``params.seed`` is set;
4. a row stops on EOS or on a stop string; finished rows are fed pad and ignored, and once at
   most three quarters of the batch is still running the finished rows are dropped from the batch
   and the cache (``batch_select_indices``); the loop ends when every row is done.

``dtype`` (``rollout.engine_options: {dtype: bfloat16}``) samples from a copy of the model in that
precision, its weights copied from the live model before every ``generate``: the sampler then differs
from the float32 trainer the way a bf16 inference engine does (the ``mismatch-study`` recipe).

Departures from ``model.generate``: no repetition penalty, beam search or other logits processors;
log-probs follow the definition in :mod:`tether.rollout.base` (``log_softmax(logits / T)`` of the
sampled token, top-k / top-p truncation not reflected). Stop strings are matched on decoded text
(special tokens skipped) and the returned text is cut right after the stop string, while the
token ids keep every sampled token.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch

from tether.models.linear import onednn_linears
from tether.rollout import continuous, static_decoder
from tether.rollout.base import Rollout, SamplingParams, sample_tokens
from tether.rollout.static_decoder import COMPACT_FRACTION, COMPACT_MIN_BATCH

try:  # transformers >= 4.56 stores the cache as a list of layer objects
    from transformers.cache_utils import DynamicLayer
except ImportError:  # pragma: no cover - older transformers: the plain DynamicCache is used as is
    DynamicLayer = None

# Write new keys / values in place into buffers sized for the whole decode (PreallocatedLayer) when at least
# this many new tokens are asked for. Measured per decode step on the tiny model, batch 64, 40-token prompts:
# 2-8% slower at 32-64 new tokens (attention reads strided views), 10% faster at 128, 13% at 256.
PREALLOCATE_MIN_NEW_TOKENS = 128


if DynamicLayer is not None:

    class PreallocatedLayer(DynamicLayer):
        """A ``DynamicLayer`` whose keys / values are views into buffers allocated once per decode.

        ``DynamicLayer.update`` concatenates, reallocating and copying the whole cache every step;
        here each step writes one position in place and the layer exposes ``buffer[:, :, :length]``,
        so attention still sees exactly the filled positions (same mask sizes, same numbers). If
        something replaces ``keys`` behind its back (``crop`` keeps the view; anything else does not),
        the next ``update`` re-allocates from the current keys.
        """

        def __init__(self, source: Any, capacity: int) -> None:
            super().__init__()
            self.device = source.device
            self.is_initialized = True
            self.capacity = capacity
            self.keys, self.values = source.keys, source.values
            self._reallocate(self.keys.shape[-2])

        def _reallocate(self, needed: int) -> None:
            length = self.keys.shape[-2]
            self.capacity = max(self.capacity, needed)
            self._k = self.keys.new_empty((*self.keys.shape[:2], self.capacity, self.keys.shape[-1]))
            self._v = self.values.new_empty((*self.values.shape[:2], self.capacity, self.values.shape[-1]))
            self._k[:, :, :length].copy_(self.keys)
            self._v[:, :, :length].copy_(self.values)
            self._view(length)

        def _view(self, length: int) -> None:
            self.keys, self.values = self._k[:, :, :length], self._v[:, :, :length]

        def _ensure(self, needed: int) -> None:
            """Re-allocate if ``keys`` no longer views the buffers (or they are too small)."""
            if (
                self.keys.data_ptr() != self._k.data_ptr()
                or self.values.data_ptr() != self._v.data_ptr()
                or self.keys.shape[0] != self._k.shape[0]
                or needed > self.capacity
            ):
                self._reallocate(needed)

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            start = self.keys.shape[-2]
            end = start + key_states.shape[-2]
            self._ensure(end)
            self._k[:, :, start:end].copy_(key_states)
            self._v[:, :, start:end].copy_(value_states)
            self._view(end)
            return self.keys, self.values

        def batch_repeat_interleave(self, repeats: int) -> None:
            length = self.keys.shape[-2]
            self._ensure(length)
            self._k = self._k.repeat_interleave(repeats, dim=0)
            self._v = self._v.repeat_interleave(repeats, dim=0)
            self._view(length)

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            length = self.keys.shape[-2]
            self._ensure(length)
            self._k, self._v = self._k[indices], self._v[indices]
            self._view(length)


def preallocate_cache(cache: Any, extra_tokens: int) -> int:
    """Swap every plain ``DynamicLayer`` of ``cache`` for a :class:`PreallocatedLayer` with room for
    ``extra_tokens`` more positions; other layer kinds (sliding window, recurrent) are left alone.
    Returns how many layers were swapped (0 for caches without a ``layers`` list)."""
    layers = getattr(cache, "layers", None)
    if DynamicLayer is None or not isinstance(layers, list):
        return 0
    swapped = 0
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel() > 0:
            layers[i] = PreallocatedLayer(layer, layer.keys.shape[-2] + extra_tokens)
            swapped += 1
    return swapped


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """EOS ids from the generation config (may be a list), falling back to the tokenizer."""
    ids: list[int] = []
    gen_cfg = getattr(model, "generation_config", None)
    for source in (getattr(gen_cfg, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        for i in [source] if isinstance(source, int) else list(source):
            if int(i) not in ids:
                ids.append(int(i))
    return ids


def _forward_params(model: Any) -> dict[str, inspect.Parameter]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return dict(inspect.signature(base.forward).parameters)


class HFEngine:
    """Token-in, token-out generation with a Hugging Face causal LM (see the module docstring).

    ``batch_size`` caps how many samples (prompts x n) are decoded together; ``None`` decodes
    all of one call in a single batch. ``on_batch(done)``, if given, is called after each batch with
    the number of samples of the current call decoded so far (progress reporting; no effect on results).
    """

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int | None = None, static: bool = True,
                 dtype: str | None = None, continuous: bool = False,
                 on_batch: Callable[[int], None] | None = None) -> None:
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        self.source = model
        if dtype is not None:
            if dtype not in ("bfloat16", "float16", "float32"):
                raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}")
            target = getattr(torch, dtype)
            if target != next(model.parameters()).dtype:  # else the live model samples
                model = copy.deepcopy(model).to(target)
                model.requires_grad_(False)
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.static = static
        self.continuous = continuous
        self.on_batch = on_batch
        self.eos_ids = _eos_ids(model, tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id: int = int(pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0))
        params = _forward_params(model)
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._logits_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        self._pass_position_ids = "position_ids" in params
        self._stop_token_filter: dict[tuple[str, ...], torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Copy the live model's weights into the lower-precision sampling copy (rounded to its dtype)."""
        source = dict(self.source.named_parameters())
        source.update(self.source.named_buffers())
        for name, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]:
            if name in source:
                tensor.copy_(source[name])

    # -- public API ---------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        """Sample ``params.n`` completions for each prompt (lists of token ids)."""
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        prompts = [[int(x) for x in p] for p in prompts]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if self.model is not self.source:
            self.sync_weights()
        rows = [i for i in range(len(prompts)) for _ in range(params.n)]
        chunk = self.batch_size or len(rows)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        # eval mode (no dropout) while sampling, then each module's own mode back, exactly as it was
        modes = [(module, module.training) for module in self.model.modules()]
        self.model.eval()
        completions: list[tuple[list[int], list[float], bool]] = []
        try:
            with torch.inference_mode():
                if self._continuous(prompts, rows, chunk, params):
                    completions = continuous.generate(self, prompts, rows, params, generator, chunk)
                else:
                    for start in range(0, len(rows), chunk):
                        chunk_rows = rows[start : start + chunk]
                        group = params.n if start % params.n == 0 and len(chunk_rows) % params.n == 0 else 1
                        batch = [prompts[r] for r in chunk_rows]
                        completions.extend(self._generate_batch(batch, params, generator, group))
                        if self.on_batch is not None:
                            self.on_batch(len(completions))
        finally:
            for module, training in modes:
                module.training = training
        return self._to_rollout(prompts, rows, completions, params)

    # -- one batch ----------------------------------------------------------------------------

    def _continuous(self, prompts: list[list[int]], rows: list[int], chunk: int, params: SamplingParams) -> bool:
        """Whether this call decodes with continuous batching (:mod:`tether.rollout.continuous`): asked for,
        more samples than one batch holds, and the static decode path available."""
        width = max(len(p) for p in prompts)
        return (self.continuous and len(rows) > chunk and self.static
                and static_decoder.supports(self.model, width + params.max_new_tokens))

    def _static(self, total_length: int, cache: Any) -> bool:
        """Whether the decode steps can run on :class:`static_decoder.StaticDecoder`."""
        return (self.static and static_decoder.supports(self.model, total_length)
                and isinstance(getattr(cache, "layers", None), list))

    def _forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, cache: Any
    ) -> tuple[torch.Tensor, Any]:
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": mask, "use_cache": True}
        if self._pass_position_ids:
            kwargs["position_ids"] = position_ids
        if cache is not None:
            kwargs[self._cache_kw] = cache
        if self._logits_kw is not None:
            kwargs[self._logits_kw] = 1
        with onednn_linears(self.model):
            out = self.model(**kwargs)
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = out.past_key_values
        return out.logits[:, -1, :].float(), new_cache

    def _prefill(
        self, prompts: list[list[int]], new_tokens: int, group: int, width: int = 0, lean: bool = False
    ) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]:
        """Left-pad (to at least ``width``) and run the prompts through the model.

        ``prompts`` holds ``B`` rows in groups of ``group`` identical prompts; only one per group is
        run and the cache is repeated. Returns the last position's logits (B, V), the cache, the
        attention mask (B, width + new_tokens) for every step to come, and the next position (B, 1).
        With ``lean`` and a model the static decoder reproduces, the "cache" returned is a
        :class:`~static_decoder.StaticDecoder` filled by its own prefill, which skips the padding.
        """
        device = self.device
        unique = prompts[::group]
        width = max(width, *(len(p) for p in unique))
        lens = torch.tensor([len(p) for p in unique], dtype=torch.long)
        mask = torch.ones((len(unique), width + new_tokens), dtype=torch.long)
        mask[:, :width] = (torch.arange(width)[None, :] >= (width - lens)[:, None]).long()
        mask, lens = mask.to(device), lens.to(device)
        if lean and self.static and static_decoder.supports(self.model, width + new_tokens):
            mask, lens = mask.repeat_interleave(group, dim=0), lens.repeat_interleave(group, dim=0)
            decoder = static_decoder.StaticDecoder(self.model, None, mask[:, :width], new_tokens)
            with onednn_linears(self.model):
                logits = decoder.prefill(prompts, group)
            return logits, decoder, mask, lens[:, None].clone()
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in unique], dtype=torch.long).to(device)
        position_ids = (mask[:, :width].cumsum(-1) - 1).clamp_(min=0)
        logits, cache = self._forward(ids, mask[:, :width], position_ids, None)
        if new_tokens >= PREALLOCATE_MIN_NEW_TOKENS and not self._static(width + new_tokens, cache):
            preallocate_cache(cache, new_tokens)
        if group > 1:
            if hasattr(cache, "batch_repeat_interleave"):
                cache.batch_repeat_interleave(group)
                logits = logits.repeat_interleave(group, dim=0)
            else:  # a legacy tuple cache: prefill every sample instead
                return self._prefill(prompts, new_tokens, 1, width)
            mask = mask.repeat_interleave(group, dim=0)
            lens = lens.repeat_interleave(group, dim=0)
        return logits, cache, mask, lens[:, None].clone()

    def _generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | None, group: int
    ) -> list[tuple[list[int], list[float], bool]]:
        """Decode one batch; return per row (completion ids, logprobs, stopped)."""
        steps = params.max_new_tokens
        logits, cache, mask, position = self._prefill(prompts, steps, group, lean=True)
        device, batch = logits.device, logits.shape[0]
        width = mask.shape[1] - steps
        out = continuous.Outputs(self, batch, steps, device, params, logits.shape[-1])
        rows = torch.arange(batch, device=device)  # batch position -> output row
        done = torch.zeros(batch, dtype=torch.bool, device=device)  # per current batch position
        decoder = None
        if isinstance(cache, static_decoder.StaticDecoder):
            decoder, cache = cache, None
        elif self._static(mask.shape[1], cache):
            decoder = static_decoder.StaticDecoder(self.model, cache, mask[:, :width], steps)
            cache = None
        for t in range(steps):
            tok, lp = sample_tokens(logits, params, generator)
            tok.masked_fill_(done, self.pad_id)
            finished = out.accept(rows, t, tok, lp, done)
            if bool(finished.any()):
                done |= finished
                running = int((~done).sum())
                if running == 0:
                    break
                if (
                    t + 1 < steps
                    and len(rows) >= COMPACT_MIN_BATCH
                    and running <= COMPACT_FRACTION * len(rows)
                    and (decoder is not None or hasattr(cache, "batch_select_indices"))
                ):
                    keep = (~done).nonzero().squeeze(-1)
                    if decoder is not None:
                        decoder.select(keep)
                    else:
                        cache.batch_select_indices(keep)
                    rows, done, tok = rows[keep], done[keep], tok[keep]
                    mask, position = mask[keep], position[keep]
            if t + 1 == steps:
                break
            if decoder is not None:
                logits = decoder.step(tok, position[:, 0])
            else:
                logits, cache = self._forward(tok[:, None], mask[:, : width + t + 1], position, cache)
            position += 1
        return self._unpack(out.tokens, out.logprobs, out.lengths, out.stopped)

    @staticmethod
    def _unpack(
        tokens: torch.Tensor, logprobs: torch.Tensor, lengths: torch.Tensor, stopped: torch.Tensor
    ) -> list[tuple[list[int], list[float], bool]]:
        token_lists, lp_lists = tokens.tolist(), logprobs.tolist()
        return [
            (ids[:n], lps[:n], s)
            for ids, lps, n, s in zip(token_lists, lp_lists, lengths.tolist(), stopped.tolist(), strict=True)
        ]

    # -- stop strings -------------------------------------------------------------------------

    def _stop_filter(self, stop: list[str], vocab: int, device: torch.device) -> torch.Tensor:
        """Bool (V,): which tokens can complete a stop string, so only those rows are decoded.

        A match first appears on the step whose token holds the stop string's last character.
        Tokens that decode to a broken character (partial UTF-8) are kept as candidates, and a stop
        string ending in whitespace disables the filter (tokenizers may drop a token's leading space
        when it is decoded alone).
        """
        key = tuple(stop)
        if key not in self._stop_token_filter:
            if any(s[-1].isspace() for s in stop):
                flags = [True] * vocab
            else:
                last = {s[-1] for s in stop}
                # ids past the tokenizer (padded embedding rows) decode to "" and can never match
                known = min(vocab, len(self.tokenizer))
                decoded = self.tokenizer.batch_decode([[v] for v in range(known)], skip_special_tokens=True)
                flags = [("\ufffd" in text) or any(c in text for c in last) for text in decoded]
                flags += [False] * (vocab - known)
            self._stop_token_filter[key] = torch.tensor(flags, dtype=torch.bool)
        return self._stop_token_filter[key].to(device)

    def _match_stop(
        self,
        tokens: torch.Tensor,
        rows: torch.Tensor,
        newest: torch.Tensor,
        tok: torch.Tensor,
        inactive: torch.Tensor,
        stop_filter: torch.Tensor,
        stop: list[str],
    ) -> torch.Tensor:
        """Bool per batch position: the newest token (output column ``newest``, per position) completed a
        stop string."""
        hit = torch.zeros_like(inactive)
        candidates = (stop_filter[tok] & ~inactive).nonzero().squeeze(-1).tolist()
        if not candidates:
            return hit
        window = 4 * max(len(s) for s in stop) + 4  # a character can take up to 4 byte-level tokens
        ends = [int(newest[c]) + 1 for c in candidates]
        tails = [tokens[int(rows[c]), max(0, end - window) : end].tolist() for c, end in zip(candidates, ends, strict=True)]
        for pos, text in zip(
            candidates, self.tokenizer.batch_decode(tails, skip_special_tokens=True), strict=True
        ):
            if any(s in text for s in stop):
                hit[pos] = True
        return hit

    # -- assembling the rollout ---------------------------------------------------------------

    def _to_rollout(
        self,
        prompts: list[list[int]],
        rows: list[int],
        completions: list[tuple[list[int], list[float], bool]],
        params: SamplingParams,
    ) -> Rollout:
        texts = self.tokenizer.batch_decode([c[0] for c in completions], skip_special_tokens=True)
        eos = set(self.eos_ids)
        reasons: list[str] = []
        for i, (ids, _, stopped) in enumerate(completions):
            reasons.append("stop" if stopped else "length")
            if stopped and params.stop and not (ids and ids[-1] in eos):
                texts[i] = _cut_after_stop(texts[i], params.stop)
        return Rollout(
            prompt_ids=[list(prompts[r]) for r in rows],
            completion_ids=[c[0] for c in completions],
            completion_logprobs=[c[1] for c in completions],
            finish_reasons=reasons,
            prompt_index=rows,
            texts=texts,
        )


def _cut_after_stop(text: str, stop: list[str]) -> str:
    """Cut ``text`` right after the earliest-ending occurrence of any stop string."""
    ends = [text.find(s) + len(s) for s in stop if s in text]
    return text[: min(ends)] if ends else text
