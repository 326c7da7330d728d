"""What a batched decode step reads besides the step's metadata (``kvmix.runtime.steps``),
shared by the fused backends (CPU op, Triton): the layer's page pool as one kernel view and the
per-sequence parts of it (plane channels and key offsets follow each sequence's selection),
cached per store and rebuilt only when selections or the pool's tensors change, outside the
cache so its bytes are the cache's own only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvmix.core.tree import map_tensors
from kvmix.methods import ChannelKeys, KernelView, Method
from kvmix.runtime.store import BatchStore


@dataclass
class PoolView:
    """The pool read by a batched kernel: ``view`` of every page (float pages: keys and values
    [P, H, G, D]), and, for per-channel keys, each sequence's plane channels, multipliers
    and key offsets stacked [B, H, ...]. ``view`` is None while no page exists. ``built``: what
    each backend builds from it for its launches, once per view (``arguments``)."""

    view: KernelView | None
    index: list[torch.Tensor]  # per plane [B, H, C] int64
    mult: list[torch.Tensor]  # per plane [B, H, C] float32
    offset: torch.Tensor | None  # [B, H, D] float32
    built: dict = field(default_factory=dict, repr=False)


def arguments(pool: PoolView, backend: str, build: Callable[[PoolView], Any]) -> Any:
    """``build(pool)``, once per pool view and backend: decode steps reuse it."""
    if backend not in pool.built:
        pool.built[backend] = build(pool)
    return pool.built[backend]


_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pool_view(store: BatchStore) -> PoolView | None:
    """The pool as a batched kernel reads it, or None where the method has no kernel view."""
    key = (store.version, store.pool.version, store.batch, store.pool.pages is None)
    cached = _VIEWS.get(store)
    if cached is None or cached[0] != key:
        cached = key, _pool_view(store)
        _VIEWS[store] = cached
    return cached[1]


def _pool_view(store: BatchStore) -> PoolView | None:
    if store.pool.pages is None:
        return PoolView(None, [], [], None)
    pool = map_tensors(store.pool.pages, lambda t: t.unsqueeze(0))  # one "sequence" of pages
    return build_pool_view(store.method, store.layer, pool, store.selections)


def build_pool_view(method: Method, layer: int, pool: Any, selections: list[Any]
                    ) -> PoolView | None:
    """A pool of pages (the method's state, tensors [1, P, ...]) as a batched kernel reads it
    for sequences of ``selections`` (one kernel view per distinct selection object), or None
    where the method has no kernel view. Shared by kvmix's cache and its vLLM plugin."""
    distinct = {id(s): s for s in selections}
    views = [method.kernel_view(pool, layer, s) for s in distinct.values()]
    if any(v is None for v in views):
        return None
    if not isinstance(views[0].keys, ChannelKeys):
        return PoolView(views[0], [], [], None)
    position = {key: i for i, key in enumerate(distinct)}
    rows = [position[id(s)] for s in selections] if len(views) < len(selections) else None

    def per_row(parts: list[torch.Tensor]) -> torch.Tensor:  # U x [H, ...] -> [B, H, ...]
        return torch.stack(parts if rows is None else [parts[r] for r in rows])

    count = range(len(views[0].keys.planes))
    index = [per_row([v.keys.planes[i].index for v in views]) for i in count]
    mult = [per_row([v.keys.planes[i].mult for v in views]).float() for i in count]
    offset = per_row([v.keys.offset.float() for v in views])
    return PoolView(views[0], index, mult, offset.contiguous())
