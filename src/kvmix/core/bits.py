"""Code widths and the bytes packed codes take: the formulas ``packing`` packs by and the fused
encoders and kernels size their rows with (a row's codes fill whole bytes, each plane padded to a
byte; width 3 is a 2-bit plane then a 1-bit plane)."""

from __future__ import annotations

import math

WIDTHS = (1, 2, 3, 4, 8)


def check_bits(bits: int, name: str = "bits", allowed: tuple[int, ...] = WIDTHS) -> int:
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in allowed:
        raise ValueError(f"{name}={bits!r} is not supported; valid values: {list(allowed)}")
    return bits


def row_bytes(row: int, bits: int) -> int:
    """Bytes one row of ``row`` codes occupies once packed."""
    if bits == 3:
        return row_bytes(row, 2) + row_bytes(row, 1)
    return math.ceil(row * bits / 8)


def packed_bytes(numel: int, bits: int, row: int) -> int:
    """Bytes ``numel`` codes in rows of ``row`` occupy once packed."""
    return numel // row * row_bytes(row, bits)
