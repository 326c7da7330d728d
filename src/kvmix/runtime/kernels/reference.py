"""The reference attention path: decode every block into float keys and values, then SDPA.
Exact for prefill and decode; every fused op is measured and tested against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmix.runtime.store import RowView


def attend(row: RowView, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           scaling: float) -> torch.Tensor:
    """query [1, Hq, q, D] of the new tokens keys, values [1, H, q, D] over everything ``row``
    holds and themselves (causally) -> [1, Hq, q, D]."""
    if len(row):
        history = row.history(keys.dtype)
        keys = torch.cat([history[0], keys], dim=-2)
        values = torch.cat([history[1], values], dim=-2)
    return sdpa(query, keys, values, scaling)


def sdpa(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
         scaling: float) -> torch.Tensor:
    """query [1, Hq, q, D] (the last q of the T positions) over keys, values [1, H, T, D]."""
    q, t = query.shape[-2], keys.shape[-2]
    mask = None
    if 1 < q < t:  # causal, aligned to the end: query i sees positions <= t - q + i
        mask = torch.ones(q, t, dtype=torch.bool, device=query.device).tril(t - q)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                          is_causal=q == t > 1, scale=scaling,
                                          enable_gqa=query.shape[1] != keys.shape[1])
