"""Channel and RoPE-pair importance (docs/guide/methods.md): the PN-Mix criterion and the ones it is
compared with, the causal score it approximates, and rank agreement between scores.

Shapes: queries [B, Hq, T, D], keys [B, Hkv, T, D], valid [B, T] (True = not padding), pairs
[P, 2] channel indices with P = D/2.
"""

from __future__ import annotations

import torch

from kvmix.core import fused
from kvmix.core.packing import ENCODER, unpack

PAIR_CRITERIA = ("qk_pair_norm", "key_pair_norm")
CHANNEL_CRITERIA = ("key_range", "key_magnitude")
CRITERIA = PAIR_CRITERIA + CHANNEL_CRITERIA


def pair_norms(x: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., P]: sqrt(x_a² + x_b²) for each pair (a, b)."""
    return torch.hypot(*pair_halves(x, pairs))


def pair_halves(x: torch.Tensor, pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and second channel of every pair, [..., P] each: slices for the rotate-half
    and interleaved layouts (no gather over a long prompt), an index for any other."""
    dim = x.shape[-1]
    if torch.equal(pairs, torch.arange(dim).view(2, -1).T):  # rotate_half: j with j + D/2
        return x[..., : dim // 2], x[..., dim // 2 :]
    if torch.equal(pairs, torch.arange(dim).view(-1, 2)):  # interleaved: 2j with 2j + 1
        return x[..., 0::2], x[..., 1::2]
    return x[..., pairs[:, 0]], x[..., pairs[:, 1]]


def masked_mean(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Mean over tokens of x: [B, H, T, C] with valid [B, T] -> [B, H, C]."""
    if valid is None:
        return x.mean(-2)
    weight = valid[:, None, :, None].to(x.dtype)  # [B, 1, T, 1]
    return (x * weight).sum(-2) / weight.sum(-2).clamp_min(1)


def group_mean(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, C] -> [B, Hkv, C]: the mean over the query heads that share each KV head."""
    return x.unflatten(1, (kv_heads, -1)).mean(2)


def scores(criterion: str, queries: torch.Tensor, keys: torch.Tensor,
           valid: torch.Tensor | None, pairs: torch.Tensor) -> torch.Tensor:
    """Importance per (B, Hkv) of each pair ([B, Hkv, P]) or channel ([B, Hkv, D])."""
    query_mean = None
    if criterion == "qk_pair_norm":
        query_valid = valid[:, -queries.shape[-2]:] if valid is not None else None
        query_mean = group_mean(masked_mean(pair_norms(queries.float(), pairs), query_valid),
                                keys.shape[1])
    return key_scores(criterion, query_mean, keys, valid, pairs)


def query_pair_sums(queries: torch.Tensor, pairs: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Σ over tokens of each pair's norm, averaged over the query heads of each KV head:
    queries [B, Hq, T, D] -> [B, Hkv, P] float32. Sums of chunks add up, so the ``qk_pair_norm``
    query side can be gathered over several steps (divide by the tokens for the mean)."""
    return group_mean(pair_norms(queries.float(), pairs).sum(-2), kv_heads)


def key_scores(criterion: str, query_mean: torch.Tensor | None, keys: torch.Tensor,
               valid: torch.Tensor | None, pairs: torch.Tensor) -> torch.Tensor:
    """``scores`` with the query side given as its per-pair mean norm [B, Hkv, P] (used by
    ``qk_pair_norm`` only)."""
    keys = keys.float()
    key_valid = valid[:, -keys.shape[-2]:] if valid is not None else None
    if criterion == "qk_pair_norm":
        return query_mean * masked_mean(pair_norms(keys, pairs), key_valid)
    if criterion == "key_pair_norm":
        return masked_mean(pair_norms(keys, pairs), key_valid)
    if criterion == "key_magnitude":
        return masked_mean(keys.abs(), key_valid)
    if criterion == "key_range":
        if key_valid is None:
            return keys.amax(-2) - keys.amin(-2)
        inside = key_valid[:, None, :, None]
        return (torch.where(inside, keys, -torch.inf).amax(-2)
                - torch.where(inside, keys, torch.inf).amin(-2))
    raise ValueError(f"criterion={criterion!r} is unknown; valid: {', '.join(CRITERIA)}")


def top_mask(score: torch.Tensor, count: int) -> torch.Tensor:
    """[..., C] -> bool [..., C] with the ``count`` highest entries True (ties: lowest index)."""
    order = score.sort(dim=-1, descending=True, stable=True).indices[..., :count]
    return torch.zeros_like(score, dtype=torch.bool).scatter(-1, order, True)


def mask_index(mask: torch.Tensor, count: int) -> torch.Tensor:
    """bool [..., C] with exactly ``count`` True per row -> their indices [..., count], ascending.
    A stable sort, not ``nonzero``: no host sync, and it runs on any device (meta included)."""
    order = (~mask).to(torch.uint8).sort(dim=-1, stable=True).indices  # True entries first
    return order[..., :count].sort(dim=-1).values


def selected_channels(bits: torch.Tensor, heads: int, units: int, pairs: torch.Tensor | None,
                      count: int) -> torch.Tensor:
    """A selection packed one bit per (head, unit), [B, heads·units/8] uint8 (units: channels,
    or RoPE pairs ``pairs`` [units, 2], both channels of a selected pair) -> each head's
    ``count`` selected channels [B, heads, count], ascending (``mask_index``). With the CPU op's
    encoder (``fused_encoding("cpu")``), one call."""
    if ENCODER.get() == "cpu" and fused.selects(bits, units):
        return fused.selected_channels(bits, heads, units, pairs, count)
    chosen = unpack(bits, 1, heads * units, units).view(bits.shape[0], heads, units).bool()
    if pairs is not None:
        chosen = pair_to_channels(chosen, pairs)
    return mask_index(chosen, count)


def channel_mask(index: torch.Tensor, dim: int) -> torch.Tensor:
    """[..., H, k] channel indices -> [..., H, 1, D] bool."""
    mask = torch.zeros(*index.shape[:-1], dim, dtype=torch.bool, device=index.device)
    return mask.scatter(-1, index, True).unsqueeze(-2)


def pair_to_channels(mask: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """[..., P] pair mask -> [..., D] channel mask (both channels of a selected pair)."""
    channels = mask.new_zeros(*mask.shape[:-1], pairs.numel())
    channels[..., pairs[:, 0]] = mask
    channels[..., pairs[:, 1]] = mask
    return channels


def causal_pair_score(queries: torch.Tensor, keys: torch.Tensor,
                      pairs: torch.Tensor) -> torch.Tensor:
    """mean over i >= j of ‖q_{i,p}‖·‖k_{j,p}‖, averaged over each group: [B, Hkv, P]."""
    q = pair_norms(queries.float(), pairs)  # [B, Hq, T, P]
    k = pair_norms(keys.float(), pairs).cumsum(-2)  # [B, Hkv, T, P]: sum over j <= i
    k = k.repeat_interleave(queries.shape[1] // keys.shape[1], dim=1)
    steps = keys.shape[-2]
    count = steps * (steps + 1) / 2
    return group_mean((q * k).sum(-2) / count, keys.shape[1])


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rank correlation along the last dim: [..., C] x [..., C] -> [...]."""
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    return (ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1)).clamp_min(1e-12)


def top_overlap(a: torch.Tensor, b: torch.Tensor, ratio: float) -> torch.Tensor:
    """Share of the top ``ratio`` entries of ``a`` that are also top in ``b``: [...]."""
    count = max(1, round(ratio * a.shape[-1]))
    both = top_mask(a, count) & top_mask(b, count)
    return both.sum(-1).float() / count


def _ranks(x: torch.Tensor) -> torch.Tensor:
    return x.argsort(-1).argsort(-1).float()
