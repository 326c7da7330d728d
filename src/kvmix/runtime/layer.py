"""A full-attention layer's packed cache under transformers' ``CacheLayerMixin`` contract.

transformers sees one tensor of ``T`` positions per layer, left-padded across the batch; kvmix keeps
every sequence's real tokens only, batch-shaped (``BatchStore``: float slots, a block table into the
layer's ``PagePool``), so each sequence's sink, group boundaries and statistics are its own
(docs/design/cache-layout.md: the same cache alone or in a padded batch), and padding costs no
storage. ``pads[b]`` is how many leading positions of row ``b`` are padding (read from the mask
once, at a prompt).

``update`` only stages the new tokens; the attention function registered by
``kvmix.runtime.attention`` then calls ``attend``, which attends each sequence over its own
history and commits the new tokens (the flush happens there, with the post-RoPE queries that
prefill-time channel selection needs). Two paths:

* a **decode step** (one new token per sequence, every sequence prefilled): the tokens go into
  their slots, one fused call attends the whole batch (the CPU op, or the Triton kernels: one
  pass over the pages plus one batched partial of the float slots; the reference path loops
  over sequences), rows whose residual filled are sealed in one ``encode`` call. No host sync:
  token counts are the host's own, and the new tokens' largest magnitude is kept as a device
  scalar (NaN once a value was) that is checked at the next prompt or chunk, by
  ``KVMixCache.check()``, or at every step with ``KVMIX_CHECKS=1``;
* anything else (a prompt, a chunk of scored tokens): each sequence's real tokens are checked,
  attended and committed, every full group of the batch sealed in one ``encode`` call; a refused
  commit (a full pool, a value beyond the float16 statistics) changes nothing.

Continuous batching drives a layer through ``decode`` and ``join`` instead, staged until the
whole forward went through (``commit``) or undone (``rollback``): see "continuous batching"
below.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import Counter
from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from kvmix.core.quantizers import fused_encoding
from kvmix.methods import Method, ModelSpec
from kvmix.runtime.accounting import slack_bytes, store_bytes
from kvmix.runtime.kernels import cpu, gpu, interpreting, reference
from kvmix.runtime.pool import PagePool, PoolFull
from kvmix.runtime.steps import Kind
from kvmix.runtime.store import (
    FLOAT16_MAX,
    BatchStore,
    RowFault,
    RowView,
    Sealing,
    check_finite,
    check_float16_range,
    peak,
    row_peaks,
    stored,
)


@dataclass
class _Undo:
    """What a continuous-batching step changed in a layer, until commit or rollback."""

    batch: int  # rows before the step (those after it joined)
    counts: tuple[list[int], list[int]]  # sink and residual lengths before the step
    step: tuple[torch.Tensor, torch.Tensor] | None = None  # a decode step's queries, keys


class _Handoff(threading.local):
    """The layer whose ``update`` ran and whose attention has not committed yet."""

    layer: KVMixLayer | None = None


_HANDOFF = _Handoff()


def take_pending() -> KVMixLayer | None:
    layer, _HANDOFF.layer = _HANDOFF.layer, None
    return layer


def clear_pending() -> None:
    _HANDOFF.layer = None


FUSED = {"cpu": cpu, "triton": gpu}  # the fused kernels of each backend (torch: none)

# Per layer, the largest magnitude of decode steps' tokens not yet checked, a device scalar
# (kept outside the cache so its bytes are the cache's own only).
_FLAGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def checks_every_step() -> bool:
    return os.environ.get("KVMIX_CHECKS", "") not in ("", "0")


class KVMixLayer(CacheLayerMixin):
    """One full-attention layer's packed cache: every sequence's segments, behind transformers'
    calls."""

    is_sliding = False
    is_compileable = False
    # A crop that ends inside a block keeps that block's codes: not a trace-free rollback.
    is_croppable = False

    def __init__(self, method: Method, layer_idx: int, backend: str = "torch",
                 max_batch: int | None = None, max_pages: int | None = None,
                 sliding_window: int | None = None, kind: Kind | None = None):
        """sliding_window: W of a sliding-window layer (each query sees itself and the W - 1
        tokens before it; pages behind the window are released), None for full attention.
        kind: the token every layer of this one's kind shares, for their decode-step metadata
        (the cache gives one per kind; by default the layer's own)."""
        super().__init__()
        if sliding_window is not None and (not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window={sliding_window!r} is invalid; expected an "
                             "integer >= 1 or None")
        self.method = method
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.backend = backend  # "torch" (the reference path), "cpu" or "triton" (fused ops)
        self.max_batch, self.max_pages = max_batch, max_pages
        self.max_slots: int | None = None  # a fixed slot arena (a server's), else max_batch's
        self.kind = kind or Kind()
        self.reset()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self.backend == "cpu" and key_states.device.type != "cpu":
            raise ValueError(f"backend='cpu' runs on CPU tensors; layer {self.layer_idx}'s keys "
                             f"are on {key_states.device} (use backend='torch' or 'auto')")
        if self.backend == "triton" and key_states.device.type != "cuda" and not interpreting():
            raise ValueError(f"backend='triton' runs on CUDA tensors; layer {self.layer_idx}'s "
                             f"keys are on {key_states.device} (use backend='cpu' or 'auto')")
        self._check_batch(key_states.shape[0])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.store.allocate(key_states.shape[0], key_states)
        self.pads = [0] * key_states.shape[0]
        self.is_initialized = True

    # -- the forward pass ----------------------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage the new tokens, [B, H, q, D], for ``attend``; returns them (key transformed)."""
        if _HANDOFF.layer is not None:
            _HANDOFF.layer = None
            raise RuntimeError(
                "a kvmix cache layer was updated but its attention never committed: the model "
                "must use attn_implementation='kvmix' (kvmix.make_cache sets it)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.stepping = key_states.shape[-2] == 1 and all(self.store.prefilled)
        if self.stepping:
            self.store.reserve_step()  # a fixed pool refuses here, before anything changes
        if self.stepping and not checks_every_step():
            self._flag(key_states, value_states)
        else:
            self.check()
            check_finite(key_states, value_states, self.layer_idx)
        keys = self.method.transform_keys(key_states, self.layer_idx)
        if not self.stepping:
            self._check_range(keys, value_states)
        self.pending = stored(keys, self.method), stored(value_states, self.method)
        self.length += key_states.shape[-2]
        _HANDOFF.layer = self
        return self.pending

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None,
               scaling: float) -> torch.Tensor:
        """Each sequence's new queries over its own history and new tokens, then commit.

        query: [B, Hq, q, D] (in the cache's key space); attention_mask: [B, 1, q, T] or None
        -> [B, Hq, q, D], zero at padding queries.
        """
        keys, values = self.pending
        self.pending = None
        if self.stepping:
            return self._step(query, keys, values, scaling)
        self._read_pads(attention_mask)
        out = torch.zeros_like(query)
        new = []
        for b in range(self.store.batch):
            count = min(query.shape[-2], self.length - self.pads[b])  # this row's real tokens
            tail = slice(query.shape[-2] - max(count, 0), None)
            rows = slice(b, b + 1)
            k, v, q = keys[rows, :, tail], values[rows, :, tail], query[rows, :, tail]
            if count > 0:
                out[rows, :, tail] = self._attend_row(self.store.row(b), q, k, v, scaling)
            new.append((k, v, q))
        try:
            self._commit(new)
        except (PoolFull, RowFault):
            self.length -= query.shape[-2]  # refused before anything changed: not staged
            raise
        return out

    def fill(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor) -> None:
        """Commit tokens without attending — a synthetic history for benchmarks of the
        attention op: keys, values [B, H, T, D], queries [B, Hq, T, D] (for selection)."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        check_finite(keys, values, self.layer_idx)
        keys = self.method.transform_keys(keys, self.layer_idx)
        self._check_range(keys, values)
        keys, values = stored(keys, self.method), stored(values, self.method)
        queries = self.method.transform_queries(queries, self.layer_idx)
        self.length += keys.shape[-2]
        self._commit([(keys[b : b + 1], values[b : b + 1], queries[b : b + 1])
                      for b in range(keys.shape[0])])

    # -- continuous batching: a step of every running request and the requests joining -------
    #
    # A step is staged in every layer, then committed once the whole forward (and its
    # sampling) went through, or rolled back so each layer is exactly as before the step:
    # a decode step writes its tokens and attends, but seals nothing until ``commit``; rows
    # that join are the last rows, which ``rollback`` removes.

    def decode(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """A decode step of every row (every running request, one new token each): query
        [B, Hq, 1, D] (in the cache's key space), keys (transformed), values [B, H, 1, D] ->
        [B, Hq, 1, D]. ``peaks`` [B] holds each row's largest magnitude (NaN for a NaN), for
        the step's validation before ``commit``."""
        self.store.reserve_step()  # a fixed pool refuses here, before anything changes
        self._stage()
        self._undo.step = query, keys
        self.peaks = row_peaks(keys, values)
        keys, values = stored(keys, self.method), stored(values, self.method)
        return self._write_and_attend(query, keys, values, scaling)

    def join(self, prompts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
             scaling: float, extents: list[int] | None = None) -> list[torch.Tensor]:
        """New sequences after the last row (requests admitted at this step), each its whole
        prompt: queries [1, Hq, n, D] (in the cache's key space), keys (transformed), values
        [1, H, n, D]; ``extents``: the float slots of each (a whole sink and residual by
        default). Each attends over itself, as a prompt of ``generate`` does, and is laid out
        -> outputs [1, Hq, n, D]. A prompt refused (non-finite, or beyond float16 for a
        quantizing method) raises a ``RowFault`` naming its row."""
        first = self.store.batch
        for i, (_, keys, values) in enumerate(prompts):
            check_finite(keys, values, self.layer_idx, [first + i])
            self._check_range(keys, values, [first + i])
        if not self.is_initialized:
            self.lazy_initialization(prompts[0][1][:0], prompts[0][2][:0])
            if self.max_batch is not None:  # a cache sized up front: every row's slots now
                self.store.resize_slots(self.max_slots or self.max_batch * self.store.row_slots,
                                        fixed=self.max_slots is not None)
        self._check_batch(first + len(prompts))
        prompts = [(q, stored(k, self.method), stored(v, self.method)) for q, k, v in prompts]
        self._stage()
        self.store.add_rows(len(prompts), extents)
        self.pads += [0] * len(prompts)
        out = [self._attend_row(self.store.row(first + i), q, k, v, scaling)
               for i, (q, k, v) in enumerate(prompts)]
        self._commit([(k, v, q) for q, k, v in prompts], range(first, self.store.batch))
        return out

    def commit(self) -> None:
        """The staged step is kept: rows that decoded follow it (online selection) and seal
        their full residuals."""
        self.keep(self.prepare_commit())

    def prepare_commit(self) -> Sealing | None:
        """What keeping the staged step changes here, computed with nothing changed: what can
        fail in a commit fails here, so a cache of many layers commits all of them or none
        (None: no decode step is staged)."""
        undo = self._undo
        return None if undo is None or undo.step is None else self._sealing(*undo.step)

    def keep(self, sealing: Sealing | None) -> None:
        """Apply ``prepare_commit``'s result (nothing here can fail): the step is kept."""
        self._undo = None
        if sealing is not None:
            self.store.keep(sealing)

    def rollback(self) -> None:
        """The staged step is undone: rows that joined leave (their pages return), the others'
        lengths are what they were (the tokens written past them are never read)."""
        undo, self._undo = self._undo, None
        if undo is None:
            return
        while self.store.batch > undo.batch:
            self.leave(self.store.batch - 1)
        if undo.step is not None:
            self.store.restore(undo.counts)

    def fork(self, b: int, count: int) -> None:
        """``count`` rows after the last, copies of row ``b`` sharing its pages (between
        steps: the choices of one prompt)."""
        self._check_batch(self.store.batch + count)
        self.store.fork(b, count)
        self.pads += [self.pads[b]] * count

    def _stage(self) -> None:
        if self._undo is None:
            self._undo = _Undo(self.store.batch, self.store.counts())

    def leave(self, b: int) -> int:
        """Row ``b``'s sequence ends (its pages return to the pool); the last row takes its place
        -> the index the moved row had."""
        moved = self.store.remove_row(b)
        self.pads[b] = self.pads[moved]
        self.pads.pop()
        return moved

    def _commit(self, new: list[tuple[torch.Tensor, ...]], rows: range | None = None) -> None:
        with fused_encoding(self.backend):  # sealed pages encode in the fused kernels
            self.store.append(new, rows)
        fused = FUSED.get(self.backend)
        if fused:
            fused.prepare(self.store)  # the per-sequence views, once per prompt, not per step

    def _step(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              scaling: float) -> torch.Tensor:
        """A decode step: one new token per sequence -> [B, Hq, 1, D]."""
        out = self._write_and_attend(query, keys, values, scaling)
        self._seal_step(query, keys)
        return out

    def _write_and_attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          scaling: float) -> torch.Tensor:
        """One new token per sequence into its slot, attended -> [B, Hq, 1, D]."""
        store = self.store
        fused = FUSED.get(self.backend)
        if fused and fused.batched(store):
            store.write(keys, values)
            return fused.attend_batch(store, query, scaling)  # one call for the whole batch
        out = torch.cat([self._attend_row(store.row(b), query[b : b + 1], keys[b : b + 1],
                                          values[b : b + 1], scaling)
                         for b in range(store.batch)])
        store.write(keys, values)
        return out

    def _seal_step(self, query: torch.Tensor, keys: torch.Tensor) -> None:
        """After a step's tokens are written: selections follow them, full residuals seal."""
        self.store.keep(self._sealing(query, keys))

    def _sealing(self, query: torch.Tensor, keys: torch.Tensor) -> Sealing:
        with fused_encoding(self.backend):  # sealed pages encode in the fused kernels
            return self.store.sealing(query, keys)

    def check(self) -> None:
        """Raise if a decode step since the last check stored a non-finite value (or one beyond
        the float16 range of a quantizing method's statistics): one host sync."""
        seen = _FLAGS.pop(self, None)
        bound = FLOAT16_MAX if self.method.quantizes else torch.finfo(torch.float32).max
        if seen is not None and not bool(seen <= bound):  # NaN compares false
            raise ValueError(f"non-finite keys or values in layer {self.layer_idx} during "
                             "decoding (or, for a quantizing method, beyond the float16 range "
                             "±65504): kvmix keeps finite values only (check the model's dtype "
                             "and inputs)")

    def _check_range(self, keys: torch.Tensor, values: torch.Tensor,
                          rows: list[int] | None = None) -> None:
        """A quantizing method's new tokens (keys in the cache's key space) fit float16 — its
        statistics and its float16 slots — or a ``RowFault`` naming their magnitude, before
        anything is rounded or changed (a decode step's are bounded alike on the device:
        ``peaks``, ``check``)."""
        if self.method.quantizes:
            check_float16_range(keys, values, self.layer_idx, rows)

    def _flag(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        _FLAGS[self] = peak(keys, values, _FLAGS.get(self))

    # -- the cache contract --------------------------------------------------------------------

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        hint = (f" (raise max_tokens or max_batch of make_cache; layer {self.layer_idx})")
        self.pool = PagePool(self.max_pages, hint)
        self.store = BatchStore(self.method, self.layer_idx, self.pool, self.sliding_window,
                                self.kind)
        self.pads: list[int] = []
        self.length = 0  # positions transformers sees, padding included
        self.pending = None
        self.stepping = False
        self.is_initialized = False
        self._undo: _Undo | None = None  # a continuous-batching step not committed yet
        self.peaks: torch.Tensor | None = None
        _FLAGS.pop(self, None)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` positions (transformers' negative convention)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop(tokens_to_remove={tokens_to_remove}): pass a negative "
                             "number of tokens to remove")
        self.length = max(self.length + tokens_to_remove, 0)
        for b, pad in enumerate(self.pads):
            self.store.truncate(b, max(self.length - pad, 0))
        self.pads = [min(pad, self.length) for pad in self.pads]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._pick(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._pick([b for b in range(self.store.batch) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._pick(torch.arange(self.store.batch)[indices.cpu()].tolist())

    def offload(self) -> None:
        self.store.to("cpu")
        self.pool.to("cpu")

    def prefetch(self) -> None:
        self.store.to(self.device)
        self.pool.to(self.device)

    # -- reading -------------------------------------------------------------------------------

    @property
    def rows(self) -> list[RowView]:
        """Each sequence, read-only (segments as views, pages gathered)."""
        return [self.store.row(b) for b in range(self.store.batch)]

    def nbytes_breakdown(self) -> Counter:
        """Bytes of the storages held, by kind (sink, residual, codes, scales, ..., free)."""
        return self.store.breakdown() + self.pool.breakdown()

    def tensors(self) -> list[torch.Tensor]:
        return self.store.tensors() + self.pool.tensors()

    def theoretical_nbytes(self, spec: ModelSpec) -> float:
        """The bit formula for what is held, plus capacity held unused (``free``)."""
        if not self.is_initialized:
            return 0.0
        return store_bytes(self.store, spec, self.dtype) + slack_bytes(self.store, spec,
                                                                        self.dtype)

    def history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference path for every sequence: keys, values [B, H, L, D] (sequences of equal
        length only: a padded batch has a history per row, ``rows[b].history``)."""
        rows = self.rows
        lengths = {len(row) for row in rows}
        if len(lengths) > 1:
            raise ValueError(f"sequences hold {sorted(lengths)} tokens: stack per row instead")
        held = [row.history(self.dtype) for row in rows]
        return torch.cat([k for k, _ in held]), torch.cat([v for _, v in held])

    def real_tokens(self) -> int:
        return sum(self.store.tokens(b) for b in range(self.store.batch))

    # -- helpers -------------------------------------------------------------------------------

    def _check_batch(self, batch: int) -> None:
        if self.max_batch is not None and batch > self.max_batch:
            raise ValueError(f"batch={batch} exceeds the cache's max_batch={self.max_batch} "
                             "(raise max_batch of make_cache)")

    def _read_pads(self, mask: torch.Tensor | None) -> None:
        """Leading padding per row from the mask's last query row ([B, 1, q, T]); only left
        padding is supported (padding after a real token would break the per-sequence layout)."""
        if mask is None:
            return
        valid = mask[:, 0, -1, : self.length]
        valid = valid if valid.dtype == torch.bool else valid == 0  # additive float masks
        first = torch.where(valid.any(-1), valid.int().argmax(-1), self.length)  # [B]
        pads = first.tolist()
        holes = [b for b, pad in enumerate(pads) if not valid[b, pad:].all()]
        if holes:
            raise ValueError(f"attention_mask rows {holes} have padding after a real token; "
                             "kvmix supports left padding only (tokenizer padding_side='left')")
        self.pads = pads

    def _attend_row(self, row: RowView, query: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, scaling: float) -> torch.Tensor:
        """The fused op for a few new queries over a history it can read, all of it visible;
        else the reference."""
        fused = FUSED.get(self.backend)
        if fused and len(row) and query.shape[-2] <= fused.MAX_QUERIES and not row.hides(
                query.shape[-2]):
            view = None if row.blocks is None else self.method.kernel_view(
                row.blocks, self.layer_idx, row.selection)
            if view is not None or row.blocks is None:
                return fused.attend(row, view, query, keys, values, scaling)
        return reference.attend(row, query, keys, values, scaling)

    def _pick(self, index: list[int]) -> None:
        """Rows in a new order; sealed pages are shared, float slots copied."""
        if not self.is_initialized:
            return
        self._check_batch(len(index))
        self.store.pick(index)
        self.pads = [self.pads[b] for b in index]
