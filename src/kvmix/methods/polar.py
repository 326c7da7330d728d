"""``polar``: PolarQuant, keys as RoPE pairs in polar form (the PN-Mix paper's uniform baseline).

RoPE rotates each key pair ``(k_a, k_b)``; PolarQuant stores it as a radius ``r = ‖k_p‖`` and an
angle ``θ = atan2(k_b, k_a)``, each quantized asymmetrically (min-max) per pair over groups of
``group`` tokens: radius at ``radius_bits``, angle at ``angle_bits``. Decoding rebuilds
``k_a = r̂ cos θ̂``, ``k_b = r̂ sin θ̂``. Values per token at ``value_bits``.

Key bits per element: ``(radius_bits + angle_bits)/2 + 32/group`` (a float16 scale and minimum
for the radius and for the angle of each pair, i.e. 32 bits per channel and group).
Pairs are read from the model (rotate-half or interleaved).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvmix.core.bits import check_bits
from kvmix.core.quantizers import QuantizedTensor, dequantize, quantize
from kvmix.methods.base import (
    STAT_BITS,
    Blocks,
    ModelSpec,
    PerTokenValues,
    require_pairs,
)
from kvmix.methods.registry import register


@dataclass
class PolarKeys:
    radius: QuantizedTensor = field()  # per pair over tokens: rows [B], shape [H, G, P]
    angle: QuantizedTensor = field()


@register
@dataclass
class PolarQuant(PerTokenValues):
    """PolarQuant: each key RoPE pair as (radius, angle) at radius_bits + angle_bits."""

    name: ClassVar[str] = "polar"
    summary: ClassVar[str] = "PolarQuant: key RoPE pairs as quantized radius and angle"
    fast_path: ClassVar[str] = "reference only (keys are rebuilt through cos and sin)"

    radius_bits: int = 4
    angle_bits: int = 4
    group: int = 128
    sink: int = 32
    residual: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bits(self.radius_bits, "radius_bits")
        check_bits(self.angle_bits, "angle_bits")

    def bind(self, spec: ModelSpec) -> None:
        require_pairs(spec, "polar")
        super().bind(spec)

    def engine_limits(self) -> list[str]:
        return ["keys as quantized RoPE-pair radius and angle (polar coordinates)"]

    def bits(self, layer: int, dtype: torch.dtype) -> tuple[float, float]:
        key = (self.radius_bits + self.angle_bits) / 2 + STAT_BITS / self.group
        return key, self.value_bits_per_element()

    @classmethod
    def describe(cls) -> str:
        return ("key bits = (radius_bits + angle_bits)/2 + 32/group; "
                "value bits = value_bits + 32/value_group")

    def encode(self, keys: torch.Tensor, values: torch.Tensor, layer: int,
               selection: Any) -> tuple[PolarKeys, Any]:
        # keys, values: [B, H, G, D]
        pairs = self.spec.pairs
        a, b = keys[..., pairs[:, 0]].float(), keys[..., pairs[:, 1]].float()  # [B, H, G, P]
        radius = quantize(torch.hypot(a, b), self.radius_bits, -2)
        angle = quantize(torch.atan2(b, a), self.angle_bits, -2)
        return PolarKeys(radius, angle), self.encode_values(values)

    def decode(self, blocks: Blocks, layer: int, selection: Any,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = self.spec.pairs
        radius = dequantize(blocks.keys.radius, torch.float32)  # [B, n, H, G, P]
        angle = dequantize(blocks.keys.angle, torch.float32)
        keys = torch.empty(*radius.shape[:-1], pairs.numel(), dtype=dtype, device=radius.device)
        keys[..., pairs[:, 0]] = (radius * torch.cos(angle)).to(dtype)
        keys[..., pairs[:, 1]] = (radius * torch.sin(angle)).to(dtype)
        return keys, self.decode_values(blocks, dtype)
