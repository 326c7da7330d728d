"""What the bit formulas say a cache should hold: one sequence's segments in one layer, from the
tokens each segment holds. The cache sets it beside what it holds; the capacity planner uses
the same function for caches that do not exist yet (one source of truth for bytes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmix.methods import Method, ModelSpec
from kvmix.runtime.store import RowStore


@dataclass(frozen=True)
class Layout:
    """Tokens of one sequence in one layer, by segment (blocks counted whole)."""

    sink: int
    blocks: int
    residual: int


def layout(method: Method, tokens: int) -> Layout:
    """The flush rule in closed form: where ``tokens`` real tokens sit."""
    sink = min(tokens, method.sink)
    rest = tokens - sink
    blocks = 0 if rest < method.residual else (rest - method.residual) // method.group + 1
    return Layout(sink, blocks, rest - blocks * method.group)


def segment_bytes(method: Method, spec: ModelSpec, layer: int, held: Layout,
                  dtype: torch.dtype, selected: bool = True) -> dict[str, float]:
    """Bytes by segment: sink and residual at ``dtype``, blocks at the method's bits, and the
    prefill-time selection (once a sequence has been prefilled)."""
    elements = spec.n_kv_heads * spec.head_dim  # per token, keys or values
    key_bits, value_bits = method.bits(layer, dtype)
    return {"sink": elements * held.sink * 2 * dtype.itemsize,
            "blocks": elements * held.blocks * method.group * (key_bits + value_bits) / 8,
            "residual": elements * held.residual * 2 * dtype.itemsize,
            "selection": method.selection_bits(spec) / 8 if selected else 0.0}


def formula_bytes(row: RowStore, spec: ModelSpec, dtype: torch.dtype) -> float:
    """What ``row``'s segments should take by the bit formula."""
    if row.res_keys is None:  # never written
        return 0.0
    held = Layout(row.sink_keys.shape[-2], len(row.lengths), row.res_keys.shape[-2])
    return sum(segment_bytes(row.method, spec, row.layer, held, dtype, row.prefilled).values())
