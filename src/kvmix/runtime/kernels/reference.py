"""The reference attention path: decode every block into float keys and values, then SDPA.
Exact for prefill and decode; every fused op is measured and tested against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmix.runtime.store import RowView


def attend(row: RowView, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           scaling: float) -> torch.Tensor:
    """query [1, Hq, q, D] of the new tokens keys, values [1, H, q, D] over everything ``row``
    holds and themselves (causally, and within a sliding window) -> [1, Hq, q, D]."""
    mask = window_mask(row, query.shape[-2], query.device) if row.hides(query.shape[-2]) else None
    if len(row):
        history = row.history(keys.dtype)
        keys = torch.cat([history[0], keys], dim=-2)
        values = torch.cat([history[1], values], dim=-2)
    return sdpa(query, keys, values, scaling, mask)


def window_mask(row: RowView, queries: int, device: torch.device) -> torch.Tensor:
    """Which held and new tokens each new query sees in a sliding-window layer: itself and the
    ``window - 1`` positions before it -> [q, L + q] bool."""
    new = row.seen + torch.arange(queries, device=device)
    keys = torch.cat([row.store.positions(row.b, device), new])
    return (keys[None] <= new[:, None]) & (keys[None] > new[:, None] - row.store.window)


def sdpa(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
         mask: torch.Tensor | None = None) -> torch.Tensor:
    """query [1, Hq, q, D] (the last q of the T positions) over keys, values [1, H, T, D];
    mask [q, T] (True: seen), or causal aligned to the end."""
    q, t = query.shape[-2], keys.shape[-2]
    if mask is None and 1 < q < t:  # causal, aligned to the end: query i sees <= t - q + i
        mask = torch.ones(q, t, dtype=torch.bool, device=query.device).tril(t - q)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                          is_causal=mask is None and q == t > 1, scale=scaling,
                                          enable_gqa=query.shape[1] != keys.shape[1])
