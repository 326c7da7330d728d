"""One sequence's packed segments (SPEC §2): ``[ sink | blocks, append-only | residual ]``.

The sink is the sequence's first ``sink`` real tokens; new tokens enter the residual; whenever it
holds ``residual`` tokens, its oldest ``group`` tokens are encoded once into a block. Blocks are
never re-encoded. Only real tokens enter (the layer strips padding), so a sequence gets the same
store whether it runs alone or in a padded batch. Every tensor kept is its own storage: no view
pins a prompt or a popped residual. The store knows the method, never transformers.
"""

from __future__ import annotations

from typing import Any

import torch

from kvmix.core.memory import owned
from kvmix.core.tree import combine, map_tensors, tagged_tensors
from kvmix.methods import Blocks, Method

FLOAT16_MAX = torch.finfo(torch.float16).max


class RowStore:
    """Sink, blocks and residual of one sequence; every tensor has batch dimension 1."""

    def __init__(self, method: Method, layer: int):
        self.method = method
        self.layer = layer
        self.sink_keys = self.sink_values = None  # [1, H, s, D]
        self.res_keys = self.res_values = None  # [1, H, r, D]
        self.blocks: Blocks | None = None  # every tensor [1, n_blocks, ...]
        self.lengths: list[int] = []  # tokens held per block (< group only after a crop)
        self.selection: Any = None
        self.prefilled = False

    def __len__(self) -> int:
        if self.res_keys is None:
            return 0
        return self.sink_keys.shape[-2] + sum(self.lengths) + self.res_keys.shape[-2]

    # -- writing -------------------------------------------------------------------------------

    def append(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor) -> None:
        """New real tokens after their attention: keys, values [1, H, q, D] (keys in the cache's
        key space), queries [1, Hq, q, D]. Selects at the first call, then fills the sink and
        flushes full groups."""
        if self.res_keys is None:  # fresh empties: a zero-length view would pin the prompt
            self.sink_keys = self.res_keys = keys.new_empty(*keys.shape[:-2], 0, keys.shape[-1])
            self.sink_values = self.res_values = values.new_empty(*values.shape[:-2], 0,
                                                                  values.shape[-1])
        self.res_keys = torch.cat([self.res_keys, keys], dim=-2)
        self.res_values = torch.cat([self.res_values, values], dim=-2)
        self._select(queries, keys)
        self._fill_sink()
        fresh = []  # a long prompt flushes many blocks: stack them onto the history once
        while self.res_keys.shape[-2] >= self.method.residual:
            fresh.append(self._encode_oldest())
        if fresh:
            self._append(fresh)  # a concatenation: the blocks own their storage
        self._own_segments()

    # -- reading -------------------------------------------------------------------------------

    def history(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference path: every held token, blocks decoded -> keys, values [1, H, L, D]."""
        keys, values = self.decode_blocks(dtype)
        keys = torch.cat([self.sink_keys, keys, self.res_keys], dim=-2)
        values = torch.cat([self.sink_values, values, self.res_values], dim=-2)
        return keys, values

    def decode_blocks(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """All blocks in one decode call -> keys, values: [1, H, sum(lengths), D]."""
        if self.blocks is None:
            return self.sink_keys[..., :0, :], self.sink_values[..., :0, :]
        keys, values = self.method.decode(self.blocks, self.layer, self.selection, dtype)
        keys, values = (x.transpose(1, 2).flatten(2, 3) for x in (keys, values))  # [1, H, n*G, D]
        if sum(self.lengths) < len(self.lengths) * self.method.group:  # a crop ended in a block
            held = self._held_positions(keys.device)
            keys, values = keys.index_select(2, held), values.index_select(2, held)
        return keys, values

    # -- editing -------------------------------------------------------------------------------

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens of every segment, in order."""
        if self.res_keys is None:
            return
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
        self.blocks = map_tensors(self.blocks, owned)
        self._own_segments()

    def copy(self, fn=lambda t: t.clone()) -> RowStore:
        """A store holding ``fn`` of every tensor (a deep copy by default; ``fn`` may move)."""
        twin = RowStore(self.method, self.layer)
        twin.__dict__.update({**self.__dict__, "lengths": list(self.lengths)})
        for name in ("sink_keys", "sink_values", "res_keys", "res_values", "blocks", "selection"):
            setattr(twin, name, map_tensors(getattr(self, name), fn))
        return twin

    def tagged(self) -> list[tuple[str, torch.Tensor]]:
        """(kind, tensor) of everything held: sink, residual, block kinds, masks."""
        if self.res_keys is None:
            return []
        return [("sink", self.sink_keys), ("sink", self.sink_values),
                ("residual", self.res_keys), ("residual", self.res_values),
                *tagged_tensors(self.blocks, "full"), *tagged_tensors(self.selection, "masks")]

    # -- the flush -----------------------------------------------------------------------------

    def _select(self, queries: torch.Tensor, keys: torch.Tensor) -> None:
        if not self.prefilled:  # the prompt: everything held so far is in the residual
            self.selection = self.method.select(queries, self.res_keys, self.layer,
                                                self.res_values)
            self.prefilled = True
        else:
            self.selection = self.method.observe(self.selection, queries, keys, self.layer)

    def _held_positions(self, device: torch.device) -> torch.Tensor:
        g = self.method.group
        return torch.cat([torch.arange(i * g, i * g + n, device=device)
                          for i, n in enumerate(self.lengths)])

    def _fill_sink(self) -> None:
        # The sink is always the first tokens: it only grows while no block exists.
        room = self.method.sink - self.sink_keys.shape[-2]
        if room <= 0 or self.lengths:
            return
        keys, values = self._pop_residual(room)
        self.sink_keys = torch.cat([self.sink_keys, keys], dim=-2)
        self.sink_values = torch.cat([self.sink_values, values], dim=-2)

    def _encode_oldest(self) -> Blocks:
        """Encode (once) the oldest ``group`` residual tokens -> a block, tensors [1, 1, ...]."""
        keys, values = self._pop_residual(self.method.group)  # [1, H, G, D]
        if self.method.quantizes:
            check_float16_range(keys, values, self.layer)
        state = self.method.encode(keys, values, self.layer, self.selection)
        self.lengths.append(self.method.group)
        return map_tensors(Blocks(*state), lambda t: t.unsqueeze(1))

    def _append(self, fresh: list[Blocks]) -> None:
        """Stack new blocks after the held ones along the block axis (no re-encoding)."""
        parts = fresh if self.blocks is None else [self.blocks, *fresh]
        self.blocks = combine(parts, lambda tensors: torch.cat(tensors, dim=1))

    def _pop_residual(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove and return the oldest ``n`` residual tokens: keys, values [1, H, n, D]."""
        popped = _head(self.res_keys, self.res_values, n)
        self.res_keys, self.res_values = self.res_keys[..., n:, :], self.res_values[..., n:, :]
        return popped

    def _own_segments(self) -> None:
        """Give sink and residual their own storage (slices would pin what they were cut from:
        the prompt, or the tokens just flushed)."""
        self.sink_keys, self.sink_values = owned(self.sink_keys), owned(self.sink_values)
        self.res_keys, self.res_values = owned(self.res_keys), owned(self.res_values)


def check_finite(keys: torch.Tensor, values: torch.Tensor, layer: int) -> None:
    """An error naming the layer if any key or value is inf or NaN. One fused test per call
    (a sum is non-finite when any element is, or on overflow, then checked precisely)."""
    if torch.isfinite(keys.sum(dtype=torch.float32) + values.sum(dtype=torch.float32)):
        return
    for name, x in (("keys", keys), ("values", values)):
        if not torch.isfinite(x).all():
            raise ValueError(f"non-finite {name} in layer {layer}: kvmix keeps finite values "
                             "only (check the model's dtype and inputs)")


def check_float16_range(keys: torch.Tensor, values: torch.Tensor, layer: int) -> None:
    """Quantized blocks keep float16 statistics: values beyond ±65504 cannot be stored."""
    for name, x in (("keys", keys), ("values", values)):
        peak = x.abs().amax().item()
        if peak > FLOAT16_MAX:
            raise ValueError(f"{name} in layer {layer} reach {peak:.3g}, beyond the float16 range "
                             f"(±{FLOAT16_MAX:.0f}) of the stored scales and minimums; use "
                             "method 'full' for this model")


def _head(keys: torch.Tensor, values: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return keys[..., :n, :], values[..., :n, :]
