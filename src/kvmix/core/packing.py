"""Bit packing of integer codes into ``uint8``.

Dimension 0 (the batch) is kept, so beam search and batch ops index packed storage directly.
Every *row* — the last dimension of the codes, e.g. the tokens of one key channel in a block,
or the channels of one value token — is packed on its own into whole bytes. Inside a row of
``W`` bytes, byte ``w`` holds codes ``w, w + W, w + 2W, ...`` at shifts ``0, b, 2b, ...``: a row
shifted right by ``i·b`` and masked is codes ``[i·W, (i+1)·W)`` in order, so a fused kernel
unpacks with plain vector shifts. Widths 1, 2, 4 and 8 pack ``8 // bits`` codes per byte; width
3 stores each row as its 2-bit plane (the low bits) followed by its 1-bit plane (the top bit).
No bit is wasted when a row's codes fill whole bytes (``row·bits`` a multiple of 8, true for
every layout kvmix stores); otherwise each plane of a row is padded to a byte.
"""

from __future__ import annotations

from contextvars import ContextVar

import torch

from kvmix.core import fused
from kvmix.core.bits import check_bits, row_bytes

# The fused encoder in use ("triton", "cpu" or None: torch), set by quantizers.fused_encoding.
ENCODER: ContextVar[str | None] = ContextVar("kvmix_fused_encoding", default=None)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [B, ..., row] integers in [0, 2**bits) -> packed: [B, bytes] uint8."""
    check_bits(bits)
    row = codes.shape[-1] if codes.dim() > 1 else 1  # a 1-D tensor: one code per batch row
    rows = codes.reshape(-1, row).to(torch.uint8)  # [M, row]
    if ENCODER.get() == "cpu" and fused.packs(rows):
        return fused.pack_rows(rows, bits).reshape(codes.shape[0], -1)
    if bits == 3:
        packed = torch.cat([_pack_plane(rows & 3, 2), _pack_plane(rows >> 2, 1)], dim=1)
    else:
        packed = _pack_plane(rows, bits)
    return packed.reshape(codes.shape[0], -1)


def unpack(packed: torch.Tensor, bits: int, numel: int, row: int) -> torch.Tensor:
    """packed: [..., P] uint8 -> codes: [..., numel] uint8, ``numel`` codes in rows of ``row``
    (reshape to the caller's row shape). Leading dimensions are the batch, and the block axis
    of stacked blocks."""
    check_bits(bits)
    lead = packed.shape[:-1]
    rows = packed.reshape(*lead, numel // row, row_bytes(row, bits))
    if bits == 3:
        split = row_bytes(row, 2)
        low = _unpack_plane(rows[..., :split], 2, row)
        codes = low | (_unpack_plane(rows[..., split:], 1, row) << 2)
    else:
        codes = _unpack_plane(rows, bits, row)
    return codes.reshape(*lead, numel)


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)  # [8 // bits]


def _pack_plane(rows: torch.Tensor, bits: int) -> torch.Tensor:
    # rows: [M, N] -> [M, W], W = ceil(N·bits / 8); segment i of a row lands at shift i·bits
    per_byte = 8 // bits
    width = row_bytes(rows.shape[1], bits)
    padded = torch.nn.functional.pad(rows, (0, width * per_byte - rows.shape[1]))
    segments = padded.view(rows.shape[0], per_byte, width)  # [M, segment, byte]
    return (segments << _shifts(bits, rows.device)[:, None]).sum(dim=1, dtype=torch.uint8)


def _unpack_plane(packed: torch.Tensor, bits: int, row: int) -> torch.Tensor:
    # packed: [..., W] -> [..., row]
    if bits == 8:
        return packed[..., :row]
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(-2) >> _shifts(bits, packed.device)[:, None]) & mask  # [..., s, W]
    return codes.flatten(-2)[..., :row]
