"""Every sequence's packed segments in one layer (docs/design/cache-layout.md): ``[ sink | pages |
residual ]``, batch-shaped.

Per sequence the semantics are unchanged: the sink is its first ``sink`` real tokens; new tokens
enter the residual; whenever it holds ``residual`` tokens its oldest ``group`` tokens are encoded
once into a page; pages are never re-encoded. Only real tokens enter (the layer strips
padding), so a sequence gets the same store alone or in a padded batch.

The storage is the batch's, not the sequence's:

* float slots in one ``SlotArena`` per layer, ``keys``, ``values``: [1, H, N, D] in the
  method's slot dtype (``Method.slot_dtype``: float16 for a quantizing method in a float32
  model). Row b owns the extent ``[offset[b], offset[b] + capacity[b])``: at most ``sink +
  residual`` slots, fewer for a request that will never hold them (``add_rows``); its sink
  fills slots ``[0, sink_len[b])`` of the extent and its residual ``[sink, sink + res_len[b])``.
  New tokens are rounded to the slot dtype as they enter (``stored``), so a token is attended,
  kept and sealed as one value;
* sealed pages in the layer's ``PagePool``; per row the page ids and the tokens each holds
  (``group``, less only after a crop) — the block table;
* per row the prefill selection (PN-Mix masks, ...), each its own storage.

A sliding-window layer (``window`` W: a query sees itself and the W - 1 tokens before it, as
transformers' sliding layers) keeps the same segments but releases, after every commit, the
pages the next query can no longer see (``dropped[b]``: tokens gone, between the sink and the
first page); groups that would leave the window as soon as they are sealed are never encoded.
What a query still holds but must not see — the sink and the front of the first page once the
window has passed them, the oldest residual tokens when W is shorter than the residual — is
masked: ``float_spans`` and ``skips`` for the fused kernels, ``positions`` for the reference.

Token counts live on the host (they follow from the step count, so reading them costs no
device sync). Flushes of every row that fills at a step are encoded in one ``encode`` call, and
a prompt's full groups in one call for the whole batch. ``row(b)`` is a read-only view of one
sequence for the reference path and the per-sequence kernels.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from kvmix.core.memory import storage_bytes
from kvmix.core.tree import combine, map_tensors, tagged_tensors
from kvmix.methods import Blocks, Method
from kvmix.runtime.arena import SlotArena
from kvmix.runtime.pool import FREE, PagePool
from kvmix.runtime.steps import Kind, Step, StepMeta, meta

FLOAT16_MAX = torch.finfo(torch.float16).max


@dataclass
class Placement:
    """Where one row's new real tokens go: into the sink, into pages, into the residual."""

    row: int
    sink: int  # tokens moved into the sink
    blocks: int  # full groups leaving the residual
    residual: int  # residual length afterwards
    dropped: int = 0  # of ``blocks``, the leading ones already outside the window: not sealed


@dataclass
class Sealing:
    """What a decode step's commit changes in one store (``BatchStore.sealing``): every row's
    selection after the step, the rows whose residual is full and their oldest groups encoded
    (the method's state of one page each) with the arena positions of their residuals
    ([n, residual]); None when no row is full."""

    selections: list[Any]
    full: list[int]
    residuals: torch.Tensor | None
    blocks: Blocks | None


def sealed_groups(method: Method, tokens: int) -> int:
    """The flush rule: groups sealed from a residual of ``tokens`` (it keeps fewer than
    ``residual``)."""
    return 0 if tokens < method.residual else (tokens - method.residual) // method.group + 1


class BatchStore:
    """Float slots, block table and selections of every sequence of one layer."""

    def __init__(self, method: Method, layer: int, pool: PagePool, window: int | None = None,
                 kind: Kind | None = None):
        """kind: the token shared by the layers of this one's kind, whose decode-step
        metadata they share (its own by default)."""
        self.method = method
        self.layer = layer
        self.pool = pool
        self.window = window  # a sliding-window layer's W, or None (every token stays visible)
        self.arena = SlotArena(f"layer {layer}")  # keys, values [1, H, N, D]; rows' extents
        self.dtype: torch.dtype | None = None  # the model's: what sealing and reading see
        self.sink_len: list[int] = []
        self.res_len: list[int] = []
        self.pages: list[list[int]] = []  # page ids per row, in token order
        self.held: list[list[int]] = []  # tokens held per page
        self.dropped: list[int] = []  # tokens of pages released behind the window, per row
        self.selections: list[Any] = []  # per row, batch dimension 1 (None before prefill)
        self.prefilled: list[bool] = []
        self.kind = kind or Kind()
        # bumped when selections (or the rows) change, and when the block table changes: the
        # fused ops' cached arguments key on them
        self.version = self.table_version = 0

    def allocate(self, batch: int, like: torch.Tensor) -> None:
        """Empty slots for ``batch`` rows shaped like ``like`` [*, H, *, D]."""
        self.sink_len, self.res_len, self.pages, self.held = [], [], [], []
        self.dropped, self.selections, self.prefilled = [], [], []
        self.dtype = like.dtype
        self.arena.allocate(like.shape[1], batch * self.row_slots, like.shape[-1],
                            self.method.slot_dtype(self.dtype), like.device)
        self.add_rows(batch)

    @property
    def keys(self) -> torch.Tensor | None:  # [1, H, N, D]
        return self.arena.keys

    @property
    def values(self) -> torch.Tensor | None:
        return self.arena.values

    @property
    def offset(self) -> list[int]:
        """Per row, where its extent starts in the arena."""
        return self.arena.offset

    @property
    def capacity(self) -> list[int]:
        """Per row, the slots of its extent."""
        return self.arena.capacity

    # -- rows joining and leaving (continuous batching) ----------------------------------------

    @property
    def row_slots(self) -> int:
        """The most slots a row holds: its sink and residual."""
        return self.method.sink + self.method.residual

    @property
    def slot_capacity(self) -> int:
        """Slots the arena holds (rows' or free)."""
        return self.arena.slots

    def add_rows(self, count: int, capacity: list[int] | None = None) -> None:
        """``count`` empty rows after the last (requests admitted), each with slots for
        ``capacity`` tokens (a whole sink and residual by default; fewer for a request that
        will never hold them): extents placed first fit, so a join copies no other row's
        slots but when the rows are compacted."""
        self.arena.add([self.row_slots] * count if capacity is None else [
            min(c, self.row_slots) for c in capacity])  # may compact the rows
        for name, empty in (("sink_len", 0), ("res_len", 0), ("dropped", 0),
                            ("selections", None), ("prefilled", False)):
            getattr(self, name).extend([empty] * count)
        self.pages += [[] for _ in range(count)]
        self.held += [[] for _ in range(count)]
        self._changed()

    def resize_slots(self, slots: int, fixed: bool = True) -> None:
        """An arena of exactly ``slots`` slots (at least the rows' extents), the rows compacted
        into it; ``fixed``: it never grows (``add_rows`` beyond it is refused)."""
        self.arena.resize(slots, fixed)
        self._changed()

    def renumber(self, moved: dict[int, int]) -> None:
        """The pool moved pages (``PagePool.resize``: {old id: new id}): the block table
        follows."""
        if moved:
            self.pages = [[moved.get(page, page) for page in pages] for pages in self.pages]
            self.table_version += 1

    def remove_row(self, b: int) -> int:
        """Row ``b`` leaves (a request ended): its pages go back to the pool, its extent is
        free, and the last row takes its index (no slot is copied) -> the index the moved row
        had."""
        last = self.batch - 1
        self.pool.release(self.pages[b])
        for name in ("sink_len", "res_len", "pages", "held", "dropped", "selections",
                     "prefilled"):
            rows = getattr(self, name)
            rows[b] = rows[last]
            rows.pop()
        self.arena.remove(b)
        self._changed()
        return last

    def fork(self, b: int, count: int) -> None:
        """``count`` new rows after the last, each a copy of row ``b`` (choices of one prompt):
        its sealed pages shared (reference counts), its float slots and selection copied."""
        first = self.batch
        self.add_rows(count, [self.capacity[b]] * count)
        for r in range(first, first + count):
            self.arena.copy(b, r)
            self.pool.retain(self.pages[b])
            self.pages[r], self.held[r] = list(self.pages[b]), list(self.held[b])
            for name in ("sink_len", "res_len", "dropped", "prefilled"):
                getattr(self, name)[r] = getattr(self, name)[b]
            self.selections[r] = map_tensors(self.selections[b], torch.clone)
        self._changed()

    def slots(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``b``'s extent of the arena: keys, values [H, capacity, D] (views)."""
        return self.arena.views(b)

    def _changed(self) -> None:
        """Rows or extents changed: the fused ops' cached arguments are stale."""
        self.version += 1
        self.table_version += 1

    @property
    def steps(self) -> StepMeta:
        """The decode-step metadata of this store's kind (kept outside the cache)."""
        return meta(self.kind)

    @property
    def step(self) -> Step | None:
        """The last decode step's metadata on the device (slots, spans, skips): tensors the
        layers of the kind share, valid until another layer's step uploads other lists."""
        return self.steps.current(self)

    @property
    def batch(self) -> int:
        return len(self.sink_len)

    def tokens(self, b: int) -> int:
        """Tokens row ``b`` holds."""
        return self.sink_len[b] + sum(self.held[b]) + self.res_len[b]

    def seen(self, b: int) -> int:
        """Tokens row ``b`` has committed: held and released."""
        return self.tokens(b) + self.dropped[b]

    def visible_from(self, b: int) -> int:
        """The first position the newest held token of row ``b`` sees (0 without a window)."""
        return 0 if self.window is None else max(self.seen(b) - self.window, 0)

    def positions(self, b: int, device: torch.device) -> torch.Tensor:
        """Positions of the tokens row ``b`` holds, in history order (sink, pages, residual)."""
        sink = self.sink_len[b]
        return torch.cat([torch.arange(sink, device=device),
                          torch.arange(sink + self.dropped[b], self.seen(b), device=device)])

    def row(self, b: int) -> RowView:
        return RowView(self, b)

    # -- writing: any number of new tokens per row ---------------------------------------------

    def append(self, new: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
               rows: range | None = None) -> None:
        """Per row (every row, or ``rows``), its new real tokens after their attention: keys,
        values [1, H, n, D] (keys in the cache's key space) and queries [1, Hq, n, D]. Selects at
        a row's first tokens, fills sinks, and seals every full group of those rows in one
        ``encode`` call."""
        rows = range(self.batch) if rows is None else rows
        plans = [self._place(b, k.shape[-2]) for b, (k, _, _) in zip(rows, new, strict=True)]
        self._check_room([p.row for p in plans if self._slots_after(p) > self.capacity[p.row]])
        self.pool.reserve(sum(p.blocks - p.dropped for p in plans))  # refuse before any change
        joined = [self._joined(p.row, k[0], v[0]) for p, (k, v, _) in zip(plans, new,
                                                                          strict=True)]
        sealed = []
        for plan, (keys, values), (new_keys, new_values, queries) in zip(plans, joined, new,
                                                                          strict=True):
            if new_keys.shape[-2]:
                self._observe(plan.row, new_keys, new_values, queries)
                sealed += self._lay_out(plan, keys, values)
        if sealed:
            rows_sealed, keys, values = zip(*sealed, strict=True)
            self._seal(list(rows_sealed), [k.shape[0] for k in keys], torch.cat(keys),
                       torch.cat(values))
        self._slide(rows)

    def _place(self, b: int, n: int) -> Placement:
        """The flush rule in closed form for ``n`` more tokens of row ``b``."""
        m = self.method
        room = m.sink - self.sink_len[b] if not self.pages[b] else 0
        into_sink = min(max(room, 0), self.res_len[b] + n)
        rest = self.res_len[b] + n - into_sink
        blocks = sealed_groups(m, rest)
        dropped = 0
        if self.window is not None:  # groups whose last token the next query cannot see
            start = self.sink_len[b] + into_sink + self.dropped[b] + sum(self.held[b])
            edge = self.seen(b) + n - self.window + 1  # the next query's first visible position
            dropped = min(max((edge - start) // m.group, 0), blocks)
        return Placement(b, into_sink, blocks, rest - blocks * m.group, dropped)

    def _slots_after(self, plan: Placement) -> int:
        """Slots of its extent row ``plan.row`` fills after ``plan``."""
        if plan.residual:
            return self.method.sink + plan.residual
        return self.sink_len[plan.row] + plan.sink

    def _check_room(self, rows: list[int]) -> None:
        """A ``RowFault`` if ``rows`` (rows whose tokens would outgrow their extents) is not
        empty: a request holds no more tokens than it was admitted with."""
        if rows:
            b = rows[0]
            raise RowFault(f"row {b} has float slots for {self.capacity[b]} tokens (its "
                           "admitted length) and would hold more (layer "
                           f"{self.layer})", rows)

    def _joined(self, b: int, keys: torch.Tensor, values: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``b``'s residual followed by its new tokens, keys, values [H, r + n, D]."""
        s, r = self.method.sink, self.res_len[b]
        slot_keys, slot_values = self.slots(b)
        return (torch.cat([slot_keys[:, s : s + r], keys.to(slot_keys.dtype)], dim=1),
                torch.cat([slot_values[:, s : s + r], values.to(slot_values.dtype)], dim=1))

    def _lay_out(self, plan: Placement, keys: torch.Tensor, values: torch.Tensor):
        """Row ``plan.row``'s residual and new tokens (``_joined``, [H, r + n, D]) into sink,
        groups to seal (-> [] or [(row, keys, values [n_blocks, H, G, D])]) and residual."""
        b, m, s = plan.row, self.method, self.method.sink
        at = self.sink_len[b]
        slot_keys, slot_values = self.slots(b)
        slot_keys[:, at : at + plan.sink] = keys[:, : plan.sink]
        slot_values[:, at : at + plan.sink] = values[:, : plan.sink]
        self.sink_len[b] += plan.sink
        cut = _cut(m, plan)
        tail = slice(cut, cut + plan.residual)
        slot_keys[:, s : s + plan.residual] = keys[:, tail]
        slot_values[:, s : s + plan.residual] = values[:, tail]
        self.res_len[b] = plan.residual
        if plan.dropped:  # past the window at once: the pages before them go too
            self._release_front(b, len(self.pages[b]))
            self.dropped[b] += plan.dropped * m.group
        if plan.blocks == plan.dropped:
            return []
        first = plan.sink + plan.dropped * m.group
        blocks = [x[:, first:cut].unflatten(1, (plan.blocks - plan.dropped, m.group))
                  .transpose(0, 1) for x in (keys, values)]  # [n_blocks, H, G, D]
        return [(b, *blocks)]

    def _observe(self, b: int, keys: torch.Tensor, values: torch.Tensor,
                 queries: torch.Tensor) -> None:
        if not self.prefilled[b]:  # the prompt: selection from its queries and keys, once
            self.selections[b] = self.method.select(queries, keys, self.layer, values)
            self.prefilled[b] = True
        else:
            self.selections[b] = self.method.observe(self.selections[b], queries, keys,
                                                     self.layer)
        self.version += 1

    # -- writing: one token per row (a decode step) --------------------------------------------

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """One new token per row, keys, values [B, H, 1, D], into its sink or residual slot,
        through the step's slot index on the device (``self.step``, uploaded once per step for
        every layer of the kind): no host value of the step reaches the launch."""
        step = self.steps.advance(self, [self.offset[b] + self._slot(b)
                                         for b in range(self.batch)])
        self.arena.put(step.slots, keys[:, :, 0], values[:, :, 0])

    def counts(self) -> tuple[list[int], list[int]]:
        """Every row's sink and residual lengths (what a decode step's ``write`` changes)."""
        return list(self.sink_len), list(self.res_len)

    def restore(self, counts: tuple[list[int], list[int]]) -> None:
        """Undo the ``write`` of a step not flushed yet: the lengths of ``counts``; the slots
        past them hold nothing."""
        rows = len(counts[0])
        self.sink_len[:rows], self.res_len[:rows] = counts
        self.version += 1
        self.table_version += 1

    def reserve_step(self) -> None:
        """Room in every row's extent for its next token, and in the pool for the pages a
        decode step will seal, or an error before anything changes."""
        self._check_room([b for b in range(self.batch) if self._next_slot(b) >= self.capacity[b]])
        full = self.method.residual - 1
        self.pool.reserve(sum(self._to_residual(b) and self.res_len[b] >= full
                              for b in range(self.batch)))

    def _to_residual(self, b: int) -> bool:
        """Whether row b's next token enters the residual (else the sink, while it fills)."""
        return bool(self.pages[b]) or self.res_len[b] > 0 or self.sink_len[b] >= self.method.sink

    def _next_slot(self, b: int) -> int:
        """Row ``b``'s slot for its next token, in its extent."""
        if not self._to_residual(b):
            return self.sink_len[b]
        return self.method.sink + self.res_len[b]

    def _slot(self, b: int) -> int:
        """Row ``b``'s next token enters its slot (``_next_slot``): its counts advance."""
        slot = self._next_slot(b)
        if self._to_residual(b):
            self.res_len[b] += 1
        else:
            self.sink_len[b] += 1
        return slot

    def sealing(self, queries: torch.Tensor, keys: torch.Tensor) -> Sealing:
        """What committing a decode step (its new tokens written: queries [B, Hq, 1, D], keys
        [B, H, 1, D]) will change, computed with nothing changed: every row's selection after
        the step (online selection sees each row's new token) and, for every row whose
        residual is full, its oldest group encoded, in one ``encode`` call (no host sync: the
        step's tokens were validated on the device, ``peak``). What can fail fails here."""
        selections = self.selections
        if self.method.follows_decoding():
            selections = [self.method.observe(self.selections[b], queries[b : b + 1],
                                              keys[b : b + 1], self.layer)
                          for b in range(self.batch)]
        full = [b for b in range(self.batch) if self.res_len[b] >= self.method.residual]
        if not full:
            return Sealing(selections, full, None, None)
        self.pool.reserve(len(full))  # the pool may grow: no token changes place
        m = self.method
        residuals = torch.tensor([[self.offset[b] + m.sink + i for i in range(m.residual)]
                                  for b in full], dtype=torch.long, device=self.keys.device)
        blocks = self._encode(full, [1] * len(full), *(  # [n, G, H, D] -> [n, H, G, D]
            x.transpose(1, 2).contiguous() for x in self.arena.take(residuals[:, : m.group])),
            selections)
        return Sealing(selections, full, residuals, blocks)

    def keep(self, sealing: Sealing) -> None:
        """Apply a step's ``sealing`` (nothing here can fail): the selections, each full row's
        oldest group into a page and its residual moved up; then the pages the next query of
        a sliding-window layer cannot see are released."""
        if self.method.follows_decoding():
            self.selections = sealing.selections
            self.version += 1
        if sealing.full:
            m, full, residuals = self.method, sealing.full, sealing.residuals
            self.arena.move(residuals[:, : m.residual - m.group], residuals[:, m.group :])
            for b in full:
                self.res_len[b] -= m.group
            self._store_pages(full, [1] * len(full), sealing.blocks)
        self._slide(range(self.batch))

    # -- the window ----------------------------------------------------------------------------

    def _slide(self, rows) -> None:
        """Release the leading pages of ``rows`` that the next query of a sliding-window layer
        cannot see (their last token is before its window)."""
        if self.window is None:
            return
        for b in rows:  # one comparison per row unless a page goes
            edge = self.seen(b) - self.window + 1
            start, count = self.sink_len[b] + self.dropped[b], 0
            for held in self.held[b]:
                if start + held > edge:
                    break
                start, count = start + held, count + 1
            self._release_front(b, count)

    def _release_front(self, b: int, count: int) -> None:
        if count:
            self.pool.release(self.pages[b][:count])
            self.dropped[b] += sum(self.held[b][:count])
            self.pages[b], self.held[b] = self.pages[b][count:], self.held[b][count:]
            self.table_version += 1

    # -- sealing -------------------------------------------------------------------------------

    def _seal(self, rows: list[int], counts: list[int], keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """Groups of ``rows`` (``counts`` each, in order), keys, values [n, H, G, D] -> pages,
        in one ``encode`` call (validated by the caller: a prompt's before any change)."""
        if rows:
            self._store_pages(rows, counts, self._encode(rows, counts, keys, values,
                                                         self.selections))

    def _encode(self, rows: list[int], counts: list[int], keys: torch.Tensor,
                values: torch.Tensor, selections: list[Any]) -> Blocks:
        """Groups of ``rows`` (``counts`` each), keys, values [n, H, G, D] in the slots' dtype
        -> the method's state of n pages, each group with its row's selection."""
        keys, values = keys.to(self.dtype), values.to(self.dtype)  # from the slots' dtype
        chosen = [selections[b] for b, n in zip(rows, counts, strict=True) for _ in range(n)]
        selection = None if all(c is None for c in chosen) else combine(chosen, torch.cat)
        return Blocks(*self.method.encode(keys, values, self.layer, selection))

    def _store_pages(self, rows: list[int], counts: list[int], blocks: Blocks) -> None:
        """Encoded groups (``_encode``) into the pool, appended to their rows' block tables."""
        ids = self.pool.write(blocks)
        for b, count in zip(rows, counts, strict=True):
            self.pages[b] += ids[:count]
            self.held[b] += [self.method.group] * count
            ids = ids[count:]
        self.table_version += 1

    # -- reading -------------------------------------------------------------------------------

    def float_spans(self) -> list[tuple[int, int, int, int]]:
        """Per row (sink start, sink length, residual start, residual length) in the arena:
        what the newest held token sees."""
        s, o, spans = self.method.sink, self.offset, []
        if self.window is None:  # every decode step: no per-row count of held tokens
            return [(o[b], self.sink_len[b], o[b] + s, self.res_len[b])
                    for b in range(self.batch)]
        for b in range(self.batch):
            edge, sink, residual = self.visible_from(b), self.sink_len[b], self.res_len[b]
            hidden_sink = min(edge, sink)
            hidden_residual = min(max(edge - (self.seen(b) - residual), 0), residual)
            spans.append((o[b] + hidden_sink, sink - hidden_sink, o[b] + s + hidden_residual,
                          residual - hidden_residual))
        return spans

    def skips(self) -> list[int]:
        """Per row, tokens at the front of its first page the newest held token cannot see."""
        return [min(max(self.visible_from(b) - self.sink_len[b] - self.dropped[b], 0),
                    self.held[b][0]) if self.held[b] else 0 for b in range(self.batch)]

    # -- editing -------------------------------------------------------------------------------

    def truncate(self, b: int, length: int) -> None:
        """Keep row ``b``'s first ``length`` real tokens, in order."""
        if self.dropped[b]:
            if length < self.sink_len[b] + self.dropped[b]:
                raise ValueError(f"cannot keep {length} tokens of a sliding-window layer: the "
                                 f"window has released tokens {self.sink_len[b]} to "
                                 f"{self.sink_len[b] + self.dropped[b] - 1}")
            length -= self.dropped[b]
        self.sink_len[b] = min(length, self.sink_len[b])
        left = length - self.sink_len[b]
        held: list[int] = []
        for tokens in self.held[b]:
            if left <= 0:
                break
            held.append(min(tokens, left))
            left -= held[-1]
        self.pool.release(self.pages[b][len(held):])
        self.pages[b], self.held[b] = self.pages[b][: len(held)], held
        self.res_len[b] = min(max(left, 0), self.res_len[b])
        self.table_version += 1

    def pick(self, index: list[int]) -> None:
        """Rows in a new order (beams, repeats, a selection). Pages are shared, counted once per
        holder; float slots and selections are copied (a row used twice owns its own)."""
        if self.keys is None:
            return
        self.arena.pick(index)
        self._changed()
        old = self.pages
        self.pages = [list(old[b]) for b in index]
        for pages in self.pages:
            self.pool.retain(pages)
        for pages in old:
            self.pool.release(pages)
        used: set[int] = set()
        selections = []
        for b in index:
            selection = self.selections[b]
            selections.append(map_tensors(selection, torch.clone) if b in used else selection)
            used.add(b)
        self.selections = selections
        for name in ("sink_len", "res_len", "prefilled", "dropped"):
            setattr(self, name, [getattr(self, name)[b] for b in index])
        self.held = [list(self.held[b]) for b in index]

    def to(self, device: torch.device | str) -> None:
        moved = functools.partial(map_tensors, fn=lambda t: t.to(device, non_blocking=True))
        self.arena.to(device)
        self._changed()
        self.selections = [moved(s) for s in self.selections]
        self.version += 1

    # -- bytes ---------------------------------------------------------------------------------

    def breakdown(self) -> Counter:
        """Bytes of the slots and selections by kind: ``sink``, ``residual``, ``masks`` and
        ``free`` (slots no token fills); the pool reports its own."""
        total: Counter = Counter()
        if self.keys is None:
            return total
        slot = self.arena.token_bytes()  # one token's keys and values
        sink, residual = sum(self.sink_len), sum(self.res_len)
        capacity = self.arena.nbytes() // slot  # every slot of the arena, rows' or not
        total["sink"] += slot * sink
        total["residual"] += slot * residual
        total[FREE] += slot * (capacity - sink - residual)
        for selection in self.selections:
            for kind, t in tagged_tensors(selection, "masks"):
                total[kind] += storage_bytes(t)
        return total

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the store holds itself (the pool's pages aside)."""
        return self.arena.tensors() + [t for s in self.selections for _, t in tagged_tensors(s, "")]


class RowView:
    """One sequence of a ``BatchStore``, read-only: its segments as views of the slots and its
    pages gathered (a copy) — for the reference path, per-sequence kernels and tests."""

    def __init__(self, store: BatchStore, b: int):
        self.store, self.b = store, b
        self.method, self.layer = store.method, store.layer
        self.lengths = list(store.held[b])
        self.selection = store.selections[b]
        self.prefilled = store.prefilled[b]

    def __len__(self) -> int:
        return self.store.tokens(self.b)

    @property
    def seen(self) -> int:
        """Tokens committed (held, and released behind a sliding window)."""
        return self.store.seen(self.b)

    def hides(self, queries: int) -> bool:
        """Whether a sliding window hides a held token from one of ``queries`` new queries."""
        window = self.store.window
        return window is not None and self.seen + queries > window

    @property
    def sink_keys(self) -> torch.Tensor:  # [1, H, s, D]
        return self._slots(self.store.keys, 0, self.store.sink_len[self.b])

    @property
    def sink_values(self) -> torch.Tensor:
        return self._slots(self.store.values, 0, self.store.sink_len[self.b])

    @property
    def res_keys(self) -> torch.Tensor:  # [1, H, r, D]
        return self._slots(self.store.keys, self.method.sink, self.store.res_len[self.b])

    @property
    def res_values(self) -> torch.Tensor:
        return self._slots(self.store.values, self.method.sink, self.store.res_len[self.b])

    def _slots(self, arena: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """Slots ``[start, start + count)`` of the row's extent: a view [1, H, count, D]."""
        at = self.store.offset[self.b] + start
        return arena[:, :, at : at + count]

    @functools.cached_property
    def blocks(self) -> Blocks | None:
        """The row's pages as the method's state, tensors [1, n, ...] (a copy), or None."""
        pages = self.store.pages[self.b]
        if not pages:
            return None
        return map_tensors(self.store.pool.gather(pages), lambda t: t.unsqueeze(0))

    def history(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference path: every held token, pages decoded -> keys, values [1, H, L, D]."""
        keys, values = self.decode_blocks(dtype)
        keys = torch.cat([self.sink_keys.to(dtype), keys, self.res_keys.to(dtype)], dim=-2)
        values = torch.cat([self.sink_values.to(dtype), values, self.res_values.to(dtype)],
                           dim=-2)
        return keys, values

    def decode_blocks(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """All pages in one decode call -> keys, values: [1, H, sum(lengths), D]."""
        if self.blocks is None:
            return (self.sink_keys[..., :0, :].to(dtype),
                    self.sink_values[..., :0, :].to(dtype))
        keys, values = self.method.decode(self.blocks, self.layer, self.selection, dtype)
        keys, values = (x.transpose(1, 2).flatten(2, 3) for x in (keys, values))  # [1, H, n*G, D]
        if sum(self.lengths) < len(self.lengths) * self.method.group:  # a crop ended in a page
            held = self._held_positions(keys.device)
            keys, values = keys.index_select(2, held), values.index_select(2, held)
        return keys, values

    def _held_positions(self, device: torch.device) -> torch.Tensor:
        g = self.method.group
        return torch.cat([torch.arange(i * g, i * g + n, device=device)
                          for i, n in enumerate(self.lengths)])


class RowFault(ValueError):
    """Tokens of some rows were refused before anything changed: ``rows``, the store's rows
    they belong to (the other rows' tokens are not in question)."""

    def __init__(self, message: str, rows: list[int]):
        super().__init__(message)
        self.rows = rows


def _cut(method: Method, plan: Placement) -> int:
    """Where a row's groups to seal end in its residual followed by its new tokens."""
    return plan.sink + plan.blocks * method.group


def stored(x: torch.Tensor, method: Method) -> torch.Tensor:
    """New keys or values as the float slots keep them (rounded to the method's slot dtype), in
    their own dtype: what every path attends, so a token reads the same before and after it
    enters its slot."""
    slot = method.slot_dtype(x.dtype)
    return x if slot == x.dtype else x.to(slot).to(x.dtype)


def check_finite(keys: torch.Tensor, values: torch.Tensor, layer: int,
                 rows: list[int] | None = None) -> None:
    """An error naming the layer if any key or value is inf or NaN (a ``RowFault`` of
    ``rows``, the rows they belong to). One fused test per call (a sum is non-finite when any
    element is, or on overflow, then checked precisely). Meta tensors hold no values."""
    if keys.is_meta or torch.isfinite(keys.sum(dtype=torch.float32) +
                                      values.sum(dtype=torch.float32)):
        return
    for name, x in (("keys", keys), ("values", values)):
        if not torch.isfinite(x).all():
            raise RowFault(f"non-finite {name} in layer {layer}: kvmix keeps finite values "
                           "only (check the model's dtype and inputs)", rows or [])


def peak(keys: torch.Tensor, values: torch.Tensor, running: torch.Tensor | None
         ) -> torch.Tensor:
    """The largest magnitude seen so far, a device scalar (NaN once any value was NaN): no
    host sync. keys, values: any shape."""
    top = torch.maximum(torch.linalg.vector_norm(keys.float(), float("inf")),
                        torch.linalg.vector_norm(values.float(), float("inf")))
    return top if running is None else torch.maximum(running, top)


def row_peaks(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Each row's largest magnitude, keys and values [B, ...] -> [B] float32 (NaN where a value
    is NaN): a step's tokens validated on the device, per row, without a host sync."""
    def top(x: torch.Tensor) -> torch.Tensor:
        return x.float().abs().flatten(1).amax(1)

    return torch.maximum(top(keys), top(values))


def check_float16_range(keys: torch.Tensor, values: torch.Tensor, layer: int,
                        rows: list[int] | None = None) -> None:
    """Quantized blocks keep float16 statistics: values beyond ±65504 cannot be stored (a
    ``RowFault`` of ``rows``; meta or empty tensors hold no values to check)."""
    for name, x in (("keys", keys), ("values", values)):
        if x.is_meta or not x.numel():
            continue
        peak = x.abs().amax().item()
        if peak > FLOAT16_MAX:
            raise RowFault(f"{name} in layer {layer} reach {peak:.3g}, beyond the float16 range "
                           f"(±{FLOAT16_MAX:.0f}) of the stored scales and minimums; use "
                           "method 'full' for this model", rows or [])
