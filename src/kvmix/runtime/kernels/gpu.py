"""Triton decode attention over packed K/V (``backend="triton"``): scores straight from the
codes, online softmax and p·V in one pass per split, splits merged by log-sum-exp. Mirrors
``kvmix.runtime.kernels.reference.attend`` and is tested against it on CPU with
``TRITON_INTERPRET=1``.

A decode step of the whole batch (``attend_batch``) and the few new queries of one sequence
(``attend``) take the same page kernels:

1. a program per (sequence, KV head) and split of the sequence's pages, read through a block
   table; its query rows (query heads per KV head × new queries, scaled by ``scaling`` as they
   load) are the ``tl.dot`` M dimension. Per page: scores from the codes (per-channel keys: the
   bias Σ_c q_c·(min_c + scale_c·offset_c) plus each plane's Σ_c q_c·scale_c·mult_c·code_c;
   per-token keys: dequantized tiles), masked past the page's held tokens and before a sliding
   window's edge, folded into a running (max, sum, acc) with p·V from the value codes. No score
   buffer: each program writes one partial (acc, max, sum);
2. the float segments: in a decode step, one more program per (sequence, KV head) of the same
   launch attends its float slots (sink and residual, masked by the step's spans); for a few
   new queries of one sequence (``attend``), the sink, residual and new tokens, causally, in
   torch as one more partial;
3. ``_merge``: the partials merged by log-sum-exp, written in the query's dtype.

A decode step is two launches (pages and slots, then the merge) whose arguments are the same
from step to step while the batch and the block table's width stay: the grid is (sequences ×
KV heads, splits + 1) with the split count from the table's width (a power of two) and the
batch, each program reads its sequence's page count on the device, and the step's metadata
lives in persistent tensors (``kvmix.runtime.steps``). Sealing a page changes what the
tensors hold, not the launch.

Codes load as 32-bit words where a row is whole, aligned words (the common groups: 32 or more
tokens at 1 bit, 16 or more at 2, 4 and 8): one load per word, codes by shift and mask in
registers; other rows load byte by byte. The float K/V history is never built.
"""

from __future__ import annotations

import functools

import torch

from kvmix.core.bits import row_bytes
from kvmix.methods import ChannelKeys, KernelView, TokenGroups
from kvmix.runtime.kernels import batch
from kvmix.runtime.steps import Table, Workspace
from kvmix.runtime.store import BatchStore, RowView

try:
    import triton
    import triton.language as tl
except ImportError as missing:  # the `triton` extra is optional
    triton, tl, _CAUSE = None, None, f"Triton is not installed ({missing}): pip install " \
                                     "'kvmix[triton]'"
else:
    _CAUSE = ""

MAX_QUERIES = 16
KERNEL_BITS = (1, 2, 3, 4, 8)
PROGRAMS_PER_SM = 8  # programs (sequences × KV heads × splits) per streaming multiprocessor
PROGRAMS = 1  # without a CUDA device (the interpreter): one per sequence and KV head
STAGES = 2  # software pipelining of the page loop: the next page's codes load during this one
SLOT_TILE = 64  # float slots a decode step's slot program attends per iteration


def available() -> tuple[bool, str]:
    """(True, "") when Triton imports, else (False, the cause)."""
    return (triton is not None, _CAUSE)


def unserved(method, head_dim: int) -> str:
    """Why the kernels cannot read ``method``'s blocks at ``head_dim`` ("" when they can)."""
    return f"head_dim={head_dim} is too large for the Triton kernels (<= 256)" \
        if head_dim > 256 else ""


def check_view(view: KernelView | None, head_dim: int) -> None:
    """Bit widths and head dims the kernels tile; anything else is an error naming it."""
    if view is None or isinstance(view.keys, torch.Tensor):
        return
    widths = ([p.bits for p in view.keys.planes] if isinstance(view.keys, ChannelKeys)
              else [view.keys.bits]) + [view.values.bits]
    for bits in widths:
        if bits not in KERNEL_BITS:
            raise ValueError(f"bits={bits} has no Triton kernel; valid: "
                             f"{', '.join(map(str, KERNEL_BITS))}")
    if unserved(None, head_dim):
        raise ValueError(unserved(None, head_dim))


def attend(row: RowView, view: KernelView | None, query: torch.Tensor, keys: torch.Tensor,
           values: torch.Tensor, scaling: float) -> torch.Tensor:
    """query [1, Hq, q, D] of the new tokens, keys, values [1, H, q, D] over everything ``row``
    holds (its blocks read through ``view``, every block visible) and themselves, causally
    -> [1, Hq, q, D]."""
    heads, queries, dim = keys.shape[1], query.shape[2], query.shape[3]
    rep = query.shape[1] // heads
    grouped = (query[0].float() * scaling).reshape(1, heads, rep * queries, dim).contiguous()
    floats = [(row.sink_keys, row.sink_values), (row.res_keys, row.res_values)] if len(row) else []
    partials = [_float_partial(grouped[0], floats, keys, values, rep, queries)]
    if view is not None:
        check_view(view, dim)
        pool, table = _row_pages(view, row.lengths, grouped.device)
        partials.insert(0, _page_partials(pool, table, None, grouped, 1.0, row.method.group,
                                          _precision(query)))
    out = _merged_rows(partials, query.dtype)  # [H·R, D]
    return out.reshape(heads * rep, queries, dim)[None]


def batched(store: BatchStore) -> bool:
    """Whether ``attend_batch`` reads this store (a pool view the kernels tile)."""
    pool = batch.pool_view(store)
    if pool is None or pool.view is None:
        return pool is not None
    check_view(pool.view, store.keys.shape[-1])
    return True


def prepare(store: BatchStore) -> None:
    """Build the per-sequence views at the prompt, so that decode steps do not."""
    batch.pool_view(store)


def attend_batch(store: BatchStore, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """A decode step of the whole batch: query [B, Hq, 1, D] of each sequence's new token,
    already in its slot -> [B, Hq, 1, D]. One launch over the pages and the float slots (a
    program per sequence, KV head and split of its pages: scores, online softmax and p·V
    straight from the codes, no score buffer; one more per sequence and KV head for its slots),
    one launch merging them by log-sum-exp."""
    pool = batch.pool_view(store)
    if pool.view is None:  # no page yet: float "pages" the kernel never reads (counts are 0)
        pool = batch.PoolView(KernelView(store.keys, store.values), [], [], None)
    step, steps = store.step, store.steps
    out = decode_pages(pool, steps.table(store), query[:, :, 0], scaling, store.method.group,
                       (store.keys, store.values, step.spans), step.skips, steps.workspace)
    return out.unsqueeze(2)


def decode_pages(pool: batch.PoolView, table: Table, query: torch.Tensor, scaling: float,
                 group: int, slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 skip: torch.Tensor | None = None, workspace: Workspace | None = None,
                 step: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """query [B, Hq, D] of each row's new token over its pages in ``pool`` (``table``) and its
    float slots (keys, values [B, H, T, D], spans [B, 4]) -> [B, Hq, D]: the two launches of
    ``attend_batch``, with the arguments of the CPU op's ``decode_batch`` (kvmix's cache and
    its vLLM plugin, which holds vLLM's block table). With ``step`` (keys, values [1, H, N,
    D]: the vLLM plugin's new tokens) a row's second span lies in them, as the CPU op's step
    keys and values."""
    rows, query_heads, dim = query.shape
    grouped = query.contiguous().view(rows, slots[0].shape[1], -1, dim)  # [B, H, R, D]
    partials = _page_partials(pool, table, skip, grouped, scaling, group, _precision(query),
                              slots, workspace, step)
    out = torch.empty(rows * query_heads, dim, dtype=query.dtype, device=query.device)
    _merge_into(*partials, out)
    return out.view(rows, query_heads, dim)


def _row_pages(view: KernelView, lengths: list[int],
               device: torch.device) -> tuple[batch.PoolView, Table]:
    """One sequence's blocks as a pool of pages 0..n-1 and its block table."""
    blocks = len(lengths)
    table = Table(torch.arange(blocks, device=device)[None],
                  torch.tensor([lengths], dtype=torch.long, device=device),
                  torch.tensor([blocks], dtype=torch.long, device=device), blocks)
    if not isinstance(view.keys, ChannelKeys):
        return batch.PoolView(view, [], [], None), table
    planes = view.keys.planes
    return batch.PoolView(view, [p.index[None] for p in planes],
                          [p.mult[None].float() for p in planes],
                          view.keys.offset[None].float().contiguous()), table


def _page_partials(pool: batch.PoolView, table: Table, skip: torch.Tensor | None,
                   query: torch.Tensor, scaling: float, group: int, precision: str,
                   slots: tuple[torch.Tensor, ...] | None = None,
                   workspace: Workspace | None = None,
                   step: tuple[torch.Tensor, torch.Tensor] | None = None):
    """query [B, H, R, D] (scaled by ``scaling`` as it loads) over every sequence's pages
    (``table``; ``skip``: tokens a sliding window hides at the front of each first page) and,
    with ``slots`` (keys, values [B, H, T, D] and spans [B, 4]), each sequence's float slots as
    one more split (the second span in ``step``'s keys, values [1, H, N, D] where given) ->
    (acc [S, B, H, R, D], max, sum), in ``workspace`` if given."""
    rows, heads, reps, dim = query.shape
    splits = max(1, min(table.width, -(-_programs(query.device) // (rows * heads))))
    parts = splits + (slots is not None)
    shapes = [(parts, rows, heads, reps, dim), (parts, rows, heads, reps),
              (parts, rows, heads, reps)]
    acc, top, total = (workspace or Workspace()).take(shapes, query.device)
    if slots:
        second = step or slots[:2]  # where each row's second span lies
        slot_args = (*slots, slots[0].shape[2], _row_step(slots[0]), *second,
                     second[0].shape[2], _row_step(second[0]))
    else:
        slot_args = (query, query, table.counts, 0, 0, query, query, 0, 0)
    channels, (keys, key_layout), (values, value_layout) = batch.arguments(
        pool, "triton", lambda p: _pool_sources(p, group, dim))
    sizes = {"CHANNELS": channels, "KEYS": key_layout, "VALUES": value_layout, "G": group,
             "BLOCK_R": _pow2(reps), "BLOCK_G": _pow2(group), "BLOCK_D": _pow2(dim),
             "BLOCK_T": min(_pow2(slot_args[3]), SLOT_TILE),
             "PRECISION": precision, "num_warps": _warps(dim), "num_stages": STAGES}
    skip = torch.zeros_like(table.counts) if skip is None else skip
    _pages[(rows * heads, parts)](query, scaling, table.pages, table.held, table.counts, skip,
                                  table.width, splits, keys, values, slot_args, acc, top,
                                  total, heads, reps, dim, **sizes)
    return acc, top, total


def _row_step(keys: torch.Tensor) -> int:
    """Elements from one sequence's float slots [B, H, T, D] to the next: 0 in an arena
    [1, H, T, D] the sequences share (their spans place them)."""
    return 0 if keys.shape[0] == 1 else keys[0].numel()


def _pool_sources(pool: batch.PoolView, group: int, dim: int) -> tuple:
    """What ``_pages`` reads of the pool: whether keys are per-channel, then keys and values
    each as (tensors and sizes, layout)."""
    keys = pool.view.keys
    if isinstance(keys, ChannelKeys):
        return True, _channel_keys(keys, pool, group), _source(pool.view.values, dim)
    return False, _source(keys, dim), _source(pool.view.values, dim)


def _channel_keys(keys: ChannelKeys, pool: batch.PoolView, group: int) -> tuple:
    """Per-channel keys as ``_channel_scores`` reads them: (the pool's scale and minimum,
    each sequence's offsets, the planes' tensors and sizes), and the planes' layouts (a
    constexpr: one specialisation per layout)."""
    planes = [_plane(plane, index, mult, group) for plane, index, mult in zip(
        keys.planes, pool.index, pool.mult, strict=True)]
    tensors = tuple(tensors for tensors, _ in planes)
    return ((keys.scale.contiguous(), keys.minimum.contiguous(), pool.offset, tensors),
            tuple(layout for _, layout in planes))


def _plane(plane, index: torch.Tensor, mult: torch.Tensor, group: int) -> tuple:
    """One plane: (codes, each sequence's channels and multipliers [B, H, C], C, block bytes,
    row width, 3-bit split) and its layout (BITS, BLOCK_C, WORDS: word loads)."""
    return ((plane.codes, index.contiguous(), mult.contiguous(), index.shape[-1],
             plane.codes.stride(0), row_bytes(group, plane.bits), _subplane(group, plane.bits)),
            (plane.bits, _pow2(index.shape[-1]), _words(plane.codes, group, plane.bits)))


def _merged_rows(partials, dtype: torch.dtype) -> torch.Tensor:
    """Partials (acc [S, ..., D], max [S, ...], sum) -> [N, D] in ``dtype``, N the rows they
    share."""
    acc = torch.cat([a.reshape(a.shape[0], -1, a.shape[-1]) for a, _, _ in partials])
    top = torch.cat([m.reshape(m.shape[0], -1) for _, m, _ in partials])
    total = torch.cat([s.reshape(s.shape[0], -1) for _, _, s in partials])
    out = torch.empty(acc.shape[1], acc.shape[2], dtype=dtype, device=acc.device)
    _merge_into(acc, top, total, out)
    return out


def _merge_into(acc: torch.Tensor, top: torch.Tensor, total: torch.Tensor,
                out: torch.Tensor) -> None:
    """acc [S, ..., D], max and sum [S, ...] (contiguous) merged by log-sum-exp into out
    [N, D]: one program per row."""
    rows, dim = out.shape
    _merge[(rows,)](acc, top, total, out, acc.shape[0], rows, dim,
                    BLOCK_S=_pow2(acc.shape[0]), BLOCK_D=_pow2(dim))


def _float_partial(grouped, floats, keys, values, rep: int, queries: int):
    """The float segments and the new tokens: (acc [1, H, R, D], max [1, H, R], sum)."""
    segments = [(k, v) for k, v in floats if k.shape[-2]] + [(keys, values)]
    k = torch.cat([s[0][0].float() for s in segments], dim=1)  # [H, T, D]
    v = torch.cat([s[1][0].float() for s in segments], dim=1)
    scores = grouped @ k.transpose(1, 2)  # [H, R, T]
    if queries > 1:  # query i of the new ones sees all but the last q - 1 - i new tokens
        t = k.shape[1]
        visible = torch.arange(t, device=k.device)[None] <= (t - queries + torch.arange(
            queries, device=k.device))[:, None]  # [q, T]
        scores = scores.masked_fill(~visible.repeat(rep, 1)[None], float("-inf"))
    top = scores.amax(-1)
    weights = torch.exp(scores - top[..., None])
    return (weights @ v)[None], top[None], weights.sum(-1)[None]


def _source(groups: TokenGroups | torch.Tensor, dim: int) -> tuple:
    """A per-token tile source as ``_token_tile`` reads it: (codes, scale, minimum, block
    bytes, row width, 3-bit split) and its layout (GROUP, BITS, SYMMETRIC, WORDS). Float blocks
    [n, H, G, D] are BITS=16 (their own ``codes``; statistics unread)."""
    if isinstance(groups, torch.Tensor):
        blocks = groups.contiguous()
        return (blocks, blocks, blocks, 0, 0, 0), (dim, 16, False, False)
    words = _words(groups.codes, groups.group, groups.bits) and dim == _pow2(dim) >= groups.group
    return ((groups.codes, *_stats(groups), groups.codes.stride(0),
             row_bytes(groups.group, groups.bits), _subplane(groups.group, groups.bits)),
            (groups.group, groups.bits, groups.minimum is None, words))


def _words(codes: torch.Tensor, row: int, bits: int) -> bool:
    """Whether rows of ``row`` codes at ``bits`` load as 32-bit words: a power-of-two row of at
    least 16 codes whose parts (3 bits: the 2-bit and the 1-bit part) are whole words, at 4-byte
    aligned addresses in every block."""
    parts = (row_bytes(row, 2), row_bytes(row, 1)) if bits == 3 else (row_bytes(row, bits),)
    return (row == _pow2(row) and all(p % 4 == 0 for p in parts)
            and codes.data_ptr() % 4 == 0 and codes.stride(0) % 4 == 0)


def _programs(device: torch.device) -> int:
    """Programs (sequences × KV heads × splits) a launch aims for: several per SM of the
    device (split-K sized from the batch and the SM count); PROGRAMS elsewhere (where each
    program then reads all of its sequence's pages, its online softmax across them)."""
    if device.type != "cuda":
        return PROGRAMS
    return PROGRAMS_PER_SM * _sm_count(device.index or 0)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _precision(query: torch.Tensor) -> str:
    """``tl.dot``'s input precision: IEEE for float32 queries, TF32 otherwise."""
    return "ieee" if query.dtype == torch.float32 else "tf32"


def _warps(dim: int) -> int:
    """Warps per program: 4 up to head dim 128 (a [R, D] accumulator of 16 × 128 floats over
    128 threads), 8 beyond."""
    return 4 if dim <= 128 else 8


def _subplane(row: int, bits: int) -> int:
    """Bytes of a 3-bit row's 2-bit part (where its 1-bit part starts); 0 otherwise."""
    return row_bytes(row, 2) if bits == 3 else 0


def _stats(groups: TokenGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, minimum) contiguous; symmetric groups pass the scale twice (unread)."""
    scale = groups.scale.contiguous()
    return scale, scale if groups.minimum is None else groups.minimum.contiguous()


def _pow2(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


if triton is not None:

    @triton.jit
    def _codes(row_start, position, mask, width, low_width, BITS: tl.constexpr):
        """Codes at ``position`` of packed rows starting at ``row_start``, a byte per element
        (row-split order: byte w holds codes w, w + W, ...; a 3-bit row is its 2-bit part,
        then its 1-bit part)."""
        if BITS == 3:
            high_width = width - low_width
            low = tl.load(row_start + position % low_width, mask=mask, other=0)
            low = (low >> ((position // low_width) * 2).to(tl.uint8)) & 3
            high = tl.load(row_start + low_width + position % high_width, mask=mask, other=0)
            high = (high >> (position // high_width).to(tl.uint8)) & 1
            return (low | (high << 2)).to(tl.float32)
        else:
            byte = tl.load(row_start + position % width, mask=mask, other=0)
            shift = ((position // width) * BITS).to(tl.uint8)
            return ((byte >> shift) & ((1 << BITS) - 1)).to(tl.float32)

    @triton.jit
    def _word_part(start, mask, A: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr):
        """Codes [A, N] of A rows of N codes at 1, 2, 4 or 8 bits, ``start`` [A] their first
        bytes (4-byte aligned): each row's W = N·BITS/8 bytes load as W/4 words, and code
        s·W + 4w + k is byte k of word w shifted by s·BITS (int32 shifts: the sign bits an
        arithmetic shift brings in lie above the mask)."""
        COUNT: tl.constexpr = N * BITS // 32
        w = tl.arange(0, COUNT)
        words = tl.load(start.to(tl.pointer_type(tl.int32))[:, None] + w[None, :],
                        mask=mask[:, None], other=0)  # [A, W/4]
        s = tl.arange(0, 8 // BITS)
        k = tl.arange(0, 4)
        shift = s[:, None, None] * BITS + 8 * k[None, None, :]  # [8/BITS, 1, 4]
        x = (words[:, None, :, None] >> shift[None]) & ((1 << BITS) - 1)
        return tl.reshape(x, [A, N])

    @triton.jit
    def _word_rows(start, mask, low_width, A: tl.constexpr, N: tl.constexpr,
                   BITS: tl.constexpr):
        """Codes [A, N] float32 of A packed rows by word loads (3 bits: the 2-bit part, then the
        1-bit part ``low_width`` bytes on)."""
        if BITS == 3:
            low = _word_part(start, mask, A, N, 2)
            high = _word_part(start + low_width, mask, A, N, 1)
            x = low | (high << 2)
        else:
            x = _word_part(start, mask, A, N, BITS)
        return x.to(tl.float32)

    @triton.jit
    def _token_tile(source, LAYOUT: tl.constexpr, block, head, heads, dim, G: tl.constexpr,
                    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        """Dequantized per-token groups of one block and head from ``source`` and ``LAYOUT``
        (``_source``): [BLOCK_G, BLOCK_D] float32; BITS=16: a tile of float blocks
        [n, H, G, D]. WORDS: rows by word loads (then dim == BLOCK_D)."""
        codes, scale, minimum = source[0], source[1], source[2]
        block_bytes, width, low_width = source[3], source[4], source[5]
        GROUP: tl.constexpr = LAYOUT[0]
        BITS: tl.constexpr = LAYOUT[1]
        SYMMETRIC: tl.constexpr = LAYOUT[2]
        WORDS: tl.constexpr = LAYOUT[3]
        t = tl.arange(0, BLOCK_G)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (t < G) & (d < dim)
        if BITS == 16:  # one return per branch: early returns do not compile inside loops
            at = ((block * heads + head) * G + t) * dim + d
            tile = tl.load(codes + at, mask=mask, other=0).to(tl.float32)
        else:
            groups = dim // GROUP
            row = (head * G + t) * groups + d // GROUP  # codes [H, G, D/group, group] per block
            if WORDS:  # the rows (token t, group j) [BLOCK_G·J], each GROUP codes wide
                J: tl.constexpr = BLOCK_D // GROUP
                j = tl.arange(0, J)[None, :]
                start = codes + block * block_bytes + ((head * G + t) * J + j) * width
                x = tl.reshape(_word_rows(tl.reshape(start, [BLOCK_G * J]),
                                          tl.reshape((t < G) & (j < J), [BLOCK_G * J]),
                                          low_width, BLOCK_G * J, GROUP, BITS),
                               [BLOCK_G, BLOCK_D])
            else:
                x = _codes(codes + block * block_bytes + row * width, d % GROUP, mask, width,
                           low_width, BITS)
            stat = block * heads * G * groups + row
            step = tl.load(scale + stat, mask=mask, other=0).to(tl.float32)
            if SYMMETRIC:
                tile = (x - (1 << (BITS - 1)) + 0.5) * step
            else:
                tile = tl.load(minimum + stat, mask=mask, other=0).to(tl.float32) + step * x
        return tile

    @triton.jit
    def _plane_part(query, qscale, rows, dim, scale, plane, PLANES: tl.constexpr,
                    PLANE: tl.constexpr, seq, head, heads, page, G: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, PRECISION: tl.constexpr):
        """One plane's share of a page's scores: Σ_c q[r, idx_c]·scale[idx_c]·mult_c·code_c[t]
        -> [BLOCK_R, BLOCK_G] (query: this program's rows; scale: the page's, this head;
        plane and PLANES[PLANE]: ``_plane``; the layouts whole, since Triton 3.6 passes an entry
        of a constexpr tuple to a function as a plain tuple and fails to compile it)."""
        codes, index, mult, channels = plane[0], plane[1], plane[2], plane[3]
        block_bytes, width, low_width = plane[4], plane[5], plane[6]
        BITS: tl.constexpr = PLANES[PLANE][0]
        BLOCK_C: tl.constexpr = PLANES[PLANE][1]
        WORDS: tl.constexpr = PLANES[PLANE][2]
        c = tl.arange(0, BLOCK_C)
        r = tl.arange(0, BLOCK_R)
        t = tl.arange(0, BLOCK_G)
        has_c = c < channels
        at = (seq * heads + head) * channels + c
        channel = tl.load(index + at, mask=has_c, other=0)
        weight = tl.load(mult + at, mask=has_c, other=0.0)
        weight *= tl.load(scale + channel, mask=has_c, other=0).to(tl.float32)
        q = tl.load(query + r[:, None] * dim + channel[None, :],
                    mask=(r[:, None] < rows) & has_c[None, :], other=0.0)
        q = q.to(tl.float32) * qscale  # [R, C]
        start = codes + page * block_bytes + (head * channels + c) * width  # [C]
        if WORDS:  # then G == BLOCK_G
            x = _word_rows(start, has_c, low_width, BLOCK_C, BLOCK_G, BITS)  # [C, G]
        else:
            x = _codes(start[:, None], t[None, :], has_c[:, None] & (t[None, :] < G), width,
                       low_width, BITS)
        return tl.dot(q * weight[None, :], x, input_precision=PRECISION)

    @triton.jit
    def _channel_scores(query, qscale, rows, dim, keys, PLANES: tl.constexpr, seq, head,
                        heads, page, G: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
        """A page's scores from per-channel keys (``_channel_keys``: scale and minimum
        [P, H, D] of the pool, each sequence's offsets [B, H, D], the planes; PLANES: their
        layouts): the bias Σ_c q_c·(min_c + scale_c·offset_c), then each plane
        -> [BLOCK_R, BLOCK_G]."""
        key_scale, key_min, offset, planes = keys[0], keys[1], keys[2], keys[3]
        r = tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        has_d = d < dim
        stats = (page * heads + head) * dim
        scale = tl.load(key_scale + stats + d, mask=has_d, other=0).to(tl.float32)
        shift = tl.load(key_min + stats + d, mask=has_d, other=0).to(tl.float32)
        shift += scale * tl.load(offset + (seq * heads + head) * dim + d, mask=has_d, other=0.0)
        q = tl.load(query + r[:, None] * dim + d[None, :],
                    mask=(r[:, None] < rows) & has_d[None, :], other=0.0)
        q = q.to(tl.float32) * qscale  # [R, D]
        scores = tl.zeros([BLOCK_R, BLOCK_G], tl.float32) + tl.sum(q * shift[None, :],
                                                                    axis=1)[:, None]
        for i in tl.static_range(len(PLANES)):
            scores += _plane_part(query, qscale, rows, dim, key_scale + stats, planes[i],
                                  PLANES, i, seq, head, heads, page, G, BLOCK_R, BLOCK_G,
                                  PRECISION)
        return scores

    @triton.jit
    def _absorb(scores, first, length, running, mass, out, values, VALUES: tl.constexpr, page,
                head, heads, rows, dim, G: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
        """One page into the online softmax: its scores [R, G] (masked before ``first``, a
        sliding window's edge, and past ``length`` held tokens) and p·V from its value codes
        -> the running (max, sum, acc)."""
        r = tl.arange(0, BLOCK_R)
        t = tl.arange(0, BLOCK_G)
        seen = (r[:, None] < rows) & (t[None, :] >= first) & (t[None, :] < length)
        v = _token_tile(values, VALUES, page, head, heads, dim, G, BLOCK_G, BLOCK_D)  # [G, D]
        return _fold(tl.where(seen, scores, float("-inf")), v, running, mass, out, PRECISION)

    @triton.jit
    def _fold(scores, v, running, mass, out, PRECISION: tl.constexpr):
        """Masked scores [R, T] (-inf: unseen) and their values [T, D] into the running (max
        [R], sum [R], acc [R, D]) of an online softmax."""
        peak = tl.maximum(running, tl.max(scores, axis=1))
        safe = tl.where(peak == float("-inf"), 0.0, peak)
        p = tl.exp(scores - safe[:, None])
        decay = tl.exp(running - safe)
        out = out * decay[:, None] + tl.dot(p, v, input_precision=PRECISION)
        return peak, mass * decay + tl.sum(p, axis=1), out

    @triton.jit
    def _slots(query, qscale, slots, seq, head, heads, rows, dim, running, mass, out,
               BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
               PRECISION: tl.constexpr):
        """A sequence's float slots for one KV head into the online softmax. ``slots``: keys,
        values [B, H, T, D] or one arena [1, H, T, D] (any float dtype), spans [B, 4] (what
        the newest token sees: sink start and length, residual start and length, in the
        sequence's row), T, and the elements from one row to the next (0: an arena); then the
        keys, values, T and row step the second span lies in (the same slots, or the vLLM
        plugin's step tokens [1, H, N, D])."""
        spans = slots[2]
        r = tl.arange(0, BLOCK_R)
        t = tl.arange(0, BLOCK_T)
        d = tl.arange(0, BLOCK_D)
        q = tl.load(query + r[:, None] * dim + d[None, :],
                    mask=(r[:, None] < rows) & (d[None, :] < dim), other=0.0)
        q = q.to(tl.float32) * qscale  # [R, D]
        for part in tl.static_range(2):  # the sink, then the residual
            if part == 0:
                keys, values, count, row_step = slots[0], slots[1], slots[3], slots[4]
            else:
                keys, values, count, row_step = slots[5], slots[6], slots[7], slots[8]
            base = seq * row_step + head * count * dim
            first = tl.load(spans + seq * 4 + 2 * part)
            end = first + tl.load(spans + seq * 4 + 2 * part + 1)
            for start in range(first, end, BLOCK_T):
                at = start + t
                where = base + at[:, None] * dim + d[None, :]
                held = (at[:, None] < end) & (d[None, :] < dim)
                k = tl.load(keys + where, mask=held, other=0.0).to(tl.float32)  # [T, D]
                v = tl.load(values + where, mask=held, other=0.0).to(tl.float32)
                scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [R, T]
                scores = tl.where((r[:, None] < rows) & (at < end)[None, :], scores,
                                  float("-inf"))
                running, mass, out = _fold(scores, v, running, mass, out, PRECISION)
        return running, mass, out

    @triton.jit
    def _keep(acc, top, total, running, mass, out, split, program, programs, rows, dim,
              BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """A program's partial: acc [S, B·H, R, D], max and sum [S, B·H, R]."""
        r = tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        where = (split * programs + program) * rows + r
        tl.store(top + where, running, mask=r < rows)
        tl.store(total + where, mass, mask=r < rows)
        tl.store(acc + where[:, None] * dim + d[None, :], out,
                 mask=(r[:, None] < rows) & (d[None, :] < dim))

    @triton.jit
    def _pages(query, qscale, pages, held, counts, skip, width, splits, keys, values, slots,
               acc, top, total, heads, rows, dim, CHANNELS: tl.constexpr, KEYS: tl.constexpr,
               VALUES: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
               PRECISION: tl.constexpr):
        """A program per (sequence, KV head) and split of the sequence's pages, read through
        the block table (its page count read here: the grid does not follow it): scores from
        the key codes (CHANNELS: per-channel groups, ``keys`` and KEYS from
        ``_channel_keys``; else per-token groups or float pages, from ``_source``), online
        softmax, p·V from the value codes (``values`` and VALUES from ``_source``), in one
        pass. Split ``splits``, where the grid has it, attends the sequence's float slots
        (``_slots``)."""
        program, split = tl.program_id(0), tl.program_id(1)
        seq, head = program // heads, program % heads
        q = query + program * rows * dim  # this program's query rows [R, D]
        r = tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        running = tl.full([BLOCK_R], float("-inf"), tl.float32)
        mass = tl.zeros([BLOCK_R], tl.float32)
        out = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        if split < splits:
            rows_q = tl.load(q + r[:, None] * dim + d[None, :],
                             mask=(r[:, None] < rows) & (d[None, :] < dim), other=0.0)
            rows_q = rows_q.to(tl.float32) * qscale  # [R, D]
            count = tl.load(counts + seq)
            per = tl.cdiv(count, splits)
            for n in range(split * per, tl.minimum(split * per + per, count)):
                page = tl.load(pages + seq * width + n)
                if CHANNELS:
                    scores = _channel_scores(q, qscale, rows, dim, keys, KEYS, seq, head, heads,
                                             page, G, BLOCK_R, BLOCK_G, BLOCK_D, PRECISION)
                else:
                    k = _token_tile(keys, KEYS, page, head, heads, dim, G, BLOCK_G, BLOCK_D)
                    scores = tl.dot(rows_q, tl.trans(k), input_precision=PRECISION)  # [R, G]
                hidden = tl.where(n == 0, tl.load(skip + seq), 0)  # a sliding window's edge
                running, mass, out = _absorb(scores, hidden, tl.load(held + seq * width + n),
                                             running, mass, out, values, VALUES, page, head,
                                             heads, rows, dim, G, BLOCK_R, BLOCK_G, BLOCK_D,
                                             PRECISION)
        else:
            running, mass, out = _slots(q, qscale, slots, seq, head, heads, rows, dim,
                                        running, mass, out, BLOCK_R, BLOCK_T, BLOCK_D,
                                        PRECISION)
        _keep(acc, top, total, running, mass, out, split, program, tl.num_programs(0), rows,
              dim, BLOCK_R, BLOCK_D)

    @triton.jit
    def _merge(acc, top, total, out, splits, rows, dim, BLOCK_S: tl.constexpr,
               BLOCK_D: tl.constexpr):
        """out[row] = Σ_s acc_s·e^(m_s − M) / Σ_s l_s·e^(m_s − M), M = max_s m_s."""
        row = tl.program_id(0)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        has_s = s < splits
        m = tl.load(top + s * rows + row, mask=has_s, other=float("-inf"))
        peak = tl.max(m, axis=0)
        weight = tl.where(has_s, tl.exp(m - peak), 0.0)
        mass = tl.sum(tl.load(total + s * rows + row, mask=has_s, other=0.0) * weight, axis=0)
        parts = tl.load(acc + (s[:, None] * rows + row) * dim + d[None, :],
                        mask=has_s[:, None] & (d[None, :] < dim), other=0.0)
        tl.store(out + row * dim + d, tl.sum(parts * weight[:, None], axis=0) / mass,
                 mask=d < dim)
