"""A decode step's metadata on the device, built once per step for every layer of a kind.

Every layer of a kind (full attention, or one sliding window) changes in lockstep: the same
rows, lengths and page ids, since the same calls reach them in the same order. What a decode
step's kernels read is therefore the same in each of them:

* ``Step``: each row's slot for its new token, the float spans its newest token sees (sink and
  residual) and the tokens a sliding window hides at the front of its first page;
* ``Table``: the block table (page ids and tokens held per page, page counts).

``StepMeta``, one per kind and shared by its layers (found by the kind's ``Kind`` token, and
kept outside the cache, so the cache's bytes are its own only), builds them on the host and
copies them into persistent device tensors with one non-blocking copy from pinned memory: no
tensor is made on the device from a Python list, no copy waits for the device, and the tensors
a kernel reads keep their addresses from step to step (what a captured CUDA graph replays). A
layer whose lists equal the ones uploaded last reads the same tensors without a copy, so a step
of L layers copies once. Lists are compared, never assumed: a layer out of lockstep (driven
alone, as tests do) gets its own upload, never another layer's metadata.
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass

import numpy as np
import torch

MIN_WIDTH = 16  # block-table columns at least: the width grows by doubling from here


@dataclass
class Step:
    """One decode step of every row, on the store's device (int64)."""

    slots: torch.Tensor  # [B]: where each row's new token goes in the slot arena
    spans: torch.Tensor  # [B, 4]: sink start and length, residual start and length (arena)
    skips: torch.Tensor  # [B]: tokens hidden at the front of the first page (0: none)


@dataclass
class Table:
    """The block table on the store's device: page ids and tokens held [B, width] (padded with
    page 0, held 0), page counts [B], all int64. ``width`` is the table's capacity (a power of
    two, at least ``MIN_WIDTH``): it changes only when a row outgrows it."""

    pages: torch.Tensor
    held: torch.Tensor
    counts: torch.Tensor
    width: int


def bucket(n: int, least: int = MIN_WIDTH) -> int:
    """The power of two >= ``n`` (at least ``least``): buffer sizes that grow by doubling."""
    return max(least, 1 << (max(n, 1) - 1).bit_length())


class Workspace:
    """A persistent float32 device buffer for a step's partial results, shared by the layers
    of a kind (each layer's kernels are done with it before the next layer's start, in stream
    order); reallocated only when it must grow."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None

    def take(self, shapes: list[tuple[int, ...]], device: torch.device) -> list[torch.Tensor]:
        """Contiguous views of the buffer, one per shape, back to back."""
        sizes = [math.prod(shape) for shape in shapes]
        if self.buffer is None or self.buffer.numel() < sum(sizes) or \
                self.buffer.device != device:
            self.buffer = torch.empty(bucket(sum(sizes)), device=device)
        views, at = [], 0
        for shape, size in zip(shapes, sizes, strict=True):
            views.append(self.buffer[at : at + size].view(shape))
            at += size
        return views


class Upload:
    """A persistent int64 device buffer filled from host lists (or int64 numpy arrays), one
    non-blocking copy each (from pinned memory on CUDA); it is reallocated only when it must
    grow."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None

    def fill(self, values: list[int] | np.ndarray, device: torch.device) -> torch.Tensor:
        """``values`` on ``device`` -> [len(values)], a view of the buffer."""
        n = len(values)
        if self.buffer is None or self.buffer.numel() < n or self.buffer.device != device:
            self.buffer = torch.zeros(bucket(n), dtype=torch.long, device=device)
        pinned = device.type == "cuda"
        if isinstance(values, np.ndarray):
            host = torch.from_numpy(values)
            host = host.pin_memory() if pinned else host
        else:
            host = torch.tensor(values, dtype=torch.long, pin_memory=pinned)
        view = self.buffer[:n]
        view.copy_(host, non_blocking=True)
        return view


class Kind:
    """The token the layers of one kind share: the key of their ``StepMeta``."""

    __slots__ = ("__weakref__",)


_META: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def meta(kind: Kind) -> StepMeta:
    """The decode-step metadata of the layers sharing ``kind``."""
    found = _META.get(kind)
    if found is None:
        found = _META[kind] = StepMeta()
    return found


class StepMeta:
    """The decode-step metadata of every layer of one kind (see the module docstring)."""

    def __init__(self):
        self._step, self._table = Upload(), Upload()
        self.workspace = Workspace()
        self._step_lists: tuple | None = None  # (device, the host list) uploaded last
        self._table_lists: tuple | None = None  # (device, pages, held) uploaded last
        self._last: Step | None = None
        self._table_now: Table | None = None
        self._serial = 0  # bumped at every table upload
        self._steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # store -> Step
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # store -> table
        self.uploads = 0  # host-to-device copies made (a step of L layers: one)

    def current(self, store) -> Step | None:
        """The metadata of ``store``'s last decode step (None before its first)."""
        return self._steps.get(store)

    def advance(self, store, slots: list[int]) -> Step:
        """The step of ``store`` whose new tokens go to ``slots`` (its counts already
        advanced) on its device, uploaded unless the last upload holds the same lists."""
        device, batch = store.keys.device, store.batch
        skips = store.skips() if store.window is not None else [0] * batch
        lists = (device, [*slots, *itertools.chain.from_iterable(store.float_spans()), *skips])
        if lists != self._step_lists:
            flat = self._step.fill(lists[1], device)
            self._last = Step(flat[:batch], flat[batch : 5 * batch].view(batch, 4),
                              flat[5 * batch :])
            self._step_lists = lists
            self.uploads += 1
        self._steps[store] = self._last
        return self._last

    def table(self, store) -> Table:
        """The block table of ``store`` on its device: checked against the last upload only
        when the store's table changed since it last read it."""
        seen = (store.table_version, self._serial)
        if self._seen.get(store) == seen:
            return self._table_now
        device = store.keys.device
        if self._table_lists != (device, store.pages, store.held):
            self._upload_table(store, device)
        self._seen[store] = (store.table_version, self._serial)
        return self._table_now

    def _upload_table(self, store, device: torch.device) -> None:
        width = bucket(max(map(len, store.pages), default=0))
        pad = [[0] * (width - len(p)) for p in store.pages]
        rows = list(zip(store.pages, store.held, pad, strict=True))
        host = [*itertools.chain.from_iterable(p + z for p, _, z in rows),
                *itertools.chain.from_iterable(h + z for _, h, z in rows),
                *(len(p) for p in store.pages)]
        flat = self._table.fill(host, device)
        cells = store.batch * width
        self._table_now = Table(flat[:cells].view(-1, width), flat[cells : 2 * cells]
                               .view(-1, width), flat[2 * cells :], width)
        self._table_lists = (device, [list(p) for p in store.pages],
                             [list(h) for h in store.held])
        self._serial += 1
        self.uploads += 1
