"""What the bit formulas say a cache should hold: the sequences' segments in one layer, from the
tokens each segment holds, and the pages in use. The cache sets it beside what it holds; the
capacity planner uses the same function for caches that do not exist yet (one source of truth
for bytes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmix.methods import Method, ModelSpec
from kvmix.runtime.arena import token_bytes
from kvmix.runtime.store import BatchStore, sealed_groups


@dataclass(frozen=True)
class Segments:
    """Tokens of one sequence in one layer, by segment (blocks counted whole)."""

    sink: int
    blocks: int
    residual: int


def segments(method: Method, tokens: int, window: int | None = None) -> Segments:
    """The flush rule in closed form: where ``tokens`` real tokens sit (in a sliding-window
    layer of ``window`` tokens, less the pages the next query cannot see: released)."""
    sink = min(tokens, method.sink)
    rest = tokens - sink
    blocks = sealed_groups(method, rest)
    released = 0 if window is None else min(max((tokens - window + 1 - sink) // method.group,
                                                 0), blocks)
    return Segments(sink, blocks - released, rest - blocks * method.group)


def segment_bytes(method: Method, spec: ModelSpec, layer: int, held: Segments,
                  dtype: torch.dtype, selected: bool = True) -> dict[str, float]:
    """Bytes by segment: sink and residual at the method's slot dtype for a model in ``dtype``,
    blocks at the method's bits, and the prefill-time selection (once a sequence has been
    prefilled)."""
    elements = spec.n_kv_heads * spec.head_dim  # per token, keys or values
    key_bits, value_bits = method.bits(layer, dtype)
    slot = slot_bytes(method, spec, dtype)
    return {"sink": held.sink * slot,
            "blocks": elements * held.blocks * method.group * (key_bits + value_bits) / 8,
            "residual": held.residual * slot,
            "selection": method.selection_bits(spec) / 8 if selected else 0.0}


def store_bytes(store: BatchStore, spec: ModelSpec, dtype: torch.dtype) -> float:
    """What ``store``'s segments should take by the bit formula: each sequence's sink, residual
    and selection, and every page in use once (beams share pages)."""
    method, layer = store.method, store.layer
    rows = sum(sum(segment_bytes(method, spec, layer, Segments(store.sink_len[b], 0,
                                                             store.res_len[b]), dtype,
                                 store.prefilled[b]).values()) for b in range(store.batch))
    return rows + store.pool.used * formula_page_bytes(method, spec, layer, dtype)


def slack_bytes(store: BatchStore, spec: ModelSpec, dtype: torch.dtype) -> float:
    """Capacity held but not in use, by the same formulas: float slots no token fills and free
    pages of the pool (reported as ``free``)."""
    if store.keys is None:
        return 0.0
    unused = store.slot_capacity - sum(store.sink_len) - sum(store.res_len)
    free = len(store.pool.free) * formula_page_bytes(store.method, spec, store.layer, dtype)
    return unused * slot_bytes(store.method, spec, dtype) + free


def slot_bytes(method: Method, spec: ModelSpec, dtype: torch.dtype) -> int:
    """One token's keys and values in a float slot (sink or residual) of a model in ``dtype``."""
    return token_bytes(spec.n_kv_heads, spec.head_dim, method.slot_dtype(dtype))


def open_groups_bytes(method: Method, spec: ModelSpec, staging: torch.dtype, slots: int,
                      staged_values: bool = True) -> int:
    """What the open groups of ``slots`` sequences take in every layer, staged as floats of
    ``staging`` (kvmix's vLLM plugin): their keys and values (keys only where
    ``staged_values`` is False: values written to their pages as they arrive), and where the
    method selects from queries, the query sums gathered over the group (the method bound to
    ``spec``)."""
    group = method.group * token_bytes(spec.n_kv_heads, spec.head_dim, staging, staged_values)
    probe = method.query_sums(torch.zeros(1, spec.n_heads, 1, spec.head_dim))
    sums = 0 if probe is None else probe[0].numel() * probe.element_size()
    return spec.n_layers * slots * (group + sums)


def formula_page_bytes(method: Method, spec: ModelSpec, layer: int, dtype: torch.dtype) -> float:
    """One page (a sealed block of ``group`` tokens) by the bit formula."""
    return segment_bytes(method, spec, layer, Segments(0, 1, 0), dtype, selected=False)["blocks"]
