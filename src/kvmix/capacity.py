"""Capacity planning: will a model, a batch and a context fit a device with a given KV method,
how big a batch or how long a generation does, and — an estimate — how fast it decodes.

KV bytes come from ``kvmix.runtime.accounting`` — the same per-segment bit formulas a real
cache's ``theoretical_nbytes()`` uses — applied to the flush rule's layout of ``prompt +
tokens`` tokens in every layer (a sliding-window layer holds only the pages its window still
sees). Weights are the architecture's parameter count at ``weight_bits`` (4-bit adds a
float16 scale and zero per 128 weights: 4.25 bits). ``overhead`` covers the framework's
context, activations and allocator reserve (default 1.5 GiB).

The throughput figure is a roofline *estimate*: one decode step reads every weight once and
every sequence's KV once, and does 2 FLOPs per weight and 4 per cached element per sequence;
its time is the larger of bytes / bandwidth and FLOPs / compute.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kvmix.methods import Method, parse_method
from kvmix.models.catalog import FULL, Architecture
from kvmix.runtime.accounting import segment_bytes, segments, slot_bytes

GIB = 2**30
MIB = 2**20
UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": MIB,
         "gib": GIB, "tib": 2**40}
WEIGHT_BITS = {32: 32.0, 16: 16.0, 8: 8.0, 4: 4.25}
DEFAULT_OVERHEAD = int(1.5 * GIB)


@dataclass(frozen=True)
class Device:
    """Memory as the driver reports it, peak memory bandwidth, dense 16-bit tensor FLOP/s."""

    name: str
    memory: float
    bandwidth: float
    flops: float


DEVICES = {
    "a100-40gb": Device("A100-SXM 40GB", 40960 * MIB, 1.555e12, 312e12),
    "a100-80gb": Device("A100-SXM 80GB", 81920 * MIB, 2.039e12, 312e12),
    "h100-80gb": Device("H100-SXM 80GB", 81559 * MIB, 3.35e12, 989e12),
    "h200": Device("H200 141GB", 143771 * MIB, 4.8e12, 989e12),
    "l4": Device("L4 24GB", 23034 * MIB, 300e9, 121e12),
    "rtx-4090": Device("RTX 4090 24GB", 24564 * MIB, 1.008e12, 165e12),
}
MAC = re.compile(r"mac-(\d+)gb")  # unified memory; the GPU may use about 3/4 of it


def device(name: str) -> Device:
    """A bundled accelerator, or ``mac-<N>gb`` (an Apple-silicon Max-class laptop)."""
    if name in DEVICES:
        return DEVICES[name]
    mac = MAC.fullmatch(name)
    if mac:
        gigabytes = int(mac.group(1))
        return Device(f"Mac {gigabytes}GB (3/4 usable)", 0.75 * gigabytes * GIB, 400e9, 28e12)
    raise ValueError(f"device={name!r} is unknown; valid: {', '.join(DEVICES)}, mac-<N>gb "
                     "(or give --memory)")


def parse_memory(text: str, name: str = "memory", allow_zero: bool = False) -> float:
    """``40GB`` (10^9), ``40GiB`` (2^30), ``512MiB``, ... -> bytes (``name``: the parameter the
    error names; ``allow_zero``: 0 is a valid size, as an overhead of none)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if allow_zero and match and float(match.group(1)) == 0:
        return 0.0
    if not match or unit not in UNITS or float(match.group(1)) <= 0:
        kind = "a size of 0 or more" if allow_zero else "a positive size"
        raise ValueError(f"{name}={text!r} does not parse; write {kind} like 40GB, 40GiB or "
                         "512MiB")
    return float(match.group(1)) * UNITS[unit]


def bound(method: str | Method, arch: Architecture) -> Method:
    """The method bound to the architecture, or a clear error for what cannot be planned."""
    method = parse_method(method)
    if getattr(method, "budget", None) is not None:
        raise ValueError(f"{method.name}: budget mode allocates from the model's weights; plan "
                         "fixed key_bits/value_bits instead")
    method.bind(arch.spec())
    return method


@dataclass
class Planned:
    """One method's bytes at one batch and context, by part."""

    kv: dict[str, float]  # sink, blocks, residual, selection, static, free
    weights: float
    overhead: float

    @property
    def kv_bytes(self) -> float:
        return sum(self.kv.values())

    @property
    def total(self) -> float:
        return self.kv_bytes + self.weights + self.overhead


def kv_bytes(method: Method, arch: Architecture, batch: int, context: int,
             dtype: torch.dtype) -> dict[str, float]:
    """The cache of ``batch`` sequences of ``context`` tokens, by segment; ``free``: the float
    slots (sink + residual per sequence) no token fills yet, which the cache allocates."""
    spec = arch.spec()
    parts = {"sink": 0.0, "blocks": 0.0, "residual": 0.0, "selection": 0.0, "free": 0.0}
    per_token = slot_bytes(method, spec, dtype)
    for index, kind in enumerate(arch.layer_types):
        held = segments(method, context, None if kind == FULL else arch.sliding_window)
        for part, size in segment_bytes(method, spec, index, held, dtype).items():
            parts[part] += batch * size
        parts["free"] += batch * (method.sink + method.residual - held.sink - held.residual) \
            * per_token
    parts["static"] = float(spec.static_nbytes() + method.static_nbytes(spec))
    return parts


def planned(method: Method, arch: Architecture, batch: int, context: int, weight_bits: int,
            dtype: torch.dtype, overhead: float) -> Planned:
    weights = arch.parameters * WEIGHT_BITS[weight_bits] / 8
    return Planned(kv_bytes(method, arch, batch, context, dtype), weights, overhead)


def max_batch(method: Method, arch: Architecture, context: int, weight_bits: int,
              dtype: torch.dtype, overhead: float, memory: float) -> int:
    """The largest batch whose cache at ``context`` fits (0: not even one sequence)."""
    one = planned(method, arch, 1, context, weight_bits, dtype, overhead)
    per_sequence = one.kv_bytes - one.kv["static"]
    room = memory - one.weights - overhead - one.kv["static"]
    return max(int(room // per_sequence), 0) if per_sequence > 0 else 0


def max_tokens(method: Method, arch: Architecture, batch: int, prompt: int, weight_bits: int,
               dtype: torch.dtype, overhead: float, memory: float, limit: int = 1 << 24) -> int:
    """The longest generation after ``prompt`` that fits at ``batch`` (bytes grow with tokens:
    a binary search); ``limit`` caps the search."""
    def fits(tokens: int) -> bool:
        return planned(method, arch, batch, prompt + tokens, weight_bits, dtype,
                       overhead).total <= memory

    if not fits(0):
        return 0
    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def roofline(plan: Planned, arch: Architecture, batch: int, context: int,
             bandwidth: float, flops: float) -> float | None:
    """Estimated decode tokens/s: batch / max(bytes read / bandwidth, FLOPs / compute); None
    where the device's bandwidth and compute are unknown (a bare ``--memory``)."""
    if not bandwidth or not flops:
        return None
    if batch < 1:
        return 0.0
    cached = arch.layers * 2 * arch.kv_heads * arch.head_dim * context  # elements per sequence
    work = 2 * arch.parameters * batch + 2 * batch * cached * arch.heads // arch.kv_heads
    seconds = max((plan.weights + plan.kv_bytes) / bandwidth, work / flops)
    return batch / seconds
