"""The packed KV cache (SPEC §2) as a transformers ``Cache``.

Per full-attention layer and sequence: ``[ sink | quantized blocks, append-only | residual ]``.
New tokens enter the residual; whenever it holds ``residual`` tokens, its oldest ``group`` tokens
are encoded once into a block. Blocks are never re-encoded.

The layer needs two things only the attention call knows: the post-RoPE queries (for methods
that select channels at prefill) and the attention mask (padding never enters statistics). So
``update`` stages the new tokens and the attention function registered by ``kvmix.runtime.attention``
calls ``commit`` right after attending; the flush happens there.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from typing import Any

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    get_layer_types_and_kwargs,
)

from kvmix.methods import Blocks, Method, ModelSpec, parse_method
from kvmix.core.tree import combine, map_tensors, tensor_bytes

QUANTIZED_LAYER_TYPES = ("full_attention",)


class _Handoff(threading.local):
    """The layer whose ``update`` ran and whose attention has not committed yet."""

    layer: KVMixLayer | None = None


_HANDOFF = _Handoff()


def take_pending() -> KVMixLayer | None:
    layer, _HANDOFF.layer = _HANDOFF.layer, None
    return layer


def model_spec(config: Any, pairs: torch.Tensor | None = None,
               kv_norms: torch.Tensor | None = None, folded: str | None = None) -> ModelSpec:
    """The attention layout of a transformers config; a clear error when it is not there."""
    config = config.get_text_config(decoder=True)
    missing = [a for a in ("num_hidden_layers", "num_attention_heads") if not hasattr(config, a)]
    if missing:
        raise ValueError(
            f"model config {type(config).__name__} lacks {missing}: kvmix needs a decoder with "
            "multi-head attention (num_hidden_layers, num_attention_heads, num_key_value_heads)"
        )
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of "
                         f"num_key_value_heads={kv_heads}")
    name = getattr(config, "_name_or_path", "") or ""
    return ModelSpec(config.num_hidden_layers, heads, kv_heads, head_dim, pairs, kv_norms, name,
                     folded)


class KVMixLayer(CacheLayerMixin):
    """One full-attention layer's packed cache."""

    is_sliding = False
    is_compileable = False
    # A crop that ends inside a block keeps that block's codes: not a trace-free rollback.
    is_croppable = False

    def __init__(self, method: Method, layer_idx: int):
        super().__init__()
        self.method = method
        self.layer_idx = layer_idx
        self._clear()

    def _clear(self) -> None:
        self.sink_keys = self.sink_values = None  # [B, H, s, D]
        self.res_keys = self.res_values = None  # [B, H, r, D]
        self.blocks: Blocks | None = None  # every tensor [B, n_blocks, ...]
        self.lengths: list[int] = []  # tokens held per block (< group only after a crop)
        self.selection: Any = None
        self.prefilled = False
        self.is_initialized = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        empty = key_states[..., :0, :]
        self.sink_keys = self.res_keys = empty
        self.sink_values = self.res_values = value_states[..., :0, :]
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    # -- the transformers contract ---------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: [B, H, q, D] -> all keys, values: [B, H, T, D]."""
        if _HANDOFF.layer is not None:
            _HANDOFF.layer = None
            raise RuntimeError(
                "a kvmix cache layer was updated but its attention never committed: the model "
                "must use attn_implementation='kvmix' (kvmix.make_cache sets it)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        key_states = self.method.transform_keys(key_states, self.layer_idx)
        self.res_keys = torch.cat([self.res_keys, key_states], dim=-2)
        self.res_values = torch.cat([self.res_values, value_states], dim=-2)
        _HANDOFF.layer = self
        return self.materialize()

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.sink_keys.shape[-2] + sum(self.lengths) + self.res_keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers' negative convention)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop(tokens_to_remove={tokens_to_remove}): pass a negative "
                             "number of tokens to remove")
        if tokens_to_remove and self.is_initialized:
            self.truncate(max(self.get_seq_length() + tokens_to_remove, 0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def offload(self) -> None:
        self._map_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        self._map_batch(lambda t: t.to(self.device, non_blocking=True))

    # -- kvmix ---------------------------------------------------------------------------

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference attention path: every held token, blocks decoded (never re-encoded)."""
        keys, values = self.decode_blocks()
        keys = torch.cat([self.sink_keys, keys, self.res_keys], dim=-2)
        values = torch.cat([self.sink_values, values, self.res_values], dim=-2)
        return keys, values

    def decode_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All blocks in one decode call -> keys, values: [B, H, sum(lengths), D]."""
        if self.blocks is None:
            return self.sink_keys[..., :0, :], self.sink_values[..., :0, :]
        keys, values = self.method.decode(self.blocks, self.layer_idx, self.selection, self.dtype)
        keys, values = (x.transpose(1, 2).flatten(2, 3) for x in (keys, values))  # [B, H, n*G, D]
        if sum(self.lengths) < len(self.lengths) * self.method.group:  # a crop ended in a block
            held = self._held_positions()
            keys, values = keys.index_select(2, held), values.index_select(2, held)
        return keys, values

    def commit(self, queries: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """After attention: select channels once at prefill, then fill the sink and flush.

        queries: [B, Hq, q, D] post-RoPE; attention_mask: [B, 1, q, T] or None (no padding).
        """
        valid = _valid_positions(attention_mask, self.get_seq_length())  # [B, T] or None
        if not self.prefilled:
            keys = torch.cat([self.sink_keys, self.res_keys], dim=-2)
            self.selection = self.method.select(queries, keys, valid, self.layer_idx)
            self.prefilled = True
        else:
            new_keys = self.res_keys[..., -queries.shape[-2]:, :]
            self.selection = self.method.observe(self.selection, queries, new_keys, valid,
                                                 self.layer_idx)
        self._fill_sink()
        fresh = []  # a long prompt flushes many blocks: stack them onto the history once
        while self.res_keys.shape[-2] >= self.method.residual:
            fresh.append(self._encode_oldest(valid))
        if fresh:
            self._append(fresh)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens of every segment, in order."""
        s = min(length, self.sink_keys.shape[-2])
        self.sink_keys, self.sink_values = _head(self.sink_keys, self.sink_values, s)
        left = length - s
        lengths = []
        for held in self.lengths:
            if left <= 0:
                break
            lengths.append(min(held, left))
            left -= lengths[-1]
        self.lengths = lengths
        n = len(lengths)
        self.blocks = map_tensors(self.blocks, lambda t: t[:, :n]) if n else None
        self.res_keys, self.res_values = _head(self.res_keys, self.res_values, left)

    def nbytes_breakdown(self) -> Counter:
        """Bytes actually held, by kind: codes, scales, zeros, masks, sink, residual, full."""
        if not self.is_initialized:
            return Counter()
        held = tensor_bytes([self.sink_keys, self.sink_values], "sink")
        held += tensor_bytes([self.res_keys, self.res_values], "residual")
        held += tensor_bytes(self.blocks, "full")
        return held + tensor_bytes(self.selection, "masks")

    def theoretical_nbytes(self, spec: ModelSpec) -> float:
        """Bytes from the method's bit formula for the tokens this layer holds."""
        if not self.is_initialized:
            return 0.0
        batch, heads, _, dim = self.res_keys.shape
        exact = self.sink_keys.shape[-2] + self.res_keys.shape[-2]
        elements = batch * heads * dim
        key_bits, value_bits = self.method.bits(self.layer_idx, self.dtype)
        quantized = len(self.lengths) * self.method.group * (key_bits + value_bits) / 8
        selected = batch * self.method.selection_bits(spec) / 8 if self.prefilled else 0
        return elements * (exact * 2 * self.dtype.itemsize + quantized) + selected

    def _held_positions(self) -> torch.Tensor:
        g = self.method.group
        return torch.cat([torch.arange(i * g, i * g + n, device=self.device)
                          for i, n in enumerate(self.lengths)])

    def _fill_sink(self) -> None:
        # The sink is always the first tokens: it only grows while no block exists.
        room = self.method.sink - self.sink_keys.shape[-2]
        if room <= 0 or self.lengths:
            return
        keys, values = self._pop_residual(room)
        self.sink_keys = torch.cat([self.sink_keys, keys], dim=-2)
        self.sink_values = torch.cat([self.sink_values, values], dim=-2)

    def _encode_oldest(self, valid: torch.Tensor | None) -> Blocks:
        """Encode (once) the oldest ``group`` residual tokens -> a block, tensors [B, 1, ...]."""
        g = self.method.group
        start = self.get_seq_length() - self.res_keys.shape[-2]
        keys, values = self._pop_residual(g)  # [B, H, G, D]
        _check_finite(keys, values, self.layer_idx)
        block_valid = None if valid is None else valid[:, start : start + g]  # [B, G]
        state = self.method.encode(keys, values, block_valid, self.layer_idx, self.selection)
        self.lengths.append(g)
        return map_tensors(Blocks(*state), lambda t: t.unsqueeze(1))

    def _append(self, fresh: list[Blocks]) -> None:
        """Stack new blocks after the held ones along the block axis (no re-encoding)."""
        parts = fresh if self.blocks is None else [self.blocks, *fresh]
        self.blocks = combine(parts, lambda tensors: torch.cat(tensors, dim=1))

    def _pop_residual(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove and return the oldest ``n`` residual tokens: keys, values [B, H, n, D]."""
        popped = _head(self.res_keys, self.res_values, n)
        self.res_keys, self.res_values = self.res_keys[..., n:, :], self.res_values[..., n:, :]
        return popped

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.sink_keys, self.sink_values = fn(self.sink_keys), fn(self.sink_values)
        self.res_keys, self.res_values = fn(self.res_keys), fn(self.res_values)
        self.blocks = map_tensors(self.blocks, fn)
        self.selection = map_tensors(self.selection, fn)


def _head(keys: torch.Tensor, values: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return keys[..., :n, :], values[..., :n, :]


def _valid_positions(mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """[B, 1, q, T] attention mask -> [B, T] bool, True where a token is not padding.

    The last query row may attend to every earlier non-padding token, so it marks exactly them.
    """
    if mask is None:
        return None
    row = mask[:, 0, -1, :length]
    return row if row.dtype == torch.bool else row == 0


def _check_finite(keys: torch.Tensor, values: torch.Tensor, layer: int) -> None:
    for name, x in (("keys", keys), ("values", values)):
        if not torch.isfinite(x).all():
            raise ValueError(f"non-finite {name} in layer {layer}: kvmix quantizes finite "
                             "values only (check the model's dtype and inputs)")


class KVMixCache(Cache):
    """A transformers Cache whose full-attention layers are packed by one kvmix method."""

    def __init__(self, method: Method | str, config: Any, pairs: torch.Tensor | None = None,
                 kv_norms: torch.Tensor | None = None, folded: str | None = None):
        self.method = parse_method(method)
        self.spec = model_spec(config, pairs, kv_norms, folded)
        self.method.bind(self.spec)
        text_config = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
        layers = [
            KVMixLayer(self.method, i) if kind in QUANTIZED_LAYER_TYPES
            else DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs)
            for i, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True))
        ]
        other = sorted({k for k in layer_types if k not in QUANTIZED_LAYER_TYPES})
        if other:
            warnings.warn(f"kvmix quantizes full-attention layers only; layers of kind {other} "
                          "keep their ordinary full-precision cache", stacklevel=2)
        _HANDOFF.layer = None
        super().__init__(layers=layers)

    @property
    def packed_layers(self) -> list[KVMixLayer]:
        return [layer for layer in self.layers if isinstance(layer, KVMixLayer)]

    def nbytes_breakdown(self) -> dict[str, int]:
        total = Counter()
        for layer in self.layers:
            if isinstance(layer, KVMixLayer):
                total += layer.nbytes_breakdown()
            elif getattr(layer, "keys", None) is not None:
                total += tensor_bytes([layer.keys, layer.values], "other_layers")
        return dict(total)

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds."""
        return sum(self.nbytes_breakdown().values())

    def theoretical_nbytes(self) -> float:
        """Bytes the method's bit formula predicts for the tokens held (packed layers only)."""
        return sum(layer.theoretical_nbytes(self.spec) for layer in self.packed_layers)

    def bits(self) -> tuple[float, float]:
        """Key and value bits per element of a stored block, averaged over packed layers."""
        bits = [self.method.bits(layer.layer_idx, layer.dtype) for layer in self.packed_layers
                if layer.is_initialized]
        if not bits:
            return 0.0, 0.0
        return sum(k for k, _ in bits) / len(bits), sum(v for _, v in bits) / len(bits)

    def fp16_nbytes(self) -> int:
        """Bytes the same tokens would take as 16-bit keys and values (the papers' baseline)."""
        return sum(
            2 * 2 * layer.get_seq_length() * self.spec.n_kv_heads * self.spec.head_dim
            * layer.res_keys.shape[0]
            for layer in self.packed_layers if layer.is_initialized
        )
