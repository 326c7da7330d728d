"""Affine quantizers over groups, with packed storage.

A group is the set of elements that share one (scale, minimum) pair: the elements along ``dim``.
Per-channel keys reduce over the token axis; per-token values reduce over a group of channels.

* min-max (``center=False``): ``s = (max-min)/(2^b-1)``, ``code = round((x-min)/s)``,
  ``x̂ = min + s·code``; the error is at most half a step.
* bin-center (``center=True``): ``s = (max-min)/2^b``, ``code = floor((x-min)/s)``,
  ``x̂ = min + s·(code+½)``; the 1-bit levels sit at ¼ and ¾ of the range.

Scale and minimum are stored in 16 bits (float16): the minimum rounded down and the scale rounded
up, so the stored grid still covers the group, and codes are computed against the stored values.
A constant group (max = min) has scale 0 and reconstructs to its float16 value: exact whenever the
value is representable in float16 (always, for a float16 model). Values must be finite and inside
the float16 range.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvmix.core import fused
from kvmix.core.bits import check_bits
from kvmix.core.importance import channel_mask
from kvmix.core.packing import ENCODER, pack, unpack

STAT_DTYPE = torch.float16


@contextlib.contextmanager
def fused_encoding(backend: str | None = "triton") -> Iterator[None]:
    """Inside, min-max groups of a shape ``backend``'s encoder serves (``fused.fits``: Triton,
    or the CPU op's ``quantize``) are quantized and packed by it, and with the CPU op every
    ``pack`` too, bit for bit what the torch path gives; elsewhere (another backend, ``None``),
    torch."""
    if backend not in (None, "torch", *fused.BACKENDS):
        raise ValueError(f"backend={backend!r} is invalid; expected None, 'torch' or one of "
                         f"{list(fused.BACKENDS)}")
    token = ENCODER.set(backend)
    try:
        yield
    finally:
        ENCODER.reset(token)


def _fused(x: torch.Tensor, bits: int, dim: int, valid: torch.Tensor | None) -> bool:
    backend = ENCODER.get()
    return backend is not None and valid is None and fused.fits(x, dim, bits, backend)


@dataclass
class QuantizedTensor:
    """Packed codes plus the per-group statistics needed to reconstruct them.

    ``shape`` is the row shape, without the batch dimension, which is dimension 0 of every tensor
    here so batch ops can index all fields alike. A cache layer stacks its blocks along
    dimension 1 of every field (codes [B, n_blocks, bytes]); ``dequantize`` handles both.
    """

    codes: torch.Tensor = field(metadata={"kind": "codes"})  # [B, packed bytes] uint8
    scale: torch.Tensor = field(metadata={"kind": "scales"})  # [B, *stat shape] float16
    minimum: torch.Tensor = field(metadata={"kind": "zeros"})  # [B, *stat shape] float16
    shape: tuple[int, ...]
    bits: int
    center: bool = False

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


def quantize(
    x: torch.Tensor, bits: int, dim: int, valid: torch.Tensor | None = None, center: bool = False
) -> QuantizedTensor:
    """x: [B, ...] -> QuantizedTensor with one (scale, minimum) per slice along ``dim``.

    ``valid`` (broadcastable to x, bool) marks the elements that may enter the statistics;
    padding positions are excluded. A group with no valid element gets scale 0 and minimum 0.
    """
    check_bits(bits)
    if dim % x.dim() == x.dim() - 1 and _fused(x, bits, dim, valid):  # a group per row
        packed, scale, minimum = fused.quantize_codes(x, bits, dim, center, packed=True,
                                                       backend=ENCODER.get())
    else:
        codes, scale, minimum = quantize_codes(x, bits, dim, valid, center)
        packed = pack(codes, bits)
    return QuantizedTensor(packed, scale, minimum, tuple(x.shape[1:]), bits, center)


def quantize_codes(
    x: torch.Tensor, bits: int, dim: int, valid: torch.Tensor | None = None, center: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpacked codes (uint8, shaped like x) and the float16 scale and minimum (keepdim)."""
    check_bits(bits)
    if _fused(x, bits, dim, valid):
        return fused.quantize_codes(x, bits, dim, center, packed=False,
                                    backend=ENCODER.get())
    lo, hi = _group_range(x, dim, valid)
    # a tensor divisor: CUDA turns a division by a Python number into a product with its
    # reciprocal, which can differ in the last bit; this division is IEEE on every device
    levels = x.new_full((), 2**bits if center else 2**bits - 1)
    # Round the minimum down and the scale up so the stored grid covers [lo, hi]: the error
    # bound (half a stored step) then holds for the float16 statistics actually kept.
    constant = hi == lo
    minimum = torch.where(constant, lo.to(STAT_DTYPE), _round16(lo, down=True))
    scale = _round16((hi - minimum.to(x.dtype)) / levels, down=False).masked_fill(constant, 0)
    return _codes(x, scale.to(x.dtype), minimum.to(x.dtype), bits, center), scale, minimum


def quantize_mixed(keys: torch.Tensor, index: torch.Tensor, high_bits: int, low_bits: int,
                   center: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mixed-precision keys [B, H, G, D], per channel over the G tokens: channels ``index``
    [B, H, k] at ``high_bits`` (min-max), the others at ``low_bits`` (bin-center when
    ``center``) -> (low plane [B, bytes]: every channel's ``low_bits`` codes, a high channel's
    top bits; refinement plane [B, bytes]: the high channels' bottom ``high_bits - low_bits``
    bits; scale, minimum [B, H, 1, D] float16). Plane rows are a channel's tokens: [B, H, D,
    G] and [B, H, k, G]. With the CPU op's encoder (``fused_encoding("cpu")``), one pass."""
    if ENCODER.get() == "cpu" and fused.mixes(keys, high_bits, low_bits):
        return fused.quantize_mixed(keys, index, high_bits, low_bits, center)
    high_codes, high_scale, minimum = quantize_codes(keys, high_bits, -2)
    low_codes, low_scale, _ = quantize_codes(keys, low_bits, -2, center=center)
    high = channel_mask(index, keys.shape[-1])  # [B, H, 1, D]
    shift = high_bits - low_bits
    low_plane = torch.where(high, high_codes >> shift, low_codes)  # [B, H, G, D]
    at = index.unsqueeze(-2).expand(*index.shape[:-1], keys.shape[-2], index.shape[-1])
    refine = (high_codes & (2**shift - 1)).gather(-1, at)  # [B, H, G, k]
    return (pack(low_plane.transpose(-1, -2), low_bits), pack(refine.transpose(-1, -2), shift),
            torch.where(high, high_scale, low_scale), minimum)


def reconstruct(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                offset: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x̂ = minimum + scale · (code + offset); offset ½ is bin-center reconstruction."""
    return minimum.to(dtype) + scale.to(dtype) * (codes.to(dtype) + offset)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """QuantizedTensor -> x̂: [*rows, *q.shape] in ``dtype``; rows are the leading dimensions of
    ``codes`` ([B], or [B, n_blocks] for stacked blocks)."""
    rows = q.codes.shape[:-1]
    codes = unpack(q.codes, q.bits, q.numel, q.shape[-1]).view(*rows, *q.shape)
    return reconstruct(codes, q.scale, q.minimum, 0.5 if q.center else 0.0, dtype)


def quantize_per_token(values: torch.Tensor, bits: int, group: int) -> QuantizedTensor:
    """values: [B, H, T, D] -> one (scale, minimum) per token per ``group`` channels."""
    return quantize(values.unflatten(-1, (-1, group)), bits, dim=-1)  # [B, H, T, D/group, group]


def dequantize_per_token(q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """-> values: [*rows, H, T, D]."""
    return dequantize(q, dtype).flatten(-2)


def _group_range(
    x: torch.Tensor, dim: int, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if valid is None:
        return x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    valid = valid.expand_as(x)
    lo = torch.where(valid, x, torch.inf).amin(dim, keepdim=True)
    hi = torch.where(valid, x, -torch.inf).amax(dim, keepdim=True)
    empty = ~valid.any(dim, keepdim=True)
    return lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)


def _round16(v: torch.Tensor, down: bool) -> torch.Tensor:
    """Round to float16 in one direction (torch only rounds to nearest)."""
    r = v.to(STAT_DTYPE)
    wrong = r.to(v.dtype) > v if down else r.to(v.dtype) < v
    toward = torch.tensor(-torch.inf if down else torch.inf, dtype=STAT_DTYPE, device=v.device)
    return torch.where(wrong, torch.nextafter(r, toward), r)


def _codes(
    x: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int, center: bool
) -> torch.Tensor:
    # A zero scale (constant group) maps every element to code 0, i.e. to the minimum.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    steps = (x - minimum) / safe
    steps = steps.floor() if center else steps.round()
    return steps.clamp_(0, 2**bits - 1).to(torch.uint8)


# -- clipped quantizers (WUSH-KV, arXiv:2609.38121), per token over transformed channels ----------

QUEST_CLIP = {1: 0.7979, 2: 1.4935, 3: 2.0511, 4: 2.5139, 8: 3.8849}


@dataclass
class SymmetricTensor:
    """Symmetric midrise codes with one float16 step per group (no minimum)."""

    codes: torch.Tensor = field(metadata={"kind": "codes"})  # [B, packed bytes] uint8
    step: torch.Tensor = field(metadata={"kind": "scales"})  # [B, *stat shape] float16
    shape: tuple[int, ...]
    bits: int

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


def quest_quantize(x: torch.Tensor, bits: int, dim: int = -1) -> SymmetricTensor:
    """QuEST INT: clip at α = c_b·RMS(group); 2^b midrise levels ±(j+½)Δ, Δ = 2α/(2^b−1), so the
    outermost level is α itself (for 1 bit: ±0.7979·RMS = ±E|x| for a Gaussian). Nearest level.
    x: [B, ...] -> codes in [0, 2^b) with level (code − 2^(b−1) + ½)·Δ; Δ kept in float16."""
    check_bits(bits)
    alpha = QUEST_CLIP[bits] * x.float().pow(2).mean(dim, keepdim=True).sqrt()
    step = (2 * alpha / (2**bits - 1)).to(STAT_DTYPE)
    safe = torch.where(step > 0, step, torch.ones_like(step)).to(x.dtype)
    codes = (x / safe + 2 ** (bits - 1) - 0.5).round().clamp_(0, 2**bits - 1).to(torch.uint8)
    return SymmetricTensor(pack(codes, bits), step, tuple(x.shape[1:]), bits)


def quest_dequantize(q: SymmetricTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    rows = q.codes.shape[:-1]
    codes = unpack(q.codes, q.bits, q.numel, q.shape[-1]).view(*rows, *q.shape).to(dtype)
    return (codes - 2 ** (q.bits - 1) + 0.5) * q.step.to(dtype)


def percentile_quantize(x: torch.Tensor, bits: int, percentile: float,
                        dim: int = -1) -> QuantizedTensor:
    """Affine min-max with the range [p-th, (100−p)-th percentile] of each group; values beyond
    are clipped. The bounds are order statistics (``percentile_bounds``): exactly k = round(p/100·N)
    elements of a group of N lie below the lower bound and k above the upper one (ties aside);
    the stored float16 grid covers them."""
    check_bits(bits)
    lo, hi = percentile_bounds(x, percentile, dim)
    minimum = _round16(lo, down=True)
    scale = _round16((hi - minimum.to(x.dtype)) / (2**bits - 1), down=False)
    codes = _codes(x, scale.to(x.dtype), minimum.to(x.dtype), bits, center=False)
    return QuantizedTensor(pack(codes, bits), scale, minimum, tuple(x.shape[1:]), bits)


def percentile_bounds(x: torch.Tensor, percentile: float,
                      dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The (k+1)-th smallest and (k+1)-th largest values along ``dim``, k = round(p/100·N)."""
    size = x.shape[dim]
    k = round(percentile / 100 * size)
    lo = x.kthvalue(k + 1, dim, keepdim=True).values
    return lo, x.kthvalue(size - k, dim, keepdim=True).values
