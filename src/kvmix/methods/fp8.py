"""``fp8``: the float8 KV cache of vLLM and SGLang (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``).

Every key and value is stored as ``float8(x / s)`` (saturated at the format's largest value) and
read back as ``code · s``. The scale ``s`` is one float32 per layer (``scale=tensor``, vLLM's
per-tensor scales) or per layer and KV head (``scale=head``), set once from the prompt as
``amax / fmax`` (the largest magnitude the prompt shows, over the format's largest finite value:
448 for e4m3, 57344 for e5m2); ``scale=one`` is s = 1, what vLLM uses when the checkpoint
carries no scales and none are computed. Like the engines, every token is stored in float8 right
after its own step (``sink=0``, ``residual=1``, ``group=1``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvmix.methods.base import Blocks, Method, ModelSpec, choice
from kvmix.methods.registry import register

DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALES = ("tensor", "head", "one")


@dataclass
class Fp8Scales:
    """The prompt's scales: keys and values [B, H or 1, 1, 1] float32 (prefill state: counted
    with the selections, as ``masks``)."""

    keys: torch.Tensor
    values: torch.Tensor


@dataclass
class Float8Codes:
    """float8 codes as bytes: [B, H, G, D] uint8 (viewed back as the float8 dtype to read)."""

    codes: torch.Tensor = field(metadata={"kind": "codes"})


@register
@dataclass
class Fp8(Method):
    """Float8 codes (e4m3 or e5m2) with a float32 scale per layer or per KV head.

    Bits per element: 8 (plus 2·32 bits per layer, or per KV head, for the scales).
    """

    name: ClassVar[str] = "fp8"
    summary: ClassVar[str] = "vLLM/SGLang float8 KV cache: e4m3/e5m2, per-tensor or per-head scale"

    format: str = "e4m3"
    scale: str = "tensor"
    sink: int = 0
    residual: int = 1
    group: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        choice(self.format, "format", tuple(DTYPES))
        choice(self.scale, "scale", SCALES)

    def select(self, queries: torch.Tensor, keys: torch.Tensor, layer: int,
               values: torch.Tensor | None = None) -> Fp8Scales:
        return Fp8Scales(self._scale(keys), self._scale(values))

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, H, T, D] -> [B, H or 1, 1, 1]
        dims = (1, 2, 3) if self.scale == "tensor" else (2, 3)
        amax = x.float().abs().amax(dim=dims, keepdim=True)
        if self.scale == "one":
            return torch.ones_like(amax[:, :1])
        largest = torch.finfo(DTYPES[self.format]).max
        return torch.where(amax > 0, amax / largest, torch.ones_like(amax))

    def encode(self, keys: torch.Tensor, values: torch.Tensor, layer: int,
               selection: Fp8Scales) -> tuple[Float8Codes, Float8Codes]:
        # keys, values: [B, H, G, D] -> float8 codes as bytes, same shape
        return self._codes(keys, selection.keys), self._codes(values, selection.values)

    def _codes(self, x: torch.Tensor, scale: torch.Tensor) -> Float8Codes:
        largest = torch.finfo(DTYPES[self.format]).max
        scaled = (x.float() / scale).clamp(-largest, largest)
        return Float8Codes(scaled.to(DTYPES[self.format]).view(torch.uint8))

    def decode(self, blocks: Blocks, layer: int, selection: Fp8Scales,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # codes [B, n, H, G, D]; scales [B, 1, H|1, 1, 1]
        def read(stored: Float8Codes, scale: torch.Tensor) -> torch.Tensor:
            codes = stored.codes.view(DTYPES[self.format]).float()
            return (codes * scale[:, None]).to(dtype)
        return read(blocks.keys, selection.keys), read(blocks.values, selection.values)

    def bits(self, layer: int, dtype: torch.dtype) -> tuple[float, float]:
        return 8.0, 8.0

    def selection_bits(self, spec: ModelSpec) -> int:
        return 2 * 32 * (spec.n_kv_heads if self.scale == "head" else 1)

    @classmethod
    def describe(cls) -> str:
        return "8 bits per key and value (+ float32 scales per layer or KV head)"
