"""One vLLM step for every layer: where each new token goes, which groups it seals, what each
row attends to — built once per step on the host by the backend's metadata builder, a pure
function of the step's inputs and the slots its open groups are staged in, and read by every
layer.

Per row (a request in the step) with ``c`` tokens computed before and ``n`` new ones, and
``G`` tokens per group:

* its history is the pages of its groups ``0 .. c // G - 1``, sealed in earlier steps, found
  through vLLM's block table;
* the ``c % G`` tokens of its open group wait as floats in a staging slot (``RequestSlots``:
  its request's slot in vLLM's model runner; ``PageSlots``: a slot found by the open group's
  page, on runners that give a backend no request identity);
* every group the new tokens complete is sealed this step: its staged tokens and its new ones
  gathered into one float group, all rows' groups encoded in one call;
* the new tokens of a group still open go to its staging slot.

Each new token attends as a decode at its position would: to the groups before its own, packed
(sealed earlier or in this step), and to its own group's tokens up to it, as floats — read
where they lie: the staged ones in the staging, the new ones in the step's tokens. With the
fused kernels every such token is a row of one kernel call (``KernelRows``), a prefill chunk's
tokens as much as a decode's: a token's output is then the same attention however it is
scheduled, equal up to float32 reassociation (the op's work splits follow the batch). A prompt's
outputs do not depend on how vLLM chunks it, on how much of it came from the prefix cache, or on
a preemption's recomputation (which attends again, as a prefill, tokens first decoded), even
where the kernels round differently from the reference path (the CPU op's integer dot
products).

A row's first group also decides its selection (PN-Mix's pairs, ...): the query sums of its
tokens are kept with the slot until the group is sealed (``QuerySums``), and a row's later
groups copy the selection from its first page.

A plan is grouped by who reads it, each group built only in a step that runs its reader, and
every array named with the index space it lives in: R the step's rows (requests), N its tokens,
E the groups it seals, K the kernel rows. Where the CPU op reads it, the op library plans the
step in one call (``kvmix::plan_step``, with the rows as ``kvmix::step`` reads them);
elsewhere ``reference_plan`` does in numpy, its arrays reaching the device in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

QUERY_TOKENS = 64  # a chunk's queries attend in blocks of about this many positions


class StagingLost(RuntimeError):
    """A running request's open group is no longer staged (see ``PageSlots.take``)."""


# -- the step's inputs ------------------------------------------------------------------------


@dataclass(frozen=True)
class Readers:
    """What reads a plan, fixed for an engine: ``group`` tokens a page, ``block_size`` tokens a
    vLLM block, the ``kernels`` decode rows go through (``cpu``, ``triton`` or ``torch``: the
    reference path; the CPU op stages the new tokens itself), ``exact`` (a prompt's first chunk
    attends in float), ``token_values``
    (values go to pages as they arrive), ``sums`` (the method keeps query sums of first groups)
    and ``selects`` (pages carry a selection)."""

    group: int
    block_size: int
    kernels: str = "cpu"
    exact: bool = False
    token_values: bool = False
    sums: bool = False
    selects: bool = False

    @property
    def fused(self) -> bool:
        """Prefill chunks' tokens are kernel rows too (the fused kernels attend them)."""
        return self.kernels != "torch"


class Rows:
    """A step's R rows on the host (int64): ``starts`` [R + 1] each row's first token (vLLM's
    query_start_loc), ``lengths`` [R] the tokens it holds after the step (seq_lens),
    ``block_table`` [R, W], ``requests`` [R] its request slot in vLLM's model runner (Model
    Runner V2's ``req_idx``) or None; ``group`` tokens a page, ``block_size`` a block. Derived,
    per row: ``new`` tokens, tokens held ``before`` the step, the group ``opened`` before it,
    the groups ``done`` after it and the tokens ``staged`` before it."""

    def __init__(self, starts: np.ndarray, lengths: np.ndarray, block_table: np.ndarray,
                 group: int, block_size: int, requests: np.ndarray | None = None):
        self.starts, self.lengths, self.block_table = starts, lengths, block_table
        self.group, self.block_size, self.requests = group, block_size, requests
        self.count = len(lengths)
        self.new = np.diff(starts)
        self.before = lengths - self.new
        self.opened, self.staged = np.divmod(self.before, group)
        self.done = lengths // group

    def page(self, row: np.ndarray, g: np.ndarray) -> np.ndarray:
        """The page of group ``g`` of row ``row`` (arrays of one shape)."""
        tokens = g * self.group
        return (self.block_table[row, tokens // self.block_size] * (self.block_size // self.group)
                + tokens % self.block_size // self.group)


# -- staging slots ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Slots:
    """A step's staging slots, [R]: the slot holding each row's open group before the step and
    after it (-1: none), and the slot book once the step has run (``PageSlots`` only)."""

    before: np.ndarray
    after: np.ndarray
    book: PageSlots | None = None


class RequestSlots:
    """A row's staging slot is its request's slot in vLLM's model runner (``req_idx``): held by
    the request from its first step to vLLM's removal of it (finished, aborted or preempted),
    scheduled in a step or not, and handed to the next request only then. Nothing to keep."""

    @staticmethod
    def assign(rows: Rows) -> Slots:
        return Slots(np.where(rows.staged > 0, rows.requests, -1),
                     np.where(rows.lengths % rows.group > 0, rows.requests, -1))


class PageSlots:
    """Staging slots found by the open group's page (vLLM's V1 runner gives a backend no
    request identity; a page being filled belongs to one request): ``slots`` slots, one per
    running sequence (vLLM runs at most ``max_num_seqs``), ``page_of`` [slots] the page whose
    open group each holds (-1: free).

    A slot is taken when a group opens and given back when it is sealed. A request that ends
    (or is preempted) with an open group leaves its slot behind: it is given back when its page
    is used again, or, when every slot is taken, the slot no row of the step uses that was used
    longest ago is reclaimed. A row that then finds its open group gone raises ``StagingLost``
    (it never attends to another sequence's tokens).

    ``assign`` is pure: it returns the step's slots and the book as it will be once the step
    has run, which ``commit`` adopts; ``assign_by_op`` is the same assignment by the op
    library, in one call."""

    def __init__(self, slots: int):
        self.slots = slots
        self.page_of = np.full(slots, -1, dtype=np.int64)
        self.used = np.zeros(slots, dtype=np.int64)  # per slot: the last step that used it
        self.step = 0

    def assign(self, rows: Rows) -> Slots:
        every, staged = np.arange(rows.count), rows.staged
        has = staged > 0
        before = np.full(rows.count, -1, dtype=np.int64)
        before[has] = self.find(rows.page(every[has], rows.opened[has]))
        lost = has & (before < 0)
        if lost.any():
            raise _reclaimed(int(lost.sum()))
        sealing = rows.done > rows.opened
        tail = rows.lengths % rows.group > 0
        continuing = tail & ~sealing & has
        opening = tail & ~continuing
        after = np.where(continuing, before, -1)
        book = self._copy()
        # the slots of groups sealed now are free for groups opening now (a layer reads every
        # staged token before it stages new ones), and stale slots of ended requests go back
        count = rows.done - rows.opened
        entry_row = np.repeat(every, count)
        book.give_back(rows.page(entry_row, _entry_groups(rows.opened, count)))
        after[opening] = book.take(rows.page(every[opening], rows.done[opening]),
                                   keep=before[continuing])
        book.touch(np.concatenate([before, after]))
        return Slots(before, after, book)

    def assign_by_op(self, rows: Rows) -> Slots:
        """``assign`` by the op library (``kvmix::assign_slots``), in one call."""
        from kvmix.runtime.kernels import cpu

        before, after, page_of, used, lost = cpu.call(
            "assign_slots", *(torch.from_numpy(a) for a in (rows.starts, rows.lengths,
                                                            rows.block_table, self.page_of,
                                                            self.used)),
            self.step, rows.group, rows.block_size)
        if lost:
            raise _reclaimed(lost) if lost > 0 else _too_few(-lost, self.slots)
        book = PageSlots.__new__(PageSlots)
        book.slots, book.step = self.slots, self.step + 1
        book.page_of, book.used = page_of.numpy(), used.numpy()
        return Slots(before.numpy(), after.numpy(), book)

    def commit(self, slots: Slots) -> None:
        """The step ``slots`` were assigned for has run: its book is the book."""
        self.page_of, self.used, self.step = slots.book.page_of, slots.book.used, slots.book.step

    def find(self, pages: np.ndarray) -> np.ndarray:
        """The slot of each page's open group (-1: none)."""
        order = np.argsort(self.page_of, kind="stable")
        held = self.page_of[order]
        at = np.minimum(np.searchsorted(held, pages), len(held) - 1)
        return np.where(held[at] == pages, order[at], -1) if len(held) else \
            np.full(len(pages), -1, dtype=np.int64)

    def take(self, pages: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """Slots for groups opening at ``pages`` (a page's old slot if it still has one);
        ``keep``: slots this step reads, never reclaimed."""
        slots = self.find(pages)
        need = int((slots < 0).sum())
        free = np.flatnonzero(self.page_of < 0)
        if len(free) < need:
            free = np.concatenate([free, self._reclaim(need - len(free), keep, slots)])
        slots[slots < 0] = free[:need]
        self.page_of[slots] = pages
        return slots

    def give_back(self, pages: np.ndarray) -> None:
        """The groups of ``pages`` are sealed: their slots are free."""
        slots = self.find(pages)
        self.page_of[slots[slots >= 0]] = -1

    def touch(self, slots: np.ndarray) -> None:
        self.step += 1
        self.used[slots[slots >= 0]] = self.step

    def _copy(self) -> PageSlots:
        book = PageSlots.__new__(PageSlots)
        book.slots, book.step = self.slots, self.step
        book.page_of, book.used = self.page_of.copy(), self.used.copy()
        return book

    def _reclaim(self, count: int, keep: np.ndarray, taking: np.ndarray) -> np.ndarray:
        held = np.flatnonzero(self.page_of >= 0)
        held = held[~np.isin(held, np.concatenate([keep, taking]))]
        if len(held) < count:
            raise _too_few(count, self.slots)
        oldest = held[np.argsort(self.used[held], kind="stable")[:count]]
        self.page_of[oldest] = -1
        return oldest


def _reclaimed(rows: int) -> StagingLost:
    return StagingLost(f"kvmix: the open group of {rows} running request(s) was reclaimed "
                       "while they were not scheduled; raise max_num_seqs")


def _too_few(count: int, slots: int) -> StagingLost:
    return StagingLost(f"kvmix: {count} more open groups than staging slots ({slots}, one per "
                       "running sequence): raise max_num_seqs")


class Planner:
    """A step's plan from vLLM's description of it, with its staging slots: vLLM's request
    slots where the runner gives them, else ``PageSlots``, whose assignment is committed once a
    layer has run the step (``StepPlan.ran``) — a plan built again for the same step, or built
    and dropped, is the same plan and changes nothing."""

    def __init__(self, readers: Readers, slots: int, device: torch.device):
        self.readers, self.device = readers, device
        self.book = PageSlots(slots)
        self._pending: tuple[StepPlan, Slots] | None = None

    def plan(self, starts: np.ndarray, lengths: np.ndarray, block_table: np.ndarray,
             requests: np.ndarray | None = None) -> StepPlan:
        """The plan of a step (``Rows``' arrays)."""
        if self._pending is not None and self._pending[0].ran:
            self.book.commit(self._pending[1])
        self._pending = None
        rows = Rows(starts, lengths, block_table, self.readers.group, self.readers.block_size,
                    requests)
        if requests is not None:
            slots = RequestSlots.assign(rows)
        elif self.readers.kernels == "cpu":  # the op library keeps the book
            slots = self.book.assign_by_op(rows)
        else:
            slots = self.book.assign(rows)
        plan = plan_step(rows, slots, self.readers, self.device)
        if slots.book is not None:
            self._pending = plan, slots
        return plan


# -- the plan ---------------------------------------------------------------------------------


@dataclass
class TokenWrites:
    """Where each of the step's N tokens goes, written by every layer: for the CPU op that
    stages them (``by_op``: once every kernel row has read the staging) ``stage_at`` [N] its
    staging position (slot · G + offset; -1: its group is sealed now); for a layer that stages
    them itself the staged tokens ``staged`` [n] and their positions ``staged_at`` [n]; with
    ``values="token"``, ``value_at`` [N] its place in the pool (its group's page · G +
    offset)."""

    stage_at: torch.Tensor | None
    staged: torch.Tensor | None
    staged_at: torch.Tensor | None
    value_at: torch.Tensor | None
    by_op: bool
    all_staged: bool


@dataclass
class Seals:
    """The E groups the step's tokens complete, sealed by every layer: ``pages`` [E],
    ``first_pages`` [E] (their row's first page: the selection they copy); a float buffer
    [E · G] gathers their tokens: the step's ``tokens`` [e] at ``tokens_at`` [e] (entry · G +
    offset) and the staged tokens at staging positions ``carried`` [c] at ``carried_at`` [c];
    ``firsts`` [F] the entries that are their row's first group (they select)."""

    pages: torch.Tensor
    first_pages: torch.Tensor
    tokens: torch.Tensor
    tokens_at: torch.Tensor
    carried: torch.Tensor
    carried_at: torch.Tensor
    firsts: torch.Tensor
    count: int
    selects: bool


@dataclass
class QuerySums:
    """Query sums of first groups (methods that select from them), in a step with tokens of
    first groups: ``restart`` the slots whose group opens now; the step's first-group
    ``tokens`` [f], each added ``into`` [f] its slot or its seal entry (``sealed`` [f], bool);
    per first-group seal entry (``Seals.firsts``) the slot whose sums it adds, ``carried``
    [F] (-1: none)."""

    restart: torch.Tensor
    tokens: torch.Tensor
    into: torch.Tensor
    sealed: torch.Tensor
    carried: torch.Tensor


@dataclass
class KernelRows:
    """The K tokens the fused kernels attend (a decode's token; a fused chunk's tokens): its
    ``tokens`` [K] (its query in the step), the pages of the groups before its own ``table``
    [K, M] (padded with page 0), the tokens each holds ``held`` [K, M] (a group, 0: padding)
    and their count ``counts`` [K], and its own group's floats up
    to it where they lie, ``floats`` [K, 4]: (start, count) of its staged tokens in the staging,
    then (start, count) of its group's new tokens in the step's tokens; ``own_pages`` [K] its
    own group's page (``values="token"``: its values are read there); ``first_pages`` its row's
    first page (its selection; on the host, for methods that select); ``every_token``: the rows
    are the step's tokens in order; ``step_rows``: where the CPU op runs them, the rows with
    the step's token writes and seals as ``kvmix::step`` reads them (``StepRows``, one object
    every layer passes)."""

    tokens: torch.Tensor
    table: torch.Tensor
    held: torch.Tensor
    counts: torch.Tensor
    floats: torch.Tensor
    own_pages: torch.Tensor | None
    first_pages: tuple[int, ...] | None
    every_token: bool
    step_rows: Any = None

    @property
    def count(self) -> int:
        return self.tokens.numel()


@dataclass
class StepPlan:
    """What every layer of a step reads, grouped by reader (None where the step has none):
    ``tokens`` the step's N; ``chunks`` the rows the reference path attends (on the host).
    ``ran``: a layer has run the step (its slot assignment then holds)."""

    tokens: int
    writes: TokenWrites
    seals: Seals | None
    sums: QuerySums | None
    rows: KernelRows | None
    chunks: list[Chunk]
    ran: bool = field(default=False, compare=False)

    @property
    def sealed(self) -> int:
        return 0 if self.seals is None else self.seals.count


@dataclass
class Chunk:
    """A row with several new tokens: tokens [start, stop) of the step, ``before`` tokens held
    before it, the pages of every group complete after the step (host list, those sealed this
    step included), its first page, the slot of its staged tokens (-1: none), and its queries
    in blocks of whole groups."""

    start: int
    stop: int
    before: int
    pages: list[int]
    first: int
    slot: int
    blocks: list[Block]


@dataclass
class Block:
    """Queries [start, stop) of a chunk (offsets in it), all in groups ``g0 .. g1``: they see
    the row's first ``packed`` history tokens (groups before ``g1``, decoded) and the chunk's
    floats [first, last) (its staged tokens, then its new ones), as ``mask`` [stop - start,
    packed + last - first] says (True: seen)."""

    start: int
    stop: int
    packed: int
    first: int
    last: int
    mask: torch.Tensor


def query_blocks(before: int, n: int, G: int, device: torch.device) -> list[Block]:
    """A chunk of ``n`` tokens after ``before`` in blocks of about ``QUERY_TOKENS`` positions
    (whole groups). Each block attends only to the history its last group sees, so a prompt's
    first chunk computes about a quarter of the scores of one call over its whole history."""
    span, opened = G * max(1, QUERY_TOKENS // G), before // G * G  # opened: floats' first
    blocks, a = [], before
    while a < before + n:
        b = min((a // span + 1) * span, before + n)  # positions [a, b)
        position = torch.arange(a, b, device=device)[:, None]  # [q, 1]
        own, packed = position // G, (b - 1) // G * G
        floats = torch.arange(a // G * G, b, device=device)
        mask = torch.cat([torch.arange(packed, device=device) // G < own,
                          (floats >= own * G) & (floats <= position)], 1)
        blocks.append(Block(a - before, b - before, packed, a // G * G - opened, b - opened,
                            mask))
        a = b
    return blocks


@dataclass(frozen=True)
class _Tokens:
    """The step's N tokens on the host: each one's ``row`` [N], the group ``g`` of its position
    in the row, its ``offset`` in it, whether that group is ``sealing`` now and its seal
    ``entry``."""

    row: np.ndarray
    g: np.ndarray
    offset: np.ndarray
    sealing: np.ndarray
    entry: np.ndarray


def plan_step(rows: Rows, slots: Slots, readers: Readers, device: torch.device) -> StepPlan:
    """The plan of one step: a pure function of its ``rows``, their staging ``slots`` and what
    reads it. Where the CPU op reads it, the op library plans it on the host in one call
    (``kvmix::plan_step``, and the rows as ``kvmix::step`` reads them); elsewhere
    ``reference_plan`` does, its arrays reaching ``device`` in one copy."""
    if readers.kernels == "cpu":
        return _host_plan(rows, slots, readers)
    return reference_plan(rows, slots, readers, device)


def _kernel_rows_of(rows: Rows, readers: Readers) -> np.ndarray:
    """Which rows are kernel rows [R] (bool): a decode's, and with the fused kernels a chunk's
    (but a prompt's first chunk where ``exact``); the others are reference-path chunks."""
    return (rows.new == 1) | readers.fused & ~(readers.exact & (rows.before == 0))


def _chunks(rows: Rows, slots: Slots, kernel: np.ndarray | None, device: torch.device
            ) -> list[Chunk]:
    """The rows that are not kernel rows as chunks (None: every row is one)."""
    if kernel is None:
        return []
    return [_chunk(rows, slots, r, device) for r in np.flatnonzero(~kernel)]


def _host_plan(rows: Rows, slots: Slots, readers: Readers) -> StepPlan:
    """``reference_plan``'s plan from the op library's planner (``kvmix::plan_step``), with the
    kernel rows as ``kvmix::step`` reads them (``KernelRows.step_rows``)."""
    from kvmix.runtime.kernels import cpu

    every = readers.fused and not readers.exact  # every row a kernel row
    chunks = _chunks(rows, slots, None if every else _kernel_rows_of(rows, readers),
                     torch.device("cpu"))
    by_op = not chunks and bool(rows.starts[-1] > rows.starts[0])  # it attends and stages all
    arrays, facts, step_rows = cpu.call(
        "plan_step", *(torch.from_numpy(a) for a in (rows.starts, rows.lengths, rows.block_table,
                                                     slots.before, slots.after)),
        rows.group, rows.block_size, readers.fused, readers.exact, by_op, readers.token_values,
        readers.sums, readers.selects)
    (stage_at, staged, staged_at, value_at, pages, first_pages, tokens, tokens_at, carried,
     carried_at, firsts, restart, sum_tokens, into, sealed, sum_carried, row_tokens, table, held,
     counts, floats, own_pages) = arrays
    n, count, has_seals, has_sums, has_rows, every_token, all_staged, first_groups = facts[:8]
    return StepPlan(
        tokens=n,
        writes=TokenWrites(stage_at, staged, staged_at, value_at, by_op=by_op,
                           all_staged=bool(all_staged)),
        seals=Seals(pages, first_pages, tokens, tokens_at, carried, carried_at, firsts,
                    count=count, selects=first_groups > 0) if has_seals else None,
        sums=QuerySums(restart, sum_tokens, into, sealed.bool(), sum_carried)
        if has_sums else None,
        rows=KernelRows(row_tokens, table, held, counts, floats, own_pages,
                        tuple(facts[8:]) if readers.selects else None,
                        every_token=bool(every_token), step_rows=step_rows)
        if has_rows else None,
        chunks=chunks)


def reference_plan(rows: Rows, slots: Slots, readers: Readers, device: torch.device
                   ) -> StepPlan:
    """The plan of one step in numpy (the reference of ``kvmix::plan_step``); its arrays reach
    ``device`` in one copy."""
    G, every = rows.group, np.arange(rows.count)
    count = rows.done - rows.opened  # [R] groups each row seals
    entry_start = np.concatenate([[0], np.cumsum(count)])  # [R + 1]
    row = np.repeat(every, rows.new)
    position = rows.before[row] + np.arange(len(row)) - rows.starts[row]
    g = position // G
    tokens = _Tokens(row, g, position % G, g < rows.done[row],
                     entry_start[row] + g - rows.opened[row])
    kernel = _kernel_rows_of(rows, readers)
    chunks = _chunks(rows, slots, kernel, device)
    attended = np.flatnonzero(kernel[row])  # [K] the kernel rows' tokens
    by_op = readers.kernels == "cpu" and not chunks and len(attended) > 0
    arrays = {
        "writes": _writes(rows, slots, tokens, readers.token_values, by_op),
        "seals": _seals(rows, slots, tokens, count, entry_start) if count.any() else None,
        "sums": _sums(rows, slots, tokens, count, entry_start)
        if readers.sums and (g == 0).any() else None,
        "rows": _kernel_rows(rows, slots, tokens, attended, readers.token_values)
        if len(attended) else None,
    }
    up = _upload(arrays, device)
    return StepPlan(
        tokens=len(row),
        writes=TokenWrites(**up["writes"], by_op=by_op,
                           all_staged=rows.count > 0 and not tokens.sealing.any()),
        seals=None if up["seals"] is None else Seals(
            **up["seals"], count=int(count.sum()),
            selects=bool(len(arrays["seals"]["firsts"]))),
        sums=None if up["sums"] is None else QuerySums(
            **{**up["sums"], "sealed": up["sums"]["sealed"].bool()}),
        rows=None if up["rows"] is None else KernelRows(
            **up["rows"], every_token=rows.count > 0 and bool(kernel.all()),
            first_pages=tuple(rows.page(row[attended], np.zeros_like(attended)).tolist())
            if readers.selects else None),
        chunks=chunks)


def idle_plan(readers: Readers, device: torch.device) -> StepPlan:
    """The plan of a step with no rows: a dummy batch's (it attends to nothing, changes
    nothing)."""
    rows = Rows(np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros((0, 1), np.int64),
                readers.group, readers.block_size)
    empty = np.zeros(0, np.int64)
    return plan_step(rows, Slots(empty, empty), readers, device)


def _writes(rows: Rows, slots: Slots, tokens: _Tokens, token_values: bool,
            by_op: bool) -> dict[str, np.ndarray | None]:
    staging = slots.after[tokens.row] * rows.group + tokens.offset  # [N]
    kept = np.flatnonzero(~tokens.sealing)
    return {"stage_at": np.where(tokens.sealing, -1, staging) if by_op else None,
            "staged": None if by_op else kept, "staged_at": None if by_op else staging[kept],
            "value_at": rows.page(tokens.row, tokens.g) * rows.group + tokens.offset
            if token_values else None}


def _entry_groups(opened: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Each seal entry's group: groups [opened, opened + count) of each row, rows in order."""
    start = np.concatenate([[0], np.cumsum(count)])[:-1]
    return np.repeat(opened, count) + np.arange(count.sum()) - np.repeat(start, count)


def _seals(rows: Rows, slots: Slots, tokens: _Tokens, count: np.ndarray,
           entry_start: np.ndarray) -> dict[str, np.ndarray]:
    G, every = rows.group, np.arange(rows.count)
    entry_row, entry_g = np.repeat(every, count), _entry_groups(rows.opened, count)
    carried = (rows.staged > 0) & (count > 0)  # rows whose staged tokens join a sealed group
    carry_row = np.repeat(every[carried], rows.staged[carried])  # [c]
    carry_offset = np.arange(len(carry_row)) - np.repeat(
        np.concatenate([[0], np.cumsum(rows.staged[carried])])[:-1], rows.staged[carried])
    sealing = tokens.sealing
    return {"pages": rows.page(entry_row, entry_g),
            "first_pages": rows.page(entry_row, np.zeros_like(entry_row)),
            "tokens": np.flatnonzero(sealing),
            "tokens_at": tokens.entry[sealing] * G + tokens.offset[sealing],
            "carried": slots.before[carry_row] * G + carry_offset,
            "carried_at": entry_start[carry_row] * G + carry_offset,
            "firsts": np.flatnonzero(entry_g == 0)}


def _sums(rows: Rows, slots: Slots, tokens: _Tokens, count: np.ndarray,
          entry_start: np.ndarray) -> dict[str, np.ndarray]:
    first = tokens.g == 0
    entry_row = np.repeat(np.arange(rows.count), count)
    first_entry = _entry_groups(rows.opened, count) == 0
    continuing = (count == 0) & (rows.staged > 0)
    opening = (rows.lengths % rows.group > 0) & ~continuing  # groups opening now
    return {"restart": slots.after[opening],
            "tokens": np.flatnonzero(first),
            "into": np.where(tokens.sealing, tokens.entry, slots.after[tokens.row])[first],
            "sealed": tokens.sealing[first],
            "carried": np.where(rows.staged[entry_row] > 0, slots.before[entry_row],
                                -1)[first_entry]}


def _kernel_rows(rows: Rows, slots: Slots, tokens: _Tokens, attended: np.ndarray,
                 token_values: bool) -> dict[str, np.ndarray | None]:
    G = rows.group
    row, g, offset = tokens.row[attended], tokens.g[attended], tokens.offset[attended]
    staged = np.where(g == rows.opened[row], rows.staged[row], 0)  # [K] in the staging
    floats = np.stack([np.where(staged > 0, slots.before[row] * G, 0), staged,
                       attended - (offset - staged), offset - staged + 1], 1)
    width = max(int(g.max(initial=0)), 1)
    grid = np.broadcast_to(np.arange(width), (len(row), width))
    valid = grid < g[:, None]
    table = np.where(valid, rows.page(np.repeat(row[:, None], width, 1), np.where(valid, grid, 0)),
                     0)
    return {"tokens": attended, "table": table, "held": valid * G, "counts": g,
            "floats": floats.reshape(-1, 4),
            "own_pages": rows.page(row, g) if token_values else None}


def _chunk(rows: Rows, slots: Slots, r: int, device: torch.device) -> Chunk:
    done = int(rows.done[r])
    return Chunk(int(rows.starts[r]), int(rows.starts[r + 1]), int(rows.before[r]),
                 rows.page(np.full(done, r), np.arange(done)).tolist(),
                 int(rows.page(np.array([r]), np.array([0]))[0]), int(slots.before[r]),
                 query_blocks(int(rows.before[r]), int(rows.new[r]), rows.group, device))


def _upload(groups: dict[str, dict[str, np.ndarray | None] | None], device: torch.device
            ) -> dict[str, dict[str, torch.Tensor | None] | None]:
    """Every group's arrays on ``device`` as int64, in one copy (views of one tensor of the
    plan's own: a plan stays valid whatever is built after it)."""
    arrays = [np.ascontiguousarray(a, dtype=np.int64) for group in groups.values() if group
              for a in group.values() if a is not None]
    flat = torch.from_numpy(np.concatenate([a.ravel() for a in arrays]) if arrays
                            else np.zeros(0, np.int64))
    if device.type != "cpu":
        flat = flat.pin_memory().to(device, non_blocking=True)
    parts = iter(flat.split([a.size for a in arrays]))
    shapes = iter(a.shape for a in arrays)
    return {name: None if group is None else
            {key: None if a is None else next(parts).view(next(shapes))
             for key, a in group.items()}
            for name, group in groups.items()}
