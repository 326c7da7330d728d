"""Sealed pages of one cache layer (docs/design/cache-layout.md, Batch-shaped storage).

A page is one encoded block: ``group`` tokens × every KV head, exactly the method's ``encode``
output for one block (codes and statistics, bit for bit). The pool keeps every tensor of that
state as ``[capacity, ...]``, so pages of every sequence live in one set of tensors a single
kernel call can read through a block table. A sealed page is never written again; sequences
that share a prefix (beams) share its pages through reference counts. The pool grows by
doubling (one copy per doubling, amortised O(1) per page, never a re-concatenation of a
history) or is sized up front (``max_pages``); a write beyond a fixed pool is refused before
anything changes. A fixed pool can be resized (``resize``: a server's split of its budget
following the load), pages in use beyond the new size moving below it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from kvmix.core.memory import storage_bytes
from kvmix.core.tree import map_tensors, tagged_tensors

FREE = "free"  # the kind under which capacity held but not in use is reported


class PoolFull(ValueError):
    """A write needs more pages than a fixed pool has."""


class PagePool:
    """Pages of one layer: ``pages`` is the method's block state with tensors [capacity, ...]."""

    def __init__(self, max_pages: int | None = None, limit_hint: str = ""):
        self.max_pages = max_pages
        self.limit_hint = limit_hint  # how to raise a fixed capacity, for the error
        self.pages: Any = None
        self.refs: list[int] = []  # per page: sequences holding it (0: free)
        self.free: list[int] = []  # free page ids, the lowest last
        self.version = 0  # bumped whenever the tensors are reallocated (growth, a move)

    @property
    def capacity(self) -> int:
        return len(self.refs)

    @property
    def used(self) -> int:
        return self.capacity - len(self.free)

    # -- writing -------------------------------------------------------------------------------

    def reserve(self, count: int) -> None:
        """Make room for ``count`` more pages now, or refuse before any state changes."""
        need = count - len(self.free)
        if need <= 0:
            return
        if self.max_pages is not None and self.capacity + need > self.max_pages:
            raise PoolFull(f"the page pool is full: {self.used} of max_pages={self.max_pages} "
                           f"pages in use and {count} more needed{self.limit_hint}")
        if self.pages is not None:
            target = max(self.capacity + need, -(-self.capacity * 5 // 4))
            if self.max_pages is not None:
                target = min(target, self.max_pages)
            self._grow(target)

    def write(self, blocks: Any) -> list[int]:
        """Store ``blocks`` (the method's state, tensors [n, ...]) as n new pages -> their ids,
        each held once."""
        count = _rows(blocks)
        if self.pages is None:
            self._allocate(blocks, count if self.max_pages is None else self.max_pages)
        self.reserve(count)
        ids = [self.free.pop() for _ in range(count)]
        index = torch.tensor(ids, device=_device(self.pages))
        for target, source in zip(_tensors(self.pages), _tensors(blocks), strict=True):
            target.index_copy_(0, index, source.to(target.dtype))
        for page in ids:
            self.refs[page] = 1
        return ids

    def resize(self, capacity: int) -> dict[int, int]:
        """Hold ``capacity`` pages from now on (a fixed pool: a server's split of its budget
        moved): pages in use beyond it move to free ids below it, their bytes copied ->
        {old id: new id} of the moved pages, for their holders to renumber."""
        if capacity < self.used:
            raise ValueError(f"capacity={capacity} is below the {self.used} pages in use")
        self.max_pages = capacity
        if self.pages is None:
            return {}
        low = sorted(i for i in self.free if i < capacity)
        moved = dict(zip((i for i in range(capacity, self.capacity) if self.refs[i]), low,
                         strict=False))
        device = _device(self.pages)
        old = torch.tensor(list(moved), dtype=torch.long, device=device)
        new = torch.tensor(list(moved.values()), dtype=torch.long, device=device)
        refs = self.refs[:capacity] + [0] * max(capacity - self.capacity, 0)
        for source, target in moved.items():
            refs[target] = self.refs[source]

        def resized(t: torch.Tensor) -> torch.Tensor:
            t.index_copy_(0, new, t.index_select(0, old))
            return _sized(t, capacity)

        self.pages = map_tensors(self.pages, resized)
        self.refs = refs
        self.free = [i for i in range(capacity - 1, -1, -1) if refs[i] == 0]
        self.version += 1
        return moved

    # -- reading -------------------------------------------------------------------------------

    def gather(self, ids: list[int]) -> Any:
        """Pages ``ids`` as the method's state, tensors [len(ids), ...] (a copy)."""
        index = torch.tensor(ids, dtype=torch.long, device=_device(self.pages))
        return map_tensors(self.pages, lambda t: t.index_select(0, index))

    # -- sharing -------------------------------------------------------------------------------

    def retain(self, ids: list[int]) -> None:
        for page in ids:
            self.refs[page] += 1

    def release(self, ids: list[int]) -> None:
        for page in ids:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free.append(page)
        self.free.sort(reverse=True)  # hand out low ids first: tables stay compact

    def to(self, device: torch.device | str) -> None:
        self.pages = map_tensors(self.pages, lambda t: t.to(device, non_blocking=True))
        self.version += 1

    # -- bytes ---------------------------------------------------------------------------------

    def breakdown(self) -> Counter:
        """Bytes by kind (codes, scales, zeros, masks, full) for pages in use, and ``free`` for
        capacity held but not in use; together every byte of the pool's storages."""
        total: Counter = Counter()
        if self.pages is None or not self.capacity:  # none allocated, or resized to none
            return total
        for kind, t in tagged_tensors(self.pages, "full"):
            per_page = storage_bytes(t) // self.capacity
            total[kind] += per_page * self.used
            total[FREE] += per_page * len(self.free)
        return total

    def tensors(self) -> list[torch.Tensor]:
        return _tensors(self.pages)

    # -- helpers -------------------------------------------------------------------------------

    def _allocate(self, blocks: Any, capacity: int) -> None:
        self.pages = map_tensors(blocks, lambda t: t.new_empty((capacity, *t.shape[1:])))
        self.refs = [0] * capacity
        self.free = list(range(capacity - 1, -1, -1))
        self.version += 1

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        self.pages = map_tensors(self.pages, lambda t: _sized(t, capacity))
        self.refs += [0] * (capacity - old)
        self.free = sorted([*self.free, *range(old, capacity)], reverse=True)
        self.version += 1


def _sized(t: torch.Tensor, capacity: int) -> torch.Tensor:
    """A new tensor of ``capacity`` rows holding ``t``'s first rows (as many as fit)."""
    sized = t.new_empty((capacity, *t.shape[1:]))
    sized[: min(capacity, len(t))] = t[:capacity]
    return sized


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for _, t in tagged_tensors(obj, "")]


def _rows(blocks: Any) -> int:
    return _tensors(blocks)[0].shape[0]


def _device(pages: Any) -> torch.device:
    return _tensors(pages)[0].device
