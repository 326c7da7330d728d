"""The kernel view of a sequence's blocks, shared by the fused ops (CPU and Triton)."""

from __future__ import annotations

import weakref

from kvmix.methods import KernelView
from kvmix.runtime.store import RowStore

_VIEWS: dict[tuple[int, int], KernelView | None] = {}


def view_of(row: RowStore, layer: int) -> KernelView | None:
    """The method's kernel view of the row's blocks, made once per blocks object (a flush or an
    edit makes a new one) and kept outside the cache, so ``nbytes`` is untouched."""
    key = (id(row.blocks), id(row.selection))
    if key not in _VIEWS:
        _VIEWS[key] = row.method.kernel_view(row.blocks, layer, row.selection)
        weakref.finalize(row.blocks, _VIEWS.pop, key, None)
    return _VIEWS[key]
