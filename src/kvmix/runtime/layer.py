"""A full-attention layer's packed cache under transformers' ``CacheLayerMixin`` contract.

The layer adapts a ``SegmentStore`` to what transformers calls. It needs two things only the
attention call knows: the post-RoPE queries (for methods that select channels at prefill) and
the attention mask (padding never enters statistics). So ``update`` stages the new tokens and
the attention function registered by ``kvmix.runtime.attention`` calls ``commit`` right after
attending; the flush happens there.
"""

from __future__ import annotations

import threading
from collections import Counter

import torch
from transformers.cache_utils import CacheLayerMixin

from kvmix.methods import Method, ModelSpec
from kvmix.runtime.accounting import formula_bytes, held_bytes
from kvmix.runtime.store import SegmentStore


class _Handoff(threading.local):
    """The layer whose ``update`` ran and whose attention has not committed yet."""

    layer: KVMixLayer | None = None


_HANDOFF = _Handoff()


def take_pending() -> KVMixLayer | None:
    layer, _HANDOFF.layer = _HANDOFF.layer, None
    return layer


def clear_pending() -> None:
    _HANDOFF.layer = None


class KVMixLayer(CacheLayerMixin):
    """One full-attention layer's packed cache: transformers' calls, delegated to its store."""

    is_sliding = False
    is_compileable = False
    # A crop that ends inside a block keeps that block's codes: not a trace-free rollback.
    is_croppable = False

    def __init__(self, method: Method, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.store = SegmentStore(method, layer_idx)

    @property
    def method(self) -> Method:
        return self.store.method

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

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
        self.store.stage(key_states, value_states)
        _HANDOFF.layer = self
        return self.store.materialize()

    def commit(self, queries: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """queries: [B, Hq, q, D] post-RoPE; attention_mask: [B, 1, q, T] or None (no padding)."""
        self.store.commit(queries, _valid_positions(attention_mask, self.store.length))

    def get_seq_length(self) -> int:
        return self.store.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store.clear()
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers' negative convention)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop(tokens_to_remove={tokens_to_remove}): pass a negative "
                             "number of tokens to remove")
        if tokens_to_remove and self.store.started:
            self.store.truncate(max(self.get_seq_length() + tokens_to_remove, 0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.store.map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.store.map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.store.map_batch(lambda t: t[indices])

    def offload(self) -> None:
        self.store.map_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        self.store.map_batch(lambda t: t.to(self.device, non_blocking=True))

    def nbytes_breakdown(self) -> Counter:
        return held_bytes(self.store)

    def theoretical_nbytes(self, spec: ModelSpec) -> float:
        return formula_bytes(self.store, spec)


def _valid_positions(mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """[B, 1, q, T] attention mask -> [B, T] bool, True where a token is not padding.

    The last query row may attend to every earlier non-padding token, so it marks exactly them.
    """
    if mask is None:
        return None
    row = mask[:, 0, -1, :length]
    return row if row.dtype == torch.bool else row == 0
