"""Continuous batching on transformers' own machinery with kvmix's packed pool underneath
(docs/guide/serving.md): transformers' scheduler, request states, output routing and streaming
decide which requests run at each step; every attention layer keeps its tokens in a ``KVMixLayer``
(float slots and a page pool, one row per running request).

The seam (transformers 5.24; the private parts are why the pin is exact):

* ``KVMixPagedCache`` — a ``PagedAttentionCache`` subclass that allocates no float cache. The
  scheduler asks it whether a request fits (``can_store_request_tokens``: admission by bytes,
  ``Budget``) and tells it when one ends (``free_blocks``: its pages return to the pool); the
  batch builder calls ``extend_read_and_write_indices`` once per request in batch order, which
  is where it learns which segment of the flat batch is which request; ``update`` stages a
  layer's new keys and values; ``prepare_fork_request`` makes a request's other choices rows
  that share its pages.
* ``paged_attention`` — the attention function registered as ``kvmix_paged``: one decode call
  for every running request (the fused op, one call per layer), then each admitted request's
  prompt attended over itself and laid out, as ``generate`` does.
* ``KVMixManager`` — a ``ContinuousBatchingManager`` subclass overriding
  ``switch_to_cb_friendly_attn`` (which accepts only paged|eager, sdpa and flash) and
  ``_create_batch_processor`` (which builds ``PagedAttentionCache`` itself), with per-request
  sampling and fault containment (``engine.Served``).

A prompt is never split across forwards (each request's selection and sink come from its whole
prompt, as alone; the prompt of ``n`` choices less its last token, which each choice then
decodes), and every running request decodes at every step, so the rows of each layer are
exactly the requests decoding plus the ones joining. A step is staged in every layer and
committed once the forward and its sampling went through, or rolled back (``rollback``: every
layer, and the rows, as before the step) so that the requests not at fault can retry it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import (
    ContinuousBatchingManager,
    FIFOScheduler,
    PagedAttentionCache,
)
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor
from transformers.generation.continuous_batching.initialization import (
    update_cb_config_after_cache_creation,
)

from kvmix.capacity import parse_memory
from kvmix.methods import Method, parse_method
from kvmix.models.catalog import FULL, SLIDING, Architecture
from kvmix.runtime.attention import build_cache, check_window
from kvmix.runtime.cache import KVMixCache
from kvmix.runtime.folding import prepare_model
from kvmix.runtime.pool import FREE
from kvmix.runtime.steps import Upload
from kvmix.runtime.store import FLOAT16_MAX, RowFault
from kvmix.serving.budget import Budget, Reservation, model_architecture
from kvmix.serving.engine import Served, greedy
from kvmix.serving.sampling import RequestFault

NAME = "kvmix_paged"
DEFAULT_MAX_BATCH_TOKENS = 2048


@dataclass
class ForwardSegments:
    """Which segment of one forward's flat batch is which request."""

    decode: torch.Tensor | None  # [B] position of every row's new token, in row order
    joins: list[tuple[int, int]]  # (start, length) of each admitted request's prompt
    ids: list[str]  # row -> request id, the joining rows last
    extents: list[int]  # float slots of each admitted request's row

    def blame(self, fault: RowFault) -> RequestFault:
        """A layer refused some rows' tokens: the requests they belong to."""
        return RequestFault({self.ids[row]: str(fault) for row in fault.rows})


@dataclass
class Family:
    """The ``n`` choices of one request: what each reserves, the prompt pages they share
    (released with the last of them), the choices forked so far and those still to come."""

    own: Reservation
    shared: Reservation
    members: set[str]
    unborn: int

    @property
    def nbytes(self) -> float:
        return self.shared.nbytes + self.own.nbytes * (len(self.members) + self.unborn)


class _Handoff(threading.local):
    """What a layer's ``update`` left pending for its attention call."""

    pending: tuple | None = None


_HANDOFF = _Handoff()


class _Group:
    """What transformers' batch builder reads of an allocator: kvmix's pool keeps no token
    indices, so reads and writes go nowhere."""

    read_trash_index = write_trash_index = 0

    def __init__(self, index: int, layer_type: str, window: int | None):
        self.index, self.layer_type, self.window = index, layer_type, window

    def get_seqlen_k(self, past_length: int, query_length: int) -> int:
        seen = past_length if self.window is None else min(past_length, self.window - 1)
        return seen + query_length


class _NoSectors:
    def try_to_free_sectors(self) -> None:
        """kvmix's pool frees a request's pages when it ends."""


class KVMixPagedCache(PagedAttentionCache):
    """Continuous batching's cache, kept by a ``KVMixCache`` sized once from the budget: one
    row per running request in every layer, admission by the pages each request reserves."""

    def __init__(self, model: Any, method: Method, budget: Budget, backend: str = "auto"):
        # PagedAttentionCache.__init__ sizes and allocates a float cache: not called
        self.config = model.config.get_text_config(decoder=True)
        self.device, self.dtype = model.device, model.dtype
        self.kv: KVMixCache = build_cache(model, method, backend, budget.rows, budget.span)
        self.budget = budget
        self.layers = self.kv.packed_layers
        for layer in self.layers:  # rows by need: as many as the arena's extents allow
            layer.max_batch, layer.max_slots = budget.most_rows, budget.arena
        self.cache_allocators = {_kind(w): _Group(i, _kind(w), w)
                                 for i, w in enumerate(budget.windows)}
        self.max_batch_tokens = budget.max_batch_tokens
        # the scheduler's bound on the tokens a forward's requests hold: never the binding one
        self.max_tokens_read = budget.most_rows * budget.longest
        self.num_blocks = budget.rows  # transformers' config records it; no float blocks
        self.max_blocks_per_request = 0  # no flash block-table path
        self.max_decode_fast_path_length = 0
        self.read_cache_limit = None
        self.use_prefix_sharing = self.allow_block_sharing = False
        self.bytes_per_sector = 1
        self.pool = _NoSectors()
        self.reserved: dict[str, Family] = {}  # every admitted request (each choice) -> family
        self.pages_reserved = [0] * len(budget.windows)
        self.rows_reserved = self.slots_reserved = 0
        self.selection_reserved = 0.0
        self.arena, self.pools = budget.arena, list(budget.capacity)  # the split now
        self.splits = 0  # times the split followed the load
        self.rows: dict[str, int] = {}  # request id -> its row in every layer
        self.order: list[str] = []  # row -> request id
        self.peak_nbytes = 0
        # fault injection (tests, drills): called with (request id, tokens it holds) for every
        # request of a step before the forward; what it raises fails that request alone
        self.inject: Callable[[str, int], None] | None = None
        self._entries: list[tuple[str, int, int]] = []
        self._step: ForwardSegments | None = None
        self._positions = Upload()  # each running row's place in the forward, on the device
        self._before: tuple[dict[str, int], list[str]] | None = None  # rows before the step
        self._waiting_refused = False

    # -- admission (the scheduler's questions) -------------------------------------------------

    def begin_round(self) -> None:
        """A scheduling round starts: requests wait in order of arrival (once one is refused,
        no later one jumps it)."""
        self._waiting_refused = False

    def can_store_request_tokens(self, state: Any, request_len: int,
                                 dry_run: bool = False) -> bool:
        """A running request always fits (it reserved the slots and pages of its longest
        length); a new one fits when its whole prompt is in this forward, a row and an extent
        of float slots are free for each of its choices and their pages fit beside every
        running request's."""
        if state.request_id in self.reserved:
            return True
        n = 1 + state.num_children
        prompt = len(state.initial_tokens)
        own, shared = self.budget.reservation(prompt + state.max_new_tokens, prompt, n)
        need = self.budget.need(own, shared, n)
        fits = (not self._waiting_refused
                and request_len == len(state.remaining_prefill_tokens)  # never split a prompt
                and self.rows_reserved + n <= self.budget.most_rows
                and self._room_for(n * own.slots, need, n * own.selection, dry_run))
        if fits and not dry_run:
            self.reserved[state.request_id] = Family(own, shared, {state.request_id}, n - 1)
            self._hold(n, need, n * own.slots, n * own.selection)
        self._waiting_refused |= not fits
        return fits

    def _room_for(self, slots: int, pages: list[int], selection: float, dry_run: bool) -> bool:
        """Whether ``slots``, ``pages`` per window and ``selection`` bytes more fit beside
        every running request's: in the arena and pools as split now, or, when their bytes fit
        the budget, once it is split anew (``_resplit``; not on a dry run)."""
        budget = self.budget
        arena = self.slots_reserved + slots
        pools = [used + k for used, k in zip(self.pages_reserved, pages, strict=True)]
        room = budget.room - self.selection_reserved - selection  # for arena and pools
        if budget.split_bytes(arena, pools) > room:
            return False
        if (arena > self.arena or any(p > c for p, c in zip(pools, self.pools, strict=True))
                or budget.split_bytes(self.arena, self.pools) > room) and not dry_run:
            self._resplit(arena, pools, room)
        return True

    def _resplit(self, slots: int, pages: list[int], room: float) -> None:
        """Split ``room`` bytes anew between every layer's arena and pools: ``slots`` and
        ``pages`` per window (what the requests reserve) scaled by the same factor, so the
        bytes left over follow the proportions the load has. Rows are compacted into the new
        arenas and pages in use renumbered into the new pools."""
        budget = self.budget
        scale = room / budget.split_bytes(slots, pages)
        self.arena, self.pools = int(slots * scale), [int(p * scale) for p in pages]
        for layer in self.layers:
            window = budget.windows.index(layer.sliding_window)
            layer.max_slots, layer.max_pages = self.arena, self.pools[window]  # and at a reset
            layer.store.resize_slots(self.arena)
            layer.store.renumber(layer.pool.resize(self.pools[window]))
        self.splits += 1

    def _hold(self, rows: int, pages: list[int] | tuple[int, ...], slots: int,
              selection: float) -> None:
        """Reserve (or, negative, release) rows, pages per window, float slots and selection
        bytes."""
        self.rows_reserved += rows
        self.slots_reserved += slots
        self.selection_reserved += selection
        self.pages_reserved = [used + k for used, k in zip(self.pages_reserved, pages,
                                                            strict=True)]

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        """A request ended (finished, failed or cancelled): its reservation and its row go
        (with the choices it never forked; the pages its choices share with the last of them);
        its pages return to every layer's pool."""
        family = self.reserved.pop(request_id, None)
        if family is not None:
            family.members.discard(request_id)
            gone = 1 + family.unborn  # the forks to come never come once the prompt's row goes
            family.unborn = 0
            own = family.own
            self._hold(-gone, [-gone * k for k in own.pages], -gone * own.slots,
                       -gone * own.selection)
            if not family.members:
                self._hold(0, [-k for k in family.shared.pages], 0, 0.0)
        row = self.rows.pop(request_id, None)
        if row is None:
            return
        for layer in self.layers:
            if row < layer.store.batch:  # a forward that failed may not have reached every layer
                layer.leave(row)
        last = self.order.pop()
        if row < len(self.order):
            self.order[row] = last
            self.rows[last] = row

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        for layer in self.layers:
            layer.reset()
        self.reserved.clear()
        self.pages_reserved = [0] * len(self.pages_reserved)
        self.rows_reserved = self.slots_reserved = 0
        self.selection_reserved = 0.0
        self.rows.clear()
        self.order.clear()
        self._entries, self._step, self._before = [], None, None

    def reset(self) -> None:
        self.free_all_requests()

    def compute_free_capacity(self, relative: bool = True) -> float:
        room = self.budget.memory - self.budget.static
        free = room - self.reserved_bytes()
        return free / room if relative else free

    def reserved_bytes(self) -> float:
        """What the admitted requests will hold at their longest, by the planner's formula
        (the pages choices share counted once)."""
        families = {id(f): f for f in self.reserved.values()}
        return sum(f.nbytes for f in families.values())

    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        return 0  # no prefix sharing: a shared prefix would share a selection made for another

    def count_new_complete_blocks(self, state: Any, request_len: int) -> dict[str, int]:
        return {}

    def mark_complete_blocks(self, state: Any, complete_blocks: dict[str, int]) -> None:
        return None

    def evict_cached_blocks(self) -> bool:
        return False

    # -- choices: a request's n rows fork from its prompt's row --------------------------------

    def prepare_fork_request(self, state: Any, new_request_ids: list[str],
                             fork_src_and_dst: Any) -> list[str]:
        """After a request's prompt (less its last token) was prefilled: its other choices
        become rows sharing its pages, every layer, each with the reservation it made room
        for at admission."""
        family = self.reserved[state.request_id]
        row = self.rows[state.request_id]
        for layer in self.layers:
            layer.fork(row, len(new_request_ids))
        for request_id in new_request_ids:
            self.rows[request_id] = len(self.order)
            self.order.append(request_id)
            self.reserved[request_id] = family
            family.members.add(request_id)
            family.unborn -= 1
        return list(new_request_ids)

    def perform_cache_copy(self, fork_src_and_dst: Any) -> None:
        """Forked rows share their pages: nothing is copied."""

    # -- the step: which request is where in the flat batch ------------------------------------

    def extend_read_and_write_indices(self, request_id: str, past_length: int, query_length: int,
                                      read_index: Any, write_index: Any) -> None:
        """Called once per request of the next forward, in batch order."""
        self._entries.append((request_id, past_length, query_length))

    # -- the step: staged in every layer, then committed or rolled back ------------------------

    def step_faults(self) -> tuple[list[tuple[str, str]], torch.Tensor | None]:
        """The decoding rows' requests, each with a message template, and per row the first
        layer whose new keys or values are non-finite (or, for a quantizing method, beyond the
        float16 range), -1 where none is: [B] float32 on the device (read with the logits)."""
        if self._step is None or self._step.decode is None:
            return [], None
        peaks = torch.stack([layer.peaks for layer in self.layers])  # [L, B]
        bound = FLOAT16_MAX if self.kv.method.quantizes else torch.finfo(torch.float32).max
        bad = ~(peaks <= bound)  # NaN compares false
        first = torch.where(bad.any(0), bad.float().argmax(0), -1.0)
        why = ("non-finite keys or values in layer {layer} (or, for a quantizing method, "
               "beyond the float16 range ±65504): kvmix keeps finite values only")
        return [(rid, why) for rid in self._step.ids[: len(first)]], first.float()

    def commit(self) -> None:
        """The forward went through: every layer keeps the step, or none does (what can fail
        is computed in every layer first; a fault there leaves the step to ``rollback``)."""
        sealings = [layer.prepare_commit() for layer in self.layers]
        for layer, sealing in zip(self.layers, sealings, strict=True):
            layer.keep(sealing)
        self._entries, self._step, self._before = [], None, None

    def rollback(self) -> None:
        """The step is undone in every layer it reached: rows are what they were before it."""
        for layer in self.layers:
            layer.rollback()
        if self._before is not None:
            self.rows, self.order = self._before
        self._entries, self._step, self._before = [], None, None

    def fill_block_table(self, *args: Any) -> None:
        raise RuntimeError("kvmix's paged cache has no block-table path")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage a layer's new tokens, [1, H, T, D] for the whole flat batch, for its attention
        call; returns them."""
        if self._step is None:
            if self.config._attn_implementation != NAME:
                raise RuntimeError(f"the model's attention is {self.config._attn_implementation!r}"
                                   f", not {NAME!r}: it was switched while serving (use another "
                                   "copy of the model for generate)")
            self._step = self._segments()
        layer = self.kv.layers[layer_idx]
        keys = layer.method.transform_keys(key_states, layer_idx)
        _HANDOFF.pending = layer, self._step, keys, value_states
        return key_states, value_states

    def _segments(self) -> ForwardSegments:
        """The forward's segments: every row's new token (each running request decodes) and
        the prompts of the requests admitted now, which become the next rows."""
        self._before = dict(self.rows), list(self.order)
        if self.inject is not None:
            for request_id, past, _ in self._entries:
                try:
                    self.inject(request_id, past)
                except Exception as error:
                    raise RequestFault({request_id: f"{type(error).__name__}: {error}"}) \
                        from error
        positions: list[int | None] = [None] * len(self.order)
        joins, start = [], 0
        for request_id, past, length in self._entries:
            row = self.rows.get(request_id)
            if row is None:
                joins.append((request_id, start, length))
            elif length != 1 or past != self.layers[0].store.seen(row):
                raise RuntimeError(f"request {request_id} holds {self.layers[0].store.seen(row)} "
                                   f"tokens but the batch continues it at {past} with {length}")
            else:
                positions[row] = start
            start += length
        missing = [self.order[b] for b, at in enumerate(positions) if at is None]
        if missing:
            raise RuntimeError(f"running requests {missing} are not in this forward: kvmix's "
                               "pool decodes every running request at every step")
        for request_id, _, _ in joins:
            self.rows[request_id] = len(self.order)
            self.order.append(request_id)
        decode = self._positions.fill(positions, self.device) if positions else None
        return ForwardSegments(decode, [(at, length) for _, at, length in joins], list(self.order),
                    [self.reserved[request_id].own.slots for request_id, _, _ in joins])

    # -- figures -------------------------------------------------------------------------------

    def figures(self) -> dict[str, float]:
        """Pages used and free (every layer), bytes held and reserved, for the metrics."""
        kinds = self.kv.nbytes_breakdown()
        nbytes = sum(kinds.values())
        self.peak_nbytes = max(self.peak_nbytes, nbytes)
        return {"pages_used": sum(layer.pool.used for layer in self.layers),
                "pages_free": sum(len(layer.pool.free) for layer in self.layers),
                "pages_unreserved": self.unreserved_pages(),
                "cache_bytes": nbytes, "cache_peak_bytes": self.peak_nbytes,
                "cache_held_bytes": nbytes - kinds.get(FREE, 0),
                "reserved_bytes": self.reserved_bytes() + self.budget.static,
                "budget_bytes": self.budget.memory,
                "kv_usage": 1 - self.compute_free_capacity(relative=True),
                "room": self.room(), "rows": self.budget.rows,
                "slots_reserved": self.slots_reserved, "splits": self.splits}

    def unreserved_pages(self) -> int:
        """Pages no admitted request will take, every layer (what a router weighs: pages
        free now but reserved by a running request are not)."""
        spans = [sum(1 for layer in self.layers if layer.sliding_window == w)
                 for w in self.budget.windows]
        return sum(n * (cap - used) for n, cap, used in zip(
            spans, self.pools, self.pages_reserved, strict=True))

    def room(self) -> int:
        """How many more requests of the length the budget was split for fit now (rows, and
        the bytes no running request reserves), as a router weighs replicas."""
        budget = self.budget
        free = budget.room - self.selection_reserved - budget.split_bytes(
            self.slots_reserved, self.pages_reserved)
        each = budget.held_bytes(*budget.reservation(budget.length, budget.length), 1)
        return max(min(budget.most_rows - self.rows_reserved, int(free // each)), 0)


def _kind(window: int | None) -> str:
    return "full_attention" if window is None else "sliding_attention"


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: Any,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """One layer of a continuous-batching forward: query [1, Hq, T, D] of the flat batch ->
    [1, T, Hq, D]. Every running request's token in one decode call, then each admitted
    prompt over itself."""
    layer, step, keys, values = _HANDOFF.pending
    _HANDOFF.pending = None
    check_window(layer, kwargs.get("sliding_window"))
    query = layer.method.transform_queries(query, layer.layer_idx)
    scaling = kwargs.get("scaling") or module.scaling
    out = torch.empty_like(query)
    if step.decode is not None:
        rows = [x[0][:, step.decode].transpose(0, 1)[:, :, None] for x in (query, keys, values)]
        out[0][:, step.decode] = layer.decode(*rows, scaling)[:, :, 0].transpose(0, 1)
    if step.joins:
        spans = [slice(at, at + length) for at, length in step.joins]
        prompts = [tuple(x[:, :, span] for x in (query, keys, values)) for span in spans]
        try:
            joined = layer.join(prompts, scaling, step.extents)
        except RowFault as fault:
            raise step.blame(fault) from fault
        for span, o in zip(spans, joined, strict=True):
            out[:, :, span] = o
    return out.transpose(1, 2), None


def register() -> None:
    AttentionInterface.register(NAME, paged_attention)


def served_architecture(model: Any, cache: KVMixCache) -> Architecture:
    """The planner's view of the model, with the layer kinds and window its cache has."""
    if len(cache.packed_layers) < len(cache.layers):
        raise ValueError("kvmix serves models whose attention layers are all full or "
                         "sliding-window ones; this one has layers of another kind")
    windows = {layer.sliding_window for layer in cache.packed_layers} - {None}
    if len(windows) > 1:
        raise ValueError(f"the model's layers have sliding windows of {sorted(windows)} tokens; "
                         "kvmix serve sizes its pools for one window")
    kinds = tuple(SLIDING if layer.is_sliding else FULL for layer in cache.packed_layers)
    return replace(model_architecture(model), layer_types=kinds,
                   sliding_window=next(iter(windows), None))


class KVMixScheduler(FIFOScheduler):
    """transformers' FIFO scheduler, telling the cache when a round starts."""

    def schedule_batch(self, token_budget: int, cache_budget: int):
        self.cache.begin_round()
        return super().schedule_batch(token_budget, cache_budget)


class KVMixManager(Served, ContinuousBatchingManager):
    """transformers' continuous batching (scheduler, request states, streaming, results) with
    kvmix's packed pool as its cache: ``add_request`` / ``get_result`` /
    ``request_id_iter`` / ``register_result_handler`` as transformers documents them, each
    request with its own ``Sampling`` (greedy by default, as ``generate``) and ``n`` choices
    that share its prompt's pages. No beams (they stay on ``generate``)."""

    def __init__(self, model: Any, method: str | Method, memory: float | str,
                 backend: str = "auto", max_new_tokens: int = 128,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, length: int | None = None):
        """memory: the KV cache budget, bytes or a size like ``"2GB"``; length: the tokens
        (prompt + new) of the request the cache's storage is split for (``Budget``; default
        512 + max_new_tokens, within the model's positions)."""
        self.method = parse_method(method)
        memory = parse_memory(memory) if isinstance(memory, str) else float(memory)
        self.backend = backend
        model = prepare_model(model, self.method)
        cache = build_cache(model, self.method, backend)  # refuses what it must; binds the method
        arch = served_architecture(model, cache)
        if length is None:
            length = min(512 + max_new_tokens, arch.max_positions or 1 << 30)
        self.budget = Budget(self.method, arch, model.dtype, memory, max_batch_tokens, length)
        config = ContinuousBatchingConfig(
            max_batch_tokens=max_batch_tokens, max_requests_per_batch=self.budget.most_rows,
            max_blocks_per_request=0, allow_block_sharing=False, use_async_batching=False,
            use_cuda_graph=False, cpu_offload_space=0.0, auto_switch_to_flash=False,
            return_logprobs=True)
        super().__init__(model, greedy(model, max_new_tokens), config)
        self._serve(model)
        # fault injection (tests, drills), handed to the cache: ``KVMixPagedCache.inject``
        self.inject: Callable[[str, int], None] | None = None

    def switch_to_cb_friendly_attn(self, model: Any, auto_switch_to_flash: bool = True) -> None:
        register()
        if model.config._attn_implementation != NAME:
            self._original_attn_impl = model.config._attn_implementation
            model.set_attn_implementation(NAME)

    def refusal(self, prompt: int, new_tokens: int | None, n: int = 1) -> str | None:
        """Why such a request can never be served, or None (``Budget.refusal``)."""
        return self.budget.refusal(prompt, new_tokens, n)

    def add_request(self, input_ids: list[int], request_id: str | None = None,
                    max_new_tokens: int | None = None, *args: Any, n: int = 1,
                    **kwargs: Any) -> str | None:
        """``Served.add_request``, after refusing a request that can never fit."""
        new_tokens = self.generation_config.max_new_tokens if max_new_tokens is None \
            else max_new_tokens
        why = self.refusal(len(input_ids), new_tokens, n)
        if why:
            raise ValueError(why)
        return super().add_request(input_ids, request_id, new_tokens, *args, n=n, **kwargs)

    @property
    def cache(self) -> KVMixPagedCache | None:
        processor = self.batch_processor
        return None if processor is None else processor.cache

    def _create_batch_processor(self) -> ContinuousBatchProcessor:
        """transformers' own, with kvmix's cache and scheduler."""
        if isinstance(self.batch_processor, ContinuousBatchProcessor):
            self.batch_processor.reset()
            return self.batch_processor
        cache = KVMixPagedCache(self.model, self.method, self.budget, self.backend)
        cache.inject = self.inject
        config = self.continuous_batching_config
        update_cb_config_after_cache_creation(config, cache.num_blocks, cache.max_batch_tokens)
        scheduler = KVMixScheduler(cache, 0.0, config.max_requests_per_batch)
        return self._runner(ContinuousBatchProcessor(
            cache=cache, config=self.model.config.get_text_config(),
            generation_config=self.generation_config, continuous_batching_config=config,
            logit_processor=self.logit_processor, input_queue=self.input_queue,
            cancel_queue=self.cancel_queue, output_router=self.output_router,
            background_thread_status=self.background_thread_status,
            model_device=self.model.device, model_dtype=self.model.dtype, scheduler=scheduler,
            distributed_helper=self.distributed_helper))


def generate_batch(model: Any, prompts: list[list[int]], method: str | Method = "kivi2",
                   max_new_tokens: int = 128, memory: float | str = 1e9, backend: str = "auto",
                   max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS) -> list[list[int]]:
    """Greedy continuous batching of ``prompts`` (token ids) with a kvmix cache of ``memory``
    bytes: requests join as their bytes fit and leave as they finish -> each prompt's new
    tokens, in order (each what ``generate`` gives that prompt alone with the method)."""
    longest = max((len(p) for p in prompts), default=1) + max_new_tokens
    manager = KVMixManager(model, method, memory, backend, max_new_tokens, max_batch_tokens,
                           length=max(longest, 2))  # every request fits the split
    for prompt in prompts:
        why = manager.refusal(len(prompt), max_new_tokens)
        if why:
            raise ValueError(why)
    return [result.generated_tokens for result in manager.complete(prompts, max_new_tokens)]
