"""``full``: the reference. Blocks keep the model's own keys and values, unchanged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvmix.methods.base import Blocks, KernelView, Method
from kvmix.methods.registry import register


@register
@dataclass
class Full(Method):
    """Full precision (the model's dtype) for every token; what every method is measured against.

    Bits per element: the dtype's width (32 for float32, 16 for float16/bfloat16).
    """

    name: ClassVar[str] = "full"
    summary: ClassVar[str] = "reference: keys and values at the model's own precision"
    quantizes: ClassVar[bool] = False
    fast_path: ClassVar[str] = "cpu op + triton (float blocks)"

    sink: int = 0

    def encode(self, keys: torch.Tensor, values: torch.Tensor, layer: int,
               selection: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return keys, values

    def decode(self, blocks: Blocks, layer: int, selection: Any,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return blocks.keys.to(dtype), blocks.values.to(dtype)

    def kernel_view(self, blocks: Blocks, layer: int, selection: Any) -> KernelView:
        return KernelView(blocks.keys[0], blocks.values[0])  # [n, H, G, D]

    def bits(self, layer: int, dtype: torch.dtype) -> tuple[float, float]:
        width = torch.finfo(dtype).bits
        return float(width), float(width)

    @classmethod
    def describe(cls) -> str:
        return "key bits = value bits = dtype bits"
