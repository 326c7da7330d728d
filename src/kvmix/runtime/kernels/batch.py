"""What a batched decode step reads, shared by the fused backends (CPU op, Triton): the layer's
page pool as one kernel view, the per-sequence parts of it (plane channels and key offsets
follow each sequence's selection), and the block table as tensors.

Both are cached per store and rebuilt only when what they depend on changes (selections or the
pool's tensors; the table), outside the cache so its bytes are the cache's own only.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from kvmix.core.tree import map_tensors
from kvmix.methods import ChannelKeys, KernelView
from kvmix.runtime.store import BatchStore


@dataclass
class PoolView:
    """The pool read by a batched kernel: ``view`` of every page (float pages: keys and values
    [P, H, G, D]), and, for per-channel keys, each sequence's plane channels, multipliers
    and key offsets stacked [B, H, ...]. ``view`` is None while no page exists."""

    view: KernelView | None
    index: list[torch.Tensor]  # per plane [B, H, C] int64
    mult: list[torch.Tensor]  # per plane [B, H, C] float32
    offset: torch.Tensor | None  # [B, H, D] float32


@dataclass
class Table:
    """The block table on the store's device: page ids and tokens held [B, M] (padded with
    page 0, held 0), page counts [B], all int64."""

    pages: torch.Tensor
    held: torch.Tensor
    counts: torch.Tensor
    width: int


_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pool_view(store: BatchStore) -> PoolView | None:
    """The pool as a batched kernel reads it, or None where the method has no kernel view."""
    key = (store.version, store.pool.version, store.batch, store.pool.pages is None)
    cached = _VIEWS.get(store)
    if cached is None or cached[0] != key:
        cached = key, _pool_view(store)
        _VIEWS[store] = cached
    return cached[1]


def table(store: BatchStore) -> Table:
    cached = _TABLES.get(store)
    if cached is None or cached[0] != store.table_version:
        cached = store.table_version, _table(store)
        _TABLES[store] = cached
    return cached[1]


def spans(store: BatchStore) -> torch.Tensor:
    """Per sequence (sink start, sink length, residual start, residual length) in the float
    slots, what its newest token sees: [B, 4] int64 on the store's device."""
    return _tensor(store.float_spans(), store.keys.device)


def skips(store: BatchStore) -> torch.Tensor | None:
    """Per sequence, tokens at the front of its first page a sliding window hides: [B] int64
    on the store's device; None for a full-attention layer."""
    return None if store.window is None else _tensor(store.skips(), store.keys.device)


def _pool_view(store: BatchStore) -> PoolView | None:
    if store.pool.pages is None:
        return PoolView(None, [], [], None)
    pool = map_tensors(store.pool.pages, lambda t: t.unsqueeze(0))  # one "sequence" of pages
    selections = {id(s): s for s in store.selections}  # one view per distinct selection
    views = {key: store.method.kernel_view(pool, store.layer, s) for key, s in selections.items()}
    if any(v is None for v in views.values()):
        return None
    first = next(iter(views.values()))
    if not isinstance(first.keys, ChannelKeys):
        return PoolView(first, [], [], None)
    planes = [views[id(s)].keys.planes for s in store.selections]
    count = range(len(first.keys.planes))
    index = [torch.stack([p[i].index for p in planes]) for i in count]
    mult = [torch.stack([p[i].mult for p in planes]).float() for i in count]
    offset = torch.stack([views[id(s)].keys.offset.float() for s in store.selections])
    return PoolView(first, index, mult, offset.contiguous())


def _table(store: BatchStore) -> Table:
    width = max(1, *(len(p) for p in store.pages))
    pad = [[0] * (width - len(p)) for p in store.pages]
    device = store.keys.device
    pages = [p + z for p, z in zip(store.pages, pad, strict=True)]
    held = [h + z for h, z in zip(store.held, pad, strict=True)]
    return Table(_tensor(pages, device), _tensor(held, device),
                 _tensor([len(p) for p in store.pages], device), width)


def _tensor(values: list, device: torch.device) -> torch.Tensor:
    """A host list as an int64 tensor on ``device`` (a host-to-device copy: it waits for no
    kernel, so no sync)."""
    return torch.tensor(values, dtype=torch.long, device=device)
