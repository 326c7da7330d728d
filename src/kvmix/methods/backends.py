"""Quantization backends for ``kxvy`` (docs/guide/methods.md): kvmix's own quantizers (``native``),
and the two libraries the key-priority paper validated with, Optimum Quanto (``quanto``) and HQQ
(``hqq``).

A library backend quantizes *rows*: keys [B, H, G, D] become rows of the G tokens of one channel
([B, H·D, G]: per-channel groups of ``group`` tokens); values become rows of ``value_group``
channels of one token ([B, H·G·D/Gv, Gv]: per-token groups). Each batch element is one call to the
library, so its packed codes, scales and zero points stay separable by batch (beam search, batch
ops). What kvmix stores is exactly the library's packed uint8 data and its float16 scale and zero
tensors; ``nbytes()`` counts them.

What each library can express: quanto has 2- and 4-bit integer types only (``qint2``,
``qint4``); HQQ packs 1, 2, 4 and 8 bits into uint8 exactly, but 3 bits as ten codes per int32
word with rows padded to a multiple of ten, which wastes bits the bit formula does not have, so
kvmix refuses 3 bits with HQQ (use ``backend=native`` for 3 bits). HQQ optimises its zero point
and scale (its default proximal solver), so its error is not bounded by half a min-max step;
quanto uses min-max (``MaxOptimizer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

BACKEND_BITS = {"native": (1, 2, 3, 4, 8), "quanto": (2, 4), "hqq": (1, 2, 4, 8)}


@dataclass
class LibraryTensor:
    """A library's packed codes and statistics, one unit per batch element (rows [B] or [B, n])."""

    data: torch.Tensor = field(metadata={"kind": "codes"})  # [*rows, packed...] uint8
    scale: torch.Tensor = field(metadata={"kind": "scales"})  # [*rows, R, 1] float16
    zero: torch.Tensor = field(metadata={"kind": "zeros"})  # [*rows, R, 1] float16
    unit: tuple[int, int]  # (R, G) rows and group of one unit
    bits: int
    backend: str


def check_backend(backend: str, bits: tuple[int, ...], names: str) -> None:
    if backend not in BACKEND_BITS:
        raise ValueError(f"backend={backend!r} is invalid; valid: {', '.join(BACKEND_BITS)}")
    unsupported = sorted(set(bits) - set(BACKEND_BITS[backend]))
    if unsupported:
        raise ValueError(f"backend={backend!r} cannot store {names} of {unsupported} bits; it "
                         f"supports {list(BACKEND_BITS[backend])}")
    if backend != "native":
        _library(backend)  # a clear ImportError now rather than at the first flush


def key_rows(keys: torch.Tensor) -> torch.Tensor:
    """keys [B, H, G, D] -> rows [B, H·D, G]: each row is one channel's group of tokens."""
    return keys.transpose(-1, -2).flatten(1, 2)


def value_rows(values: torch.Tensor, group: int) -> torch.Tensor:
    """values [B, H, G, D] -> rows [B, H·G·D/group, group]: per-token channel groups."""
    return values.reshape(values.shape[0], -1, group)


def quantize_rows(rows: torch.Tensor, bits: int, backend: str) -> LibraryTensor:
    """rows [B, R, G] -> the library's packed form, one call per batch element."""
    units = [_quantize_unit(r.to(torch.float16), bits, backend) for r in rows]
    data, scale, zero = (torch.stack(t) for t in zip(*units, strict=True))
    return LibraryTensor(data, scale, zero, tuple(rows.shape[1:]), bits, backend)


def dequantize_rows(q: LibraryTensor, dtype: torch.dtype) -> torch.Tensor:
    """-> rows [*rows, R, G] in ``dtype`` (one library call per stored unit)."""
    lead = q.data.shape[:-2]  # both libraries keep 2-D packed data per unit
    flat = zip(q.data.reshape(-1, *q.data.shape[-2:]), q.scale.reshape(-1, q.unit[0], 1),
               q.zero.reshape(-1, q.unit[0], 1), strict=True)
    units = [_dequantize_unit(d, s, z, q) for d, s, z in flat]
    return torch.stack(units).view(*lead, *q.unit).to(dtype)


def _library(backend: str):
    try:
        if backend == "hqq":
            from hqq.core.quantize import Quantizer

            return Quantizer
        import optimum.quanto as quanto

        return quanto
    except ImportError as error:
        raise ImportError(f"backend={backend!r} needs its library: pip install "
                          f"'kvmix[{backend}]'") from error


def _quantize_unit(rows: torch.Tensor, bits: int, backend: str):
    # rows: [R, G] float16 -> (packed uint8, scale [R, 1], zero [R, 1])
    group = rows.shape[1]
    if backend == "hqq":
        codes, meta = _library("hqq").quantize(rows, nbits=bits, group_size=group, axis=1,
                                               compute_dtype=torch.float16, device=rows.device)
        return codes, meta["scale"].half(), meta["zero"].half()
    quanto = _library("quanto")
    qtype = quanto.qint2 if bits == 2 else quanto.qint4
    scale, shift = quanto.MaxOptimizer()(rows, qtype, 0, group)
    q = quanto.quantize_weight(rows, qtype, 0, scale, shift, group)
    return q._data._data, q._scale.half(), q._shift.half()


def _dequantize_unit(data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                     q: LibraryTensor) -> torch.Tensor:
    group = q.unit[1]
    if q.backend == "hqq":
        quantizer = _library("hqq")
        packing = quantizer.bit_to_packing[q.bits]
        meta = {"nbits": q.bits, "group_size": group, "shape": torch.Size(q.unit), "axis": 1,
                "scale": scale, "zero": zero, "packing": packing, "view_as_float": False,
                "unpack_view_dtype": quantizer.unpack_view_dtype[packing]}
        return quantizer.dequantize(data, meta).float()
    from optimum.quanto.tensor.packed import PackedTensor
    from optimum.quanto.tensor.weights.qbits import WeightQBitsTensor

    quanto = _library("quanto")
    qtype = quanto.qint2 if q.bits == 2 else quanto.qint4
    size, stride = torch.Size(q.unit), (group, 1)
    packed = PackedTensor(data, q.bits, size, stride)
    tensor = WeightQBitsTensor(qtype, 0, group, size, stride, packed, scale, zero)
    return tensor.dequantize().float()
