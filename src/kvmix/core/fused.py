"""Fused quantize/pack of groups, bit for bit ``quantizers.quantize_codes`` and
``packing.pack``, per backend: ``triton`` (here: one program quantizes a tile of groups, min-max
or bin-center, float16 statistics rounded outward, and writes their codes packed in row-split
order, or unpacked) and ``cpu`` (the CPU op's ``kvmix::quantize``, the same arithmetic in C++).

Every step repeats the torch encoder's arithmetic in the input's dtype: each operation is done
in float32 and rounded to that dtype, as torch's elementwise kernels do; divisions are IEEE
(``div_rn``); rounding is half to even; the directed float16 roundings step one float16 ulp
through the bit pattern, as ``torch.nextafter`` does. Groups must be a power of two of at least
8 elements (every block and value group kvmix stores); ``fits`` says when a call can run here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from kvmix.core.bits import row_bytes

try:
    import triton
    import triton.language as tl
except ImportError:  # the `triton` extra is optional
    triton = tl = None

BLOCK_GROUPS = 16  # groups per program
CPU_MAX_GROUP = 256  # elements of a group the CPU op's encoder holds
BACKENDS = ("triton", "cpu")


class CpuEncoder(NamedTuple):
    """The CPU op's encoder, registered by ``kvmix.runtime.kernels.cpu`` when imported (the
    op library lives with the runtime's kernels): ``quantize(x, bits, dim, center, packed)``,
    ``quantize_mixed(keys, index, high_bits, low_bits, center)``,
    ``selected_channels(bits, heads, units, pairs, count)``, ``pack(rows, bits)``,
    ``available()``."""

    quantize: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    quantize_mixed: Callable[..., tuple[torch.Tensor, ...]]
    selected_channels: Callable[..., torch.Tensor]
    pack: Callable[[torch.Tensor, int], torch.Tensor]
    available: Callable[[], bool]


_cpu: CpuEncoder | None = None


def register_cpu(encoder: CpuEncoder) -> None:
    global _cpu
    _cpu = encoder


def fits(x: torch.Tensor, dim: int, bits: int, backend: str = "triton") -> bool:
    """Whether ``backend``'s encoder serves quantizing ``x`` along ``dim`` at ``bits``."""
    size = x.shape[dim]
    served = (bits in (1, 2, 3, 4, 8) and size >= 8 and size & (size - 1) == 0
              and x.dtype in (torch.float32, torch.float16, torch.bfloat16))
    if backend == "cpu":
        return (served and size <= CPU_MAX_GROUP and x.dim() >= 2 and x.shape[0] > 0
                and x.device.type == "cpu" and _cpu_op())
    return served and backend == "triton" and triton is not None


def quantize_codes(x: torch.Tensor, bits: int, dim: int, center: bool, packed: bool,
                   backend: str = "triton") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [..., N, ...] reduced along ``dim`` -> (codes, scale, minimum): codes uint8 shaped
    like x, or packed [B, bytes] (groups in order, each a row) when ``packed``; statistics
    float16 shaped like x with ``dim`` kept as 1."""
    dim = dim % x.dim()
    if backend == "cpu":  # reads x through its strides
        return _cpu.quantize(x, bits, dim, center, packed)
    x = x.contiguous()
    size, inner = x.shape[dim], x.stride(dim)  # a group: N elements `inner` apart
    groups = x.numel() // size
    stat_shape = (*x.shape[:dim], 1, *x.shape[dim + 1:])
    scale = torch.empty(stat_shape, dtype=torch.float16, device=x.device)
    minimum = torch.empty_like(scale)
    width = row_bytes(size, bits)
    codes = (torch.empty(x.shape[0], groups // x.shape[0] * width, dtype=torch.uint8,
                         device=x.device) if packed
             else torch.empty(x.shape, dtype=torch.uint8, device=x.device))
    grid = (triton.cdiv(groups, BLOCK_GROUPS),)
    _quantize[grid](x, codes, scale, minimum, groups, inner, width, N=size, BITS=bits,
                    CENTER=center, PACKED=packed, BLOCK_M=BLOCK_GROUPS)
    return codes, scale, minimum


def mixes(keys: torch.Tensor, high_bits: int, low_bits: int) -> bool:
    """Whether the CPU op's encoder serves ``quantize_mixed`` of keys [B, H, G, D]."""
    return (keys.dim() == 4 and fits(keys, -2, low_bits, "cpu")
            and fits(keys, -2, high_bits - low_bits, "cpu"))


def quantize_mixed(keys: torch.Tensor, index: torch.Tensor, high_bits: int, low_bits: int,
                   center: bool) -> tuple[torch.Tensor, ...]:
    """``quantizers.quantize_mixed`` in the CPU op (``mixes``), in one pass over the keys."""
    return _cpu.quantize_mixed(keys, index.long().contiguous(), high_bits, low_bits, center)


def selects(bits: torch.Tensor, units: int) -> bool:
    """Whether the CPU op serves ``importance.selected_channels`` of ``bits``."""
    return bits.device.type == "cpu" and units % 8 == 0 and _cpu_op()


def selected_channels(bits: torch.Tensor, heads: int, units: int, pairs: torch.Tensor | None,
                      count: int) -> torch.Tensor:
    """``importance.selected_channels`` in the CPU op (``selects``)."""
    return _cpu.selected_channels(bits.contiguous(), heads, units,
                                  None if pairs is None else pairs.long().contiguous(), count)


def packs(rows: torch.Tensor) -> bool:
    """Whether the CPU op packs ``rows`` [M, n] (on the CPU, n a multiple of 8 up to
    CPU_MAX_GROUP)."""
    n = rows.shape[-1]
    return rows.device.type == "cpu" and n % 8 == 0 and n <= CPU_MAX_GROUP and _cpu_op()


def pack_rows(rows: torch.Tensor, bits: int) -> torch.Tensor:
    """rows [M, n] uint8 codes (``packs``) -> [M, bytes], as ``packing.pack`` packs them."""
    return _cpu.pack(rows.contiguous(), bits)


def _cpu_op() -> bool:
    """Whether the CPU op's encoder is registered, and the op builds and loads here."""
    return _cpu is not None and _cpu.available()


if triton is not None:

    @triton.jit
    def _rounded(v, dtype: tl.constexpr):
        """A float32 result rounded (to nearest even) to ``dtype``, back in float32;
        bfloat16 through the bit pattern, which every Triton backend rounds alike."""
        if dtype == tl.bfloat16:
            raw = v.to(tl.uint32, bitcast=True)
            raw = (raw + 0x7FFF + ((raw >> 16) & 1)) & 0xFFFF0000
            return raw.to(tl.float32, bitcast=True)
        return v.to(dtype).to(tl.float32)

    @triton.jit
    def _step16(r, up: tl.constexpr):
        """The float16 neighbour of ``r`` towards +inf (``up``) or -inf."""
        raw = r.to(tl.int16, bitcast=True)
        # up: r >= 0 here; down: a positive pattern steps down, a negative one (or -0) grows
        raw = raw + 1 if up else tl.where(r > 0, raw - 1, raw + 1)
        return raw.to(tl.float16, bitcast=True)

    @triton.jit
    def _pack_rows(codes, BLOCK_M: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr):
        """codes [M, N] int32 (< 2^BITS) -> bytes [M, N·BITS/8]: byte w holds codes w, w + W, …"""
        per: tl.constexpr = 8 // BITS
        segments = tl.reshape(codes, (BLOCK_M, per, N // per))
        shifts = (tl.arange(0, per) * BITS)[None, :, None]
        return tl.sum(segments << shifts, axis=1).to(tl.uint8)

    @triton.jit
    def _quantize(x_ptr, codes_ptr, scale_ptr, min_ptr, groups, inner, width, N: tl.constexpr,
                  BITS: tl.constexpr, CENTER: tl.constexpr, PACKED: tl.constexpr,
                  BLOCK_M: tl.constexpr):
        dtype: tl.constexpr = x_ptr.dtype.element_ty
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] groups
        live = m < groups
        n = tl.arange(0, N)
        at = ((m // inner) * N * inner + m % inner)[:, None] + n[None, :] * inner  # [M, N]
        x = tl.load(x_ptr + at, mask=live[:, None], other=0).to(tl.float32)
        lo, hi = tl.min(x, axis=1), tl.max(x, axis=1)  # [M]
        constant = hi == lo
        # minimum: float16 rounded down; scale: float16 rounded up (0 for a constant group)
        near = lo.to(tl.float16)
        minimum = tl.where(~constant & (_rounded(near.to(tl.float32), dtype) > lo),
                           _step16(near, False), near)
        levels = 2**BITS if CENTER else 2**BITS - 1
        span = _rounded(hi - _rounded(minimum.to(tl.float32), dtype), dtype)
        v = _rounded(tl.math.div_rn(span, tl.full([BLOCK_M], levels, tl.float32)), dtype)
        near = v.to(tl.float16)
        scale = tl.where(_rounded(near.to(tl.float32), dtype) < v, _step16(near, True), near)
        scale = tl.where(constant, 0.0, scale.to(tl.float32)).to(tl.float16)
        tl.store(scale_ptr + m, scale, mask=live)
        tl.store(min_ptr + m, minimum, mask=live)
        # codes against the stored statistics, as the torch encoder computes them
        s = _rounded(scale.to(tl.float32), dtype)
        safe = tl.where(s > 0, s, 1.0)
        steps = _rounded(x - _rounded(minimum.to(tl.float32), dtype)[:, None], dtype)
        steps = _rounded(tl.math.div_rn(steps, safe[:, None] + tl.zeros_like(steps)), dtype)
        below = tl.floor(steps)
        if CENTER:
            steps = below
        else:  # half to even
            frac = steps - below
            odd = below - 2 * tl.floor(below * 0.5)
            steps = tl.where((frac > 0.5) | ((frac == 0.5) & (odd == 1)), below + 1, below)
        codes = tl.minimum(tl.maximum(steps, 0.0), 2**BITS - 1).to(tl.int32)
        if PACKED:
            out = codes_ptr + m[:, None] * width
            if BITS == 3:
                low_width: tl.constexpr = N // 4
                tl.store(out + tl.arange(0, N // 4)[None, :], _pack_rows(codes & 3, BLOCK_M, N, 2),
                         mask=live[:, None])
                tl.store(out + low_width + tl.arange(0, N // 8)[None, :],
                         _pack_rows(codes >> 2, BLOCK_M, N, 1), mask=live[:, None])
            else:
                tl.store(out + tl.arange(0, N * BITS // 8)[None, :],
                         _pack_rows(codes, BLOCK_M, N, BITS), mask=live[:, None])
        else:
            tl.store(codes_ptr + at, codes.to(tl.uint8), mask=live[:, None])
