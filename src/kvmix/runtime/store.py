"""One layer's packed segments (SPEC §2): ``[ sink | quantized blocks, append-only | residual ]``.

New tokens enter the residual; whenever it holds ``residual`` tokens, its oldest ``group`` tokens
are encoded once into a block. Blocks are never re-encoded. The store knows the method and the
segments, never transformers: ``kvmix.runtime.layer`` adapts it to transformers' layer contract.
"""

from __future__ import annotations

from typing import Any

import torch

from kvmix.core.tree import combine, map_tensors
from kvmix.methods import Blocks, Method


class SegmentStore:
    """Sink, blocks and residual of one layer, with the flush rule, crop and batch ops."""

    def __init__(self, method: Method, layer: int):
        self.method = method
        self.layer = layer
        self.clear()

    def clear(self) -> None:
        self.sink_keys = self.sink_values = None  # [B, H, s, D]
        self.res_keys = self.res_values = None  # [B, H, r, D]
        self.blocks: Blocks | None = None  # every tensor [B, n_blocks, ...]
        self.lengths: list[int] = []  # tokens held per block (< group only after a crop)
        self.selection: Any = None
        self.prefilled = False

    @property
    def started(self) -> bool:
        return self.res_keys is not None

    @property
    def length(self) -> int:
        if not self.started:
            return 0
        return self.sink_keys.shape[-2] + sum(self.lengths) + self.res_keys.shape[-2]

    # -- writing -------------------------------------------------------------------------------

    def stage(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New tokens, keys and values [B, H, q, D], enter the residual (keys in the cache's
        key space: the method's key transform is applied here)."""
        if not self.started:
            self.sink_keys = self.res_keys = keys[..., :0, :]
            self.sink_values = self.res_values = values[..., :0, :]
            self.dtype, self.device = keys.dtype, keys.device
        keys = self.method.transform_keys(keys, self.layer)
        self.res_keys = torch.cat([self.res_keys, keys], dim=-2)
        self.res_values = torch.cat([self.res_values, values], dim=-2)

    def commit(self, queries: torch.Tensor, valid: torch.Tensor | None) -> None:
        """After attention: select channels once at prefill, then fill the sink and flush.

        queries: [B, Hq, q, D] post-RoPE; valid: [B, T] bool (False at padding) or None.
        """
        if not self.prefilled:
            keys = torch.cat([self.sink_keys, self.res_keys], dim=-2)
            self.selection = self.method.select(queries, keys, valid, self.layer)
            self.prefilled = True
        else:
            new_keys = self.res_keys[..., -queries.shape[-2]:, :]
            self.selection = self.method.observe(self.selection, queries, new_keys, valid,
                                                 self.layer)
        self._fill_sink()
        fresh = []  # a long prompt flushes many blocks: stack them onto the history once
        while self.res_keys.shape[-2] >= self.method.residual:
            fresh.append(self._encode_oldest(valid))
        if fresh:
            self._append(fresh)

    # -- reading -------------------------------------------------------------------------------

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
        keys, values = self.method.decode(self.blocks, self.layer, self.selection, self.dtype)
        keys, values = (x.transpose(1, 2).flatten(2, 3) for x in (keys, values))  # [B, H, n*G, D]
        if sum(self.lengths) < len(self.lengths) * self.method.group:  # a crop ended in a block
            held = self._held_positions()
            keys, values = keys.index_select(2, held), values.index_select(2, held)
        return keys, values

    # -- editing -------------------------------------------------------------------------------

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

    def map_batch(self, fn) -> None:
        """Apply ``fn`` to every tensor along the batch (beam reorder, repeat, select, moves)."""
        if not self.started:
            return
        self.sink_keys, self.sink_values = fn(self.sink_keys), fn(self.sink_values)
        self.res_keys, self.res_values = fn(self.res_keys), fn(self.res_values)
        self.blocks = map_tensors(self.blocks, fn)
        self.selection = map_tensors(self.selection, fn)

    # -- the flush -----------------------------------------------------------------------------

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
        start = self.length - self.res_keys.shape[-2]
        keys, values = self._pop_residual(g)  # [B, H, G, D]
        _check_finite(keys, values, self.layer)
        block_valid = None if valid is None else valid[:, start : start + g]  # [B, G]
        state = self.method.encode(keys, values, block_valid, self.layer, self.selection)
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


def _head(keys: torch.Tensor, values: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return keys[..., :n, :], values[..., :n, :]


def _check_finite(keys: torch.Tensor, values: torch.Tensor, layer: int) -> None:
    for name, x in (("keys", keys), ("values", values)):
        if not torch.isfinite(x).all():
            raise ValueError(f"non-finite {name} in layer {layer}: kvmix quantizes finite "
                             "values only (check the model's dtype and inputs)")
