"""A full-attention layer's packed cache under transformers' ``CacheLayerMixin`` contract.

transformers sees one tensor of ``T`` positions per layer, left-padded across the batch; kvmix
keeps one ``RowStore`` per sequence holding only its real tokens, so each sequence's sink, group
boundaries and statistics are its own (SPEC §2: the same cache alone or in a padded batch), and
padding costs no storage. ``pads[b]`` is how many leading positions of row ``b`` are padding.

``update`` only stages the new tokens; the attention function registered by
``kvmix.runtime.attention`` then calls ``attend``, which attends each sequence over its own
history and commits the new tokens (the flush happens there, with the post-RoPE queries that
prefill-time channel selection needs).
"""

from __future__ import annotations

import threading
from collections import Counter

import torch
from transformers.cache_utils import CacheLayerMixin

from kvmix.core.memory import kind_bytes
from kvmix.core.quantizers import fused_encoding
from kvmix.methods import Method, ModelSpec
from kvmix.runtime.accounting import formula_bytes
from kvmix.runtime.kernels import cpu, gpu, interpreting, reference
from kvmix.runtime.kernels.views import view_of
from kvmix.runtime.store import RowStore, check_finite


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
    """One full-attention layer's packed cache: a store per sequence, behind transformers' calls."""

    is_sliding = False
    is_compileable = False
    # A crop that ends inside a block keeps that block's codes: not a trace-free rollback.
    is_croppable = False

    def __init__(self, method: Method, layer_idx: int, backend: str = "torch"):
        super().__init__()
        self.method = method
        self.layer_idx = layer_idx
        self.backend = backend  # "torch" (the reference path), "cpu" or "triton" (fused ops)
        self.reset()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self.backend == "cpu" and key_states.device.type != "cpu":
            raise ValueError(f"backend='cpu' runs on CPU tensors; layer {self.layer_idx}'s keys "
                             f"are on {key_states.device} (use backend='torch' or 'auto')")
        if self.backend == "triton" and key_states.device.type != "cuda" and not interpreting():
            raise ValueError(f"backend='triton' runs on CUDA tensors; layer {self.layer_idx}'s "
                             f"keys are on {key_states.device} (use backend='cpu' or 'auto')")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.rows = [RowStore(self.method, self.layer_idx) for _ in range(key_states.shape[0])]
        self.pads = [0] * key_states.shape[0]
        self.is_initialized = True

    # -- the forward pass ----------------------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage the new tokens, [B, H, q, D], for ``attend``; returns them (key transformed)."""
        if _HANDOFF.layer is not None:
            _HANDOFF.layer = None
            raise RuntimeError(
                "a kvmix cache layer was updated but its attention never committed: the model "
                "must use attn_implementation='kvmix' (kvmix.make_cache sets it)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        check_finite(key_states, value_states, self.layer_idx)
        keys = self.method.transform_keys(key_states, self.layer_idx)
        self.staged = keys, value_states
        self.length += key_states.shape[-2]
        _HANDOFF.layer = self
        return self.staged

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None,
               scaling: float) -> torch.Tensor:
        """Each sequence's new queries over its own history and new tokens, then commit.

        query: [B, Hq, q, D] (in the cache's key space); attention_mask: [B, 1, q, T] or None
        -> [B, Hq, q, D], zero at padding queries.
        """
        keys, values = self.staged
        self.staged = None
        self._read_pads(attention_mask)
        out = torch.zeros_like(query)
        for b, row in enumerate(self.rows):
            new = min(query.shape[-2], self.length - self.pads[b])  # this row's real new tokens
            if new <= 0:
                continue
            rows = slice(b, b + 1)
            k, v, q = keys[rows, :, -new:], values[rows, :, -new:], query[rows, :, -new:]
            out[rows, :, -new:] = self._attend_row(row, q, k, v, scaling)
            self._commit(row, k, v, q)
        return out

    def fill(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor) -> None:
        """Commit tokens without attending — a synthetic history for benchmarks of the
        attention op: keys, values [B, H, T, D], queries [B, Hq, T, D] (for selection)."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        check_finite(keys, values, self.layer_idx)
        keys = self.method.transform_keys(keys, self.layer_idx)
        queries = self.method.transform_queries(queries, self.layer_idx)
        self.length += keys.shape[-2]
        for b, row in enumerate(self.rows):
            rows = slice(b, b + 1)
            self._commit(row, keys[rows], values[rows], queries[rows])

    def _commit(self, row: RowStore, keys: torch.Tensor, values: torch.Tensor,
                queries: torch.Tensor) -> None:
        with fused_encoding(self.backend == "triton"):  # flushed blocks encode on the GPU
            row.append(keys, values, queries)

    # -- the cache contract --------------------------------------------------------------------

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.rows: list[RowStore] = []
        self.pads: list[int] = []
        self.length = 0  # positions transformers sees, padding included
        self.staged = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` positions (transformers' negative convention)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop(tokens_to_remove={tokens_to_remove}): pass a negative "
                             "number of tokens to remove")
        self.length = max(self.length + tokens_to_remove, 0)
        for row, pad in zip(self.rows, self.pads, strict=True):
            row.truncate(max(self.length - pad, 0))
        self.pads = [min(pad, self.length) for pad in self.pads]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._pick(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._pick([b for b in range(len(self.rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._pick(torch.arange(len(self.rows))[indices.cpu()].tolist())

    def offload(self) -> None:
        self.rows = [row.copy(lambda t: t.to("cpu", non_blocking=True)) for row in self.rows]

    def prefetch(self) -> None:
        self.rows = [row.copy(lambda t: t.to(self.device, non_blocking=True)) for row in self.rows]

    # -- bytes ---------------------------------------------------------------------------------

    def nbytes_breakdown(self) -> Counter:
        """Bytes of distinct storages held, by kind (sink, residual, codes, scales, ...)."""
        return kind_bytes([pair for row in self.rows for pair in row.tagged()])

    def theoretical_nbytes(self, spec: ModelSpec) -> float:
        return sum(formula_bytes(row, spec, self.dtype) for row in self.rows)

    def history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference path for every sequence: keys, values [B, H, L, D] (sequences of equal
        length only: a padded batch has a history per row, ``rows[b].history``)."""
        lengths = {len(row) for row in self.rows}
        if len(lengths) > 1:
            raise ValueError(f"sequences hold {sorted(lengths)} tokens: stack per row instead")
        held = [row.history(self.dtype) for row in self.rows]
        return torch.cat([k for k, _ in held]), torch.cat([v for _, v in held])

    def real_tokens(self) -> int:
        return sum(len(row) for row in self.rows)

    # -- helpers -------------------------------------------------------------------------------

    def _read_pads(self, mask: torch.Tensor | None) -> None:
        """Leading padding per row from the mask's last query row ([B, 1, q, T]); only left
        padding is supported (padding after a real token would break the per-sequence layout)."""
        if mask is None:
            return
        valid = mask[:, 0, -1, : self.length]
        valid = valid if valid.dtype == torch.bool else valid == 0  # additive float masks
        first = torch.where(valid.any(-1), valid.int().argmax(-1), self.length)  # [B]
        pads = first.tolist()
        holes = [b for b, pad in enumerate(pads) if not valid[b, pad:].all()]
        if holes:
            raise ValueError(f"attention_mask rows {holes} have padding after a real token; "
                             "kvmix supports left padding only (tokenizer padding_side='left')")
        self.pads = pads

    def _attend_row(self, row: RowStore, query: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, scaling: float) -> torch.Tensor:
        """The fused op for a few new queries over a history it can read, else the reference."""
        fused = {"cpu": cpu, "triton": gpu}.get(self.backend)
        if fused and len(row) and query.shape[-2] <= fused.MAX_QUERIES:
            view = None if row.blocks is None else view_of(row, self.layer_idx)
            if view is not None or row.blocks is None:
                return fused.attend(row, view, query, keys, values, scaling)
        return reference.attend(row, query, keys, values, scaling)

    def _pick(self, index: list[int]) -> None:
        """Rows in a new order; a row used twice is copied, so every row owns its storage."""
        if not self.is_initialized:
            return
        used: set[int] = set()
        rows = []
        for b in index:
            rows.append(self.rows[b] if b not in used else self.rows[b].copy())
            used.add(b)
        self.rows, self.pads = rows, [self.pads[b] for b in index]
