"""Bit packing of integer codes into ``uint8``.

Codes are packed row-wise: dimension 0 (the batch) is kept so that beam search and batch ops can
index packed storage directly; everything after it is flattened into one bit stream per row.
Widths 1, 2, 4 and 8 pack ``8 // bits`` codes per byte. Width 3 is stored as a 2-bit plane (the
low bits) followed by a 1-bit plane (the top bit), so no bits are wasted beyond the last byte of
each plane.
"""

from __future__ import annotations

import math

import torch

WIDTHS = (1, 2, 3, 4, 8)


def check_bits(bits: int, name: str = "bits", allowed: tuple[int, ...] = WIDTHS) -> int:
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in allowed:
        raise ValueError(f"{name}={bits!r} is not supported; valid values: {list(allowed)}")
    return bits


def packed_bytes(numel: int, bits: int) -> int:
    """Bytes one row of ``numel`` codes occupies once packed."""
    if bits == 3:
        return packed_bytes(numel, 2) + packed_bytes(numel, 1)
    return math.ceil(numel * bits / 8)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [B, ...] integers in [0, 2**bits) -> packed: [B, packed_bytes(numel, bits)] uint8."""
    check_bits(bits)
    rows = codes.reshape(codes.shape[0], -1).to(torch.uint8)  # [B, N]
    if bits == 3:
        return torch.cat([_pack_plane(rows & 3, 2), _pack_plane(rows >> 2, 1)], dim=1)
    return _pack_plane(rows, bits)


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """packed: [..., P] uint8 -> codes: [..., numel] uint8 (reshape to the caller's row shape).

    Leading dimensions are rows: the batch, and the block axis of stacked blocks.
    """
    check_bits(bits)
    if bits == 3:
        split = packed_bytes(numel, 2)
        low = _unpack_plane(packed[..., :split], 2, numel)
        return low | (_unpack_plane(packed[..., split:], 1, numel) << 2)
    return _unpack_plane(packed, bits, numel)


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)  # [8 // bits]


def _pack_plane(rows: torch.Tensor, bits: int) -> torch.Tensor:
    # rows: [B, N] -> [B, ceil(N * bits / 8)]
    per_byte = 8 // bits
    pad = (-rows.shape[1]) % per_byte
    rows = torch.nn.functional.pad(rows, (0, pad)).view(rows.shape[0], -1, per_byte)
    return (rows << _shifts(bits, rows.device)).sum(dim=-1, dtype=torch.uint8)


def _unpack_plane(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    # packed: [..., P] -> [..., numel]
    if bits == 8:
        return packed[..., :numel]
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(-1) >> _shifts(bits, packed.device)) & mask  # [..., P, 8 // bits]
    return codes.flatten(-2)[..., :numel]
