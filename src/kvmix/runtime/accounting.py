"""What the bit formula says one sequence's store should hold, to set beside what it holds."""

from __future__ import annotations

import torch

from kvmix.methods import ModelSpec
from kvmix.runtime.store import RowStore


def formula_bytes(row: RowStore, spec: ModelSpec, dtype: torch.dtype) -> float:
    """Sink and residual at ``dtype``, blocks at the method's bits, the prefill selection."""
    if row.res_keys is None:  # never written
        return 0.0
    method = row.method
    exact = row.sink_keys.shape[-2] + row.res_keys.shape[-2]
    key_bits, value_bits = method.bits(row.layer, dtype)
    quantized = len(row.lengths) * method.group * (key_bits + value_bits) / 8
    selected = method.selection_bits(spec) / 8 if row.prefilled else 0
    return spec.n_kv_heads * spec.head_dim * (exact * 2 * dtype.itemsize + quantized) + selected
