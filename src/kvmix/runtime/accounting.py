"""Byte accounting of one layer's store: what it holds, by kind, and what the bit formula says."""

from __future__ import annotations

from collections import Counter

from kvmix.core.tree import tensor_bytes
from kvmix.methods import ModelSpec
from kvmix.runtime.store import SegmentStore


def held_bytes(store: SegmentStore) -> Counter:
    """Bytes actually held, by kind: codes, scales, zeros, masks, sink, residual, full."""
    if not store.started:
        return Counter()
    held = tensor_bytes([store.sink_keys, store.sink_values], "sink")
    held += tensor_bytes([store.res_keys, store.res_values], "residual")
    held += tensor_bytes(store.blocks, "full")
    return held + tensor_bytes(store.selection, "masks")


def formula_bytes(store: SegmentStore, spec: ModelSpec) -> float:
    """Bytes from the method's bit formula for the tokens the store holds."""
    if not store.started:
        return 0.0
    method = store.method
    batch, heads, _, dim = store.res_keys.shape
    exact = store.sink_keys.shape[-2] + store.res_keys.shape[-2]
    elements = batch * heads * dim
    key_bits, value_bits = method.bits(store.layer, store.dtype)
    quantized = len(store.lengths) * method.group * (key_bits + value_bits) / 8
    selected = batch * method.selection_bits(spec) / 8 if store.prefilled else 0
    return elements * (exact * 2 * store.dtype.itemsize + quantized) + selected
