"""One vLLM step for every layer: where each new token goes, which groups it seals, what each
row attends to — planned once on the host (numpy, no loop over requests) by the backend's
metadata builder and read by every layer.

Per row (a request in the step) with ``c`` tokens computed before and ``n`` new ones, and
``G`` tokens per group:

* its history is the pages of its groups ``0 .. c // G - 1``, sealed in earlier steps, found
  through vLLM's block table;
* the ``c % G`` tokens of its open group wait as floats in a staging slot (``Staging``), found
  by the open group's page;
* every group the new tokens complete is sealed this step: its staged tokens and its new ones
  gathered into one float group, all rows' groups encoded in one call;
* the new tokens of a group still open go to its staging slot.

Each new token attends as a decode at its position would: to the groups before its own, packed
(sealed earlier or in this step), and to its own group's tokens up to it, as floats. With the
fused kernels (``fused``) every such token is a row of one kernel call, a prefill chunk's
tokens as much as a decode's: a token's output is then the same attention however it is
scheduled, equal up to float32 reassociation (the op's work splits follow the batch). A prompt's
outputs do not depend on how vLLM chunks it, on how much of it came from the prefix cache, or on
a preemption's recomputation (which attends again, as a prefill, tokens first decoded), even
where the kernels round differently from the reference path (the CPU op's integer dot
products).

A row's first group also decides its selection (PN-Mix's pairs, ...): the query sums of its
tokens are kept with the slot until the group is sealed (``query_sums``), and a row's later
groups copy the selection from its first page.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from kvmix.runtime import steps

QUERY_TOKENS = 64  # a chunk's queries attend in blocks of about this many positions


class StagingLost(RuntimeError):
    """A running request's open group is no longer staged (see ``Staging.take``)."""


class Staging:
    """Which staging slot holds the open group of which page: ``slots`` slots, one per running
    sequence (vLLM runs at most ``max_num_seqs``), and per page its slot (-1: none).

    A slot is taken when a group opens and given back when it is sealed. A request that ends
    (or is preempted) with an open group leaves its slot behind: it is given back when its page
    is used again, or, when every slot is taken, the slot no row of the step uses that was used
    longest ago is reclaimed. A row that then finds its open group gone raises ``StagingLost``
    (it never attends to another sequence's tokens)."""

    def __init__(self, slots: int, pages: int = 0):
        self.slots = slots
        self.page_of = np.full(slots, -1, dtype=np.int64)  # per slot: its page, -1: free
        self.slot_of = np.full(pages, -1, dtype=np.int64)  # per page: its slot, -1: none
        self.used = np.zeros(slots, dtype=np.int64)  # per slot: the last step that used it
        self.step = 0

    def find(self, pages: np.ndarray) -> np.ndarray:
        """The slot of each page's open group (-1: none)."""
        self._cover(pages)
        return self.slot_of[pages]

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
        self.slot_of[pages] = slots
        return slots

    def give_back(self, pages: np.ndarray) -> None:
        """The groups of ``pages`` are sealed: their slots are free."""
        slots = self.find(pages)
        self.page_of[slots[slots >= 0]] = -1
        self.slot_of[pages] = -1

    def touch(self, slots: np.ndarray) -> None:
        self.step += 1
        self.used[slots[slots >= 0]] = self.step

    def _cover(self, pages: np.ndarray) -> None:
        top = int(pages.max(initial=-1)) + 1
        if top > len(self.slot_of):
            grown = np.full(max(top, 2 * len(self.slot_of)), -1, dtype=np.int64)
            grown[: len(self.slot_of)] = self.slot_of
            self.slot_of = grown

    def _reclaim(self, count: int, keep: np.ndarray, taking: np.ndarray) -> np.ndarray:
        held = np.flatnonzero(self.page_of >= 0)
        held = held[~np.isin(held, np.concatenate([keep, taking]))]
        if len(held) < count:
            raise StagingLost(f"kvmix: {count} more open groups than staging slots "
                              f"({self.slots}, one per running sequence): raise max_num_seqs")
        oldest = held[np.argsort(self.used[held], kind="stable")[:count]]
        self.give_back(self.page_of[oldest])
        return oldest


@dataclass
class StepPlan:
    """What every layer of a step reads: index tensors (int64, ``sum_sealed`` bool, on the
    cache's device: views of one upload) and a few host values.

    Staging slot ``s`` holds its open group at staging positions ``s·G .. s·G + G - 1``.
    Tokens of the step (``*_tokens``: positions in the step's N tokens): those that stay in an
    open group go to staging positions ``staged_positions``; those of a group sealed now to
    position ``seal_at`` (entry · G + offset) of the seal buffer [E · G, 2, H, D], joined by the
    staged tokens at ``carry_positions`` (into ``carry_at``).
    Groups sealed: ``seal_pages`` [E], ``seal_first`` [E] (their row's first page),
    ``first_entries`` (those that are their row's first group: they select).
    Kernel rows (one per token attended by the kernels: a decode row's token, and with
    ``fused`` every token of a prefill chunk): ``decode_tokens`` [Rd] its query; ``table``,
    ``held`` [Rd, M] and ``counts`` [Rd] the pages of the groups before its own; its own group's
    floats up to it in the step's float buffer [U·G] (an entry of G slots per distinct group:
    the staging slot that opens it, ``float_slots`` [U], then the new tokens, each token's at
    ``context_slots`` [Rd]), read through ``spans`` [Rd, 4] (the Triton kernels and the
    reference path). The CPU op reads the same floats where they lie (``inplace_spans`` [Rd,
    4]): the staged tokens of the row's group in the staging (start, count), then its group's
    new tokens up to it in the step's tokens (start, count).
    With ``values="token"`` each new token's values go straight into its group's page: token
    ``i`` of the step at pool position ``value_at[i]`` (page · G + offset), and a kernel row
    reads its own group's values from its page ``own_pages`` [Rd].
    ``tokens``: the step's N; ``every_token``: the kernel rows are the step's tokens in order
    (a decode-only step, or fused chunks only);
    ``all_staged``: every token of the step stays staged; ``selects``: some first group is
    sealed (on the host: none in most steps).
    Other rows (prefill chunks through the reference path): ``chunks``, on the host.
    """

    group: int
    staged_tokens: torch.Tensor
    staged_positions: torch.Tensor
    stage_at: torch.Tensor  # [N] each token's staging position (-1: its group is sealed now)
    seal_tokens: torch.Tensor
    seal_at: torch.Tensor
    carry_positions: torch.Tensor
    carry_at: torch.Tensor
    seal_pages: torch.Tensor
    seal_first: torch.Tensor
    new_slots: torch.Tensor  # slots whose group opens this step (their query sums restart)
    sum_rows: torch.Tensor  # per new token of a first group: its slot, or its seal entry
    sum_tokens: torch.Tensor
    sum_sealed: torch.Tensor  # bool per such token: into a sealed entry (else a slot)
    carry_sums: torch.Tensor  # per sealed first group: the slot whose sums it adds (-1: none)
    value_at: torch.Tensor  # [N] each new token's place in the pool (its group's page · G + offset)
    decode_tokens: torch.Tensor
    own_pages: torch.Tensor  # [Rd] each kernel row's own group's page
    float_slots: torch.Tensor
    context_slots: torch.Tensor
    decode_first: tuple[int, ...]  # each kernel row's first page (its selection), on the host
    table: torch.Tensor
    held: torch.Tensor
    counts: torch.Tensor
    spans: torch.Tensor  # [Rd, 4] what each kernel row reads of the float buffer
    inplace_spans: torch.Tensor  # [Rd, 4] what it reads of the staging and the step's tokens
    tokens: int
    every_token: bool
    all_staged: bool
    first_entries: torch.Tensor
    selects: bool
    chunks: list[Chunk]

    @property
    def sealed(self) -> int:
        return self.seal_pages.numel()


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


def plan_step(staging: Staging, group: int, block_size: int, starts: np.ndarray,
              lengths: np.ndarray, block_table: np.ndarray, device: torch.device,
              fused: bool = False, exact: bool = False,
              requests: np.ndarray | None = None,
              uploads: steps.Staged | None = None) -> StepPlan:
    """The plan of one step. starts [R + 1]: each row's first token (vLLM's query_start_loc);
    lengths [R]: tokens each row holds after the step (seq_lens); block_table [R, W];
    ``fused``: prefill chunks' tokens are kernel rows too, but for a prompt's first chunk when
    it attends in float (``exact``); ``requests`` [R]: each row's request slot in vLLM's model
    runner (Model Runner V2's ``req_idx``), which is then its staging slot: held by the request
    from its first step to vLLM's removal of it (finished, aborted or preempted), scheduled in
    a step or not, and handed to the next request only then — ``staging`` is not used. Without
    it (vLLM's V1 runner) slots follow pages through ``staging``. ``uploads``: the persistent
    device buffer the plan's index tensors are views of (one copy a step; a plan is read
    before the next is made), else a buffer of its own."""
    G, per_block = group, block_size // group
    new = np.diff(starts)  # [R]
    before = lengths - new  # c
    rows = len(new)
    opened, done = before // G, lengths // G  # first open group, groups complete after
    staged = before % G  # o

    def page(row: np.ndarray, g: np.ndarray) -> np.ndarray:
        tokens = g * G
        return block_table[row, tokens // block_size] * per_block + (tokens % block_size) // G

    every = np.arange(rows)
    staged_slots = np.full(rows, -1, dtype=np.int64)
    has = staged > 0
    staged_slots[has] = requests[has] if requests is not None else \
        staging.find(page(every[has], opened[has]))
    lost = has & (staged_slots < 0)
    if lost.any():
        raise StagingLost(f"kvmix: the open group of {int(lost.sum())} running request(s) was "
                          "reclaimed while they were not scheduled; raise max_num_seqs")
    # groups sealed this step: entries (row, g) for g in [opened, done)
    count = done - opened
    entry_row = np.repeat(every, count)
    entry_start = np.concatenate([[0], np.cumsum(count)])
    entry_g = opened[entry_row] + (np.arange(count.sum()) - entry_start[entry_row])
    seal_pages = page(entry_row, entry_g)
    # groups still open after the step
    tail = lengths % G > 0
    continuing = tail & (count == 0) & has
    opening = tail & ~continuing
    final_slots = staged_slots.copy()
    final_slots[~tail] = -1
    if requests is not None:
        final_slots[opening] = requests[opening]
    else:
        # the slots of groups sealed now are free for groups opening now (a layer reads every
        # staged token before it stages new ones), and stale slots of ended requests go back
        staging.give_back(seal_pages)
        opening_pages = page(every[opening], done[opening])
        final_slots[opening] = staging.take(opening_pages, keep=staged_slots[continuing])
        staging.touch(np.concatenate([staged_slots, final_slots]))
    # tokens
    token_row = np.repeat(every, new)
    position = before[token_row] + np.arange(len(token_row)) - starts[token_row]
    token_g, offset = position // G, position % G
    sealing = token_g < done[token_row]
    token_entry = entry_start[token_row] + token_g - opened[token_row]
    carried = has & (count > 0)  # staged tokens that join a sealed group
    carry_row = np.repeat(every[carried], staged[carried])
    carry_offset = np.arange(len(carry_row)) - np.repeat(
        np.concatenate([[0], np.cumsum(staged[carried])])[:-1], staged[carried])
    first_group = token_g == 0
    entry_first = entry_g == 0
    carry_sums = np.where(staged[entry_row] > 0, staged_slots[entry_row], -1)
    kernel = (new == 1) | fused & ~(exact & (before == 0))  # rows attended by the kernels
    rows_of = _kernel_rows(np.flatnonzero(kernel[token_row]), token_row, position, before,
                           staged_slots, G)
    upload = _Uploads(device, uploads)
    return upload.resolve(StepPlan(
        group=G,
        staged_tokens=upload(np.flatnonzero(~sealing)),
        staged_positions=upload(final_slots[token_row[~sealing]] * G + offset[~sealing]),
        stage_at=upload(np.where(sealing, -1, final_slots[token_row] * G + offset)),
        seal_tokens=upload(np.flatnonzero(sealing)),
        seal_at=upload(token_entry[sealing] * G + offset[sealing]),
        carry_positions=upload(staged_slots[carry_row] * G + carry_offset),
        carry_at=upload(entry_start[carry_row] * G + carry_offset),
        seal_pages=upload(seal_pages),
        seal_first=upload(page(entry_row, np.zeros_like(entry_row))),
        new_slots=upload(final_slots[opening]),
        sum_rows=upload(np.where(sealing, token_entry, final_slots[token_row])[first_group]),
        sum_tokens=upload(np.flatnonzero(first_group)),
        sum_sealed=upload(sealing[first_group], torch.bool),
        carry_sums=upload(carry_sums[entry_first]),
        value_at=upload(page(token_row, token_g) * G + offset),
        decode_tokens=upload(rows_of["decode_tokens"]),
        own_pages=upload(page(rows_of["row"], rows_of["group"])),
        float_slots=upload(rows_of["float_slots"]),
        context_slots=upload(rows_of["context_slots"]),
        spans=upload(rows_of["float_spans"]),
        inplace_spans=upload(rows_of["inplace_spans"]),
        tokens=len(token_row),
        every_token=rows > 0 and bool(kernel.all()),
        all_staged=rows > 0 and not sealing.any(),
        first_entries=upload(np.flatnonzero(entry_first)),
        selects=bool(entry_first.any()),
        decode_first=tuple(page(rows_of["row"], np.zeros_like(rows_of["row"])).tolist()),
        **_history(upload, page, rows_of["row"], rows_of["group"], G),
        chunks=[Chunk(int(starts[r]), int(starts[r + 1]), int(before[r]),
                      page(np.full(done[r], r), np.arange(done[r])).tolist(),
                      int(page(np.array([r]), np.array([0]))[0]), int(staged_slots[r]),
                      query_blocks(int(before[r]), int(new[r]), G, device))
                for r in np.flatnonzero(~kernel)],
    ))


def idle_plan(group: int, block_size: int, device: torch.device) -> StepPlan:
    """The plan of a step with no rows: a dummy batch's (it attends to nothing, changes
    nothing)."""
    return plan_step(Staging(0), group, block_size, np.zeros(1, np.int64), np.zeros(0, np.int64),
                     np.zeros((0, 1), np.int64), device)


def _kernel_rows(tokens: np.ndarray, token_row: np.ndarray, position: np.ndarray,
                 before: np.ndarray, staged_slots: np.ndarray, G: int) -> dict[str, np.ndarray]:
    """Per kernel row (the step's ``tokens``, each at its ``position``): its request ``row`` and
    ``group``; and the step's float buffer: an entry of G slots for each distinct group the
    rows are in, opened by its staged tokens (``float_slots``: its request's slot where the
    group is the one open before the step, else 0: none is read), then its new tokens — which
    are the kernel rows' own tokens, each at ``context_slots``, its entry's slot for its offset.
    A row reads its entry up to itself (``float_spans``), or the same floats where they lie
    (``inplace_spans``): its group's staged tokens in its slot (those of the group open before
    the step), then its group's new tokens up to it, consecutive in the step's tokens."""
    row, at = token_row[tokens], position[tokens]
    group, offset = at // G, at % G
    _, first, entry = np.unique(row * (int(group.max(initial=0)) + 1) + group, return_index=True,
                                return_inverse=True)
    own = group[first] == before[row[first]] // G
    spans = np.zeros((len(tokens), 4), dtype=np.int64)
    spans[:, 2], spans[:, 3] = entry * G, offset + 1
    staged = np.where(group == before[row] // G, before[row] % G, 0)  # [Rd] read in place
    inplace = np.stack([np.where(staged > 0, staged_slots[row] * G, 0), staged,
                        tokens - (offset - staged), offset - staged + 1], 1)
    return {"row": row, "group": group, "decode_tokens": tokens,
            "float_slots": np.where(own, np.maximum(staged_slots[row[first]], 0), 0),
            "context_slots": entry * G + offset, "float_spans": spans,
            "inplace_spans": inplace.reshape(-1, 4)}


def _history(upload, page, rows: np.ndarray, opened: np.ndarray, G: int) -> dict[str, _Queued]:
    """The kernel rows' block table: pages of groups [0, opened) padded with page 0."""
    width = max(int(opened.max(initial=0)), 1)
    grid = np.broadcast_to(np.arange(width), (len(rows), width))
    valid = grid < opened[:, None]
    table = np.where(valid, page(np.repeat(rows[:, None], width, 1), np.where(valid, grid, 0)),
                     0)
    return {"table": upload(table), "held": upload(valid * G), "counts": upload(opened)}


@dataclass
class _Queued:
    """Which of the upload's arrays an index array of the plan is, until it is made."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class _Uploads:
    """A plan's index arrays on the device in one copy (``Staged``: one non-blocking copy into
    a persistent buffer, from pinned memory on CUDA): each call queues an array (int64, or
    ``dtype`` once on the device) and stands for it in the plan until ``resolve``."""

    def __init__(self, device: torch.device, staged: steps.Staged | None):
        self.device, self.staged = device, staged or steps.Staged()
        self.arrays: list[np.ndarray] = []

    def __call__(self, values: np.ndarray, dtype: torch.dtype = torch.long) -> _Queued:
        array = np.ascontiguousarray(values, dtype=np.int64)
        self.arrays.append(array.ravel())
        return _Queued(len(self.arrays) - 1, array.shape, dtype)

    def resolve(self, plan: StepPlan) -> StepPlan:
        """``plan`` with every queued array a view of the uploaded buffer (cut by one split)."""
        flat = self.staged.fill(np.concatenate(self.arrays), self.device)
        parts = flat.split([array.size for array in self.arrays])
        for name in (f.name for f in fields(plan)):
            queued = getattr(plan, name)
            if isinstance(queued, _Queued):
                tensor = parts[queued.index].view(queued.shape)
                setattr(plan, name, tensor if queued.dtype == torch.long else
                        tensor.to(queued.dtype))
        return plan
