"""``kxvy``: key-priority bit allocation ("more bits for keys, fewer for values", SPEC §4.2).

Keys are quantized per channel over groups of ``group`` tokens and values per token over groups of
``value_group`` channels, both asymmetric min-max with a float16 scale and minimum, at independent
bit widths. ``key_bits`` and ``value_bits`` may be one width for every layer or a per-layer list
(``key_bits=4/4/2/...`` in a method string).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvmix.methods import register
from kvmix.methods.base import STAT_BITS, Blocks, Method, ModelSpec, positive
from kvmix.packing import WIDTHS, check_bits
from kvmix.quantizers import (
    QuantizedTensor,
    dequantize,
    dequantize_per_token,
    quantize,
    quantize_per_token,
)

Bits = int | tuple[int, ...]


def per_layer(bits: Bits, layer: int) -> int:
    return bits if isinstance(bits, int) else bits[layer]


def check_bit_list(bits: Bits, name: str, allowed: tuple[int, ...]) -> None:
    for b in (bits,) if isinstance(bits, int) else bits:
        check_bits(b, name, allowed)


@register
@dataclass
class KxVy(Method):
    """Per-channel keys at ``key_bits``, per-token values at ``value_bits`` (any of 1,2,3,4,8).

    Key bits per element: ``key_bits + 32/group``; value bits: ``value_bits + 32/value_group``.
    """

    name: ClassVar[str] = "kxvy"
    summary: ClassVar[str] = "key-priority: any key/value bits, per-layer lists, separate groups"
    allowed_bits: ClassVar[tuple[int, ...]] = WIDTHS

    key_bits: Bits = 4
    value_bits: Bits = 2
    group: int = 32
    value_group: int = 32
    sink: int = 0
    residual: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bit_list(self.key_bits, "key_bits", self.allowed_bits)
        check_bit_list(self.value_bits, "value_bits", self.allowed_bits)
        positive(self.value_group, "value_group")

    def bind(self, spec: ModelSpec) -> None:
        for name in ("key_bits", "value_bits"):
            bits = getattr(self, name)
            if not isinstance(bits, int) and len(bits) != spec.n_layers:
                raise ValueError(
                    f"{name} lists {len(bits)} widths; the model has {spec.n_layers} layers "
                    "(give one width, or exactly one per layer)"
                )
        if spec.head_dim % self.value_group:
            raise ValueError(
                f"value_group={self.value_group} must divide the head dim {spec.head_dim}"
            )

    def encode(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None,
               layer: int, selection: Any) -> tuple[QuantizedTensor, QuantizedTensor]:
        # keys, values: [B, H, G, D]; valid: [B, G] -> per-channel keys, per-token values
        key_valid = None if valid is None else valid[:, None, :, None]
        k = quantize(keys, per_layer(self.key_bits, layer), dim=-2, valid=key_valid)
        v = quantize_per_token(values, per_layer(self.value_bits, layer), self.value_group)
        return k, v

    def decode(self, blocks: Blocks, layer: int, selection: Any,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        keys = dequantize(blocks.keys, dtype)  # [B, n, H, G, D]
        values = dequantize_per_token(blocks.values, dtype)  # [B, n, H, G, D]
        return keys, values

    def bits(self, layer: int, dtype: torch.dtype) -> tuple[float, float]:
        return (per_layer(self.key_bits, layer) + STAT_BITS / self.group,
                per_layer(self.value_bits, layer) + STAT_BITS / self.value_group)

    def describe(self) -> str:
        return "key bits = key_bits + 32/group; value bits = value_bits + 32/value_group"
