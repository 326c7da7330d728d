"""Admission by bytes (docs/guide/serving.md): how the cache's storage splits the budget, and what
one request reserves of it.

At start-up the budget is split for requests of ``length`` tokens: ``rows`` requests of that
length fit it by the planner's formula (pages at the method's bits, selection, float slots for
the tokens the request can hold: its sink and residual, or fewer when it is shorter), and every
layer gets a float slot arena of ``arena`` slots (``rows`` such requests' extents) and a pool
of the pages ``rows`` requests of ``span`` tokens hold (``span`` >= ``length``: what the budget
leaves for pages once the rows are capped). Arena and pools are fixed tensors, and together
with the requests' selections they never hold more than ``memory``.

The policy is a full reservation by need: a request is admitted when its float slots (an extent
of ``extent(prompt + max_new_tokens)`` slots per choice: a short request takes less than a
whole sink and residual), the pages it will hold at ``prompt + max_new_tokens`` tokens and its
selection fit beside every running request's, and keeps them until it ends. A running request
therefore never lacks a slot or a page, so nothing is evicted, offloaded or re-prefilled (a
re-prefill would change a PN-Mix selection, and the output would no longer be what
``generate`` gives the prompt alone). When a request fits the budget's bytes but not the split
(short requests after long ones, or the reverse), the cache splits the bytes anew in the
proportions the reservations have (``split_bytes``): the split follows the load, and short
requests run more at once than ``rows``, up to ``most_rows``; longer ones run fewer.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvmix.capacity import kv_bytes
from kvmix.methods import Method
from kvmix.models.catalog import SLIDING, Architecture, from_config
from kvmix.runtime.accounting import formula_page_bytes, segment_bytes, segments
from kvmix.runtime.cache import max_pages

MOST_ROWS = 1024  # transformers' own cap on the requests of one batch
FOOTPRINTS = 4096  # request sizes whose footprint is remembered


@dataclass
class Budget:
    """The cache bytes a server may hold, how they are split, and the tokens of one forward."""

    method: Method  # bound to the model
    arch: Architecture
    dtype: torch.dtype
    memory: float  # bytes of KV cache, the method's static tensors included
    max_batch_tokens: int  # tokens of one forward: running requests' new tokens and prompts
    length: int  # tokens of the request the storage is split for
    _footprints: dict[int, dict[str, float]] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        for name in ("max_batch_tokens", "length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 2:
                raise ValueError(f"{name}={value!r} is invalid; expected an integer >= 2")
        if self.memory <= self.static:
            raise ValueError(f"memory={self.memory:.0f} bytes does not even hold the method's "
                             f"static tensors ({self.static:.0f} bytes)")
        if self.fits(self.length) < 1:
            raise ValueError(f"memory={self.memory / 1e6:.2f} MB holds no request of "
                             f"{self.length} tokens ({self.footprint(self.length) / 1e6:.2f} MB "
                             "each by the planner's formula): raise the memory or size the "
                             "split for shorter requests")

    @functools.cached_property
    def static(self) -> float:
        """Per-model bytes of the method (transforms, ...), held once."""
        return kv_bytes(self.method, self.arch, 1, 0, self.dtype)["static"]

    @functools.cached_property
    def slot_bytes(self) -> float:
        """Bytes of one float slot (a token's keys and values) in every layer."""
        return kv_bytes(self.method, self.arch, 1, 0, self.dtype)["free"] / self.row_slots

    @property
    def row_slots(self) -> int:
        """The most float slots a request holds: the method's sink and residual."""
        return self.method.sink + self.method.residual

    @functools.cached_property
    def page_bytes(self) -> list[float]:
        """Bytes of one page id in every layer of each window's kind (``windows``)."""
        spec = self.arch.spec()
        return [sum(formula_page_bytes(self.method, spec, i, self.dtype)
                    for i, kind in enumerate(self.arch.layer_types)
                    if (kind == SLIDING) == (w is not None)) for w in self.windows]

    def split_bytes(self, slots: int, pages: Sequence[int]) -> float:
        """Bytes of every layer's arena of ``slots`` slots and pools of ``pages`` pages (per
        window)."""
        return slots * self.slot_bytes + sum(
            n * size for n, size in zip(pages, self.page_bytes, strict=True))

    @property
    def room(self) -> float:
        """Bytes for requests: the budget less the method's static tensors."""
        return self.memory - self.static

    def extent(self, tokens: int) -> int:
        """Float slots a request of at most ``tokens`` tokens holds at most (per layer)."""
        return min(tokens, self.row_slots)

    @functools.cached_property
    def slots(self) -> float:
        """Bytes of the float slots of one request of ``length`` tokens (every layer)."""
        return self.extent(self.length) * self.slot_bytes

    def footprint(self, tokens: int) -> float:
        """Bytes one request holds at ``tokens`` tokens, the planner's formula, its float slots
        priced at its extent (the slots it may fill, not a whole sink and residual)."""
        parts = self._parts(tokens)
        unused = (self.row_slots - self.extent(tokens)) * self.slot_bytes
        return sum(parts.values()) - parts["static"] - unused

    def _parts(self, tokens: int) -> dict[str, float]:
        """The planner's formula for one request of ``tokens`` tokens, by segment."""
        if tokens not in self._footprints:
            if len(self._footprints) >= FOOTPRINTS:  # a bounded memo, whatever clients ask
                self._footprints.clear()
            self._footprints[tokens] = kv_bytes(self.method, self.arch, 1, tokens, self.dtype)
        return self._footprints[tokens]

    def fits(self, tokens: int) -> int:
        """How many requests of ``tokens`` tokens the budget holds at once."""
        return int((self.memory - self.static) // self.footprint(tokens))

    @functools.cached_property
    def rows(self) -> int:
        """Requests of ``length`` tokens that run at once (each decodes a token at every
        forward): what the storage is split for."""
        return min(self.fits(self.length), self.most_rows)

    @property
    def most_rows(self) -> int:
        """Requests that may run at once, however short: every running request decodes a
        token at every forward."""
        return min(self.max_batch_tokens - 1, MOST_ROWS)

    @functools.cached_property
    def arena(self) -> int:
        """Float slots of each layer's arena: ``rows`` requests of ``length`` tokens."""
        return self.rows * self.extent(self.length)

    @functools.cached_property
    def windows(self) -> list[int | None]:
        """The distinct windows of the model's layers (None: full attention)."""
        return sorted({self.arch.sliding_window if kind == SLIDING else None
                       for kind in self.arch.layer_types}, key=lambda w: w or 0)

    def pages(self, tokens: int) -> list[int]:
        """Pages one request of ``tokens`` tokens holds at most, per window of ``windows``."""
        return [max_pages(self.method, 1, tokens, w) for w in self.windows]

    def reservation(self, tokens: int, prompt: int, n: int = 1
                    ) -> tuple[Reservation, Reservation]:
        """(what each of a request's ``n`` choices holds at ``tokens`` tokens, what they share).
        With n > 1 the prompt less its last token is prefilled once and its sealed pages are
        shared by every choice (full-attention layers: a sliding window releases them);
        one choice shares nothing."""
        selection = self._parts(tokens)["selection"]
        whole = Reservation(self.footprint(tokens), tuple(self.pages(tokens)),
                            self.extent(tokens), selection)
        if n == 1:
            return whole, Reservation(0.0, (0,) * len(self.windows), 0, 0.0)
        held = segments(self.method, prompt - 1)
        spec = self.arch.spec()
        shared = Reservation(
            sum(segment_bytes(self.method, spec, i, held, self.dtype)["blocks"]
                for i, kind in enumerate(self.arch.layer_types) if kind != SLIDING),
            tuple(held.blocks if w is None else 0 for w in self.windows), 0, 0.0)
        own = Reservation(whole.nbytes - shared.nbytes,
                          tuple(w - s for w, s in zip(whole.pages, shared.pages, strict=True)),
                          whole.slots, whole.selection)
        return own, shared

    def need(self, own: Reservation, shared: Reservation, n: int) -> list[int]:
        """Pages per window ``n`` choices hold together."""
        return [n * o + s for o, s in zip(own.pages, shared.pages, strict=True)]

    def held_bytes(self, own: Reservation, shared: Reservation, n: int) -> float:
        """What ``n`` choices hold of the storage: their extents and pages in a split, and
        their selections."""
        return self.split_bytes(n * own.slots, self.need(own, shared, n)) + n * own.selection

    @functools.cached_property
    def span(self) -> int:
        """The longest requests of which ``rows`` fit the budget (>= ``length``)."""
        room = self.memory - self.static
        return _last(self.length, 1 << 24, lambda t: self.rows * self.footprint(t) <= room)

    @functools.cached_property
    def capacity(self) -> list[int]:
        """Pages of each layer's pool, per window: ``rows`` requests of ``span`` tokens."""
        return [max_pages(self.method, self.rows, self.span, w) for w in self.windows]

    @functools.cached_property
    def longest(self) -> int:
        """The most tokens one request can reach: the model's positions, or what the whole
        budget holds for it alone (split for it)."""
        return _last(1, self.arch.max_positions or 1 << 24, lambda t: self.held_bytes(
            *self.reservation(t, t), 1) <= self.room)

    def refusal(self, prompt: int, new_tokens: int | None, n: int = 1) -> str | None:
        """Why a request of ``prompt`` tokens asking for ``new_tokens`` in ``n`` choices can
        never be served, or None."""
        why = size_refusal(prompt, new_tokens, self.arch.max_positions)
        if why:
            return why
        if prompt > self.max_batch_tokens:
            return (f"the prompt ({prompt} tokens) exceeds max_batch_tokens="
                    f"{self.max_batch_tokens}, the tokens of one forward (a prompt is never "
                    "split)")
        if prompt + new_tokens > self.longest:
            return (f"the request needs {self.footprint(prompt + new_tokens) / 1e6:.2f} MB of "
                    f"cache at {prompt + new_tokens} tokens, beyond the budget memory="
                    f"{self.memory / 1e6:.2f} MB (at most {self.longest} tokens for one request "
                    "alone)")
        if n > 1:
            return self._choices_refusal(prompt, new_tokens, n)
        return None

    def _choices_refusal(self, prompt: int, new_tokens: int, n: int) -> str | None:
        if prompt < 2:
            return f"n={n} choices need a prompt of at least 2 tokens (it has {prompt})"
        own, shared = self.reservation(prompt + new_tokens, prompt, n)
        held = self.held_bytes(own, shared, n)
        if n > self.most_rows or held > self.room:
            return (f"n={n} choices of {prompt} + {new_tokens} tokens need {n} rows and "
                    f"{held / 1e6:.2f} MB of float slots, pages and selections, beyond the "
                    f"budget memory={self.memory / 1e6:.2f} MB ({self.most_rows} rows, "
                    f"{self.room / 1e6:.2f} MB for requests)")
        return None


@dataclass(frozen=True)
class Reservation:
    """Bytes (the planner's formula), pages per window, float slots (per layer) and selection
    bytes held at a request's longest."""

    nbytes: float
    pages: tuple[int, ...]
    slots: int
    selection: float


def size_refusal(prompt: int, new_tokens: int | None, positions: int | None) -> str | None:
    """Why a request's sizes are never servable on any cache: no new tokens, an empty prompt,
    or more tokens than the model's ``positions``; None when they are."""
    if new_tokens is None or new_tokens < 1:
        return f"max_tokens={new_tokens} is invalid; expected an integer >= 1"
    if prompt < 1:
        return "the prompt is empty; expected at least 1 token"
    if positions is not None and prompt + new_tokens > positions:
        return (f"the prompt ({prompt} tokens) plus max_tokens={new_tokens} exceeds the "
                f"model's {positions} positions")
    return None


def _last(low: int, high: int, holds) -> int:
    """The largest t in [low, high] for which ``holds(t)``, a predicate true at ``low`` and
    monotone (true, then false)."""
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if holds(middle) else (low, middle - 1)
    return low


def model_architecture(model) -> Architecture:
    """The planner's view of a loaded model (its config)."""
    config = model.config.get_text_config(decoder=True)
    return from_config(config.to_dict(), getattr(config, "_name_or_path", "") or "model")
