"""``pertoken``: the engines' per-token formats with dynamic scales, as their store kernels
compute them, so kvmix predicts what they cost in quality (read from the released sources).

vLLM 0.33.0 (``vllm/v1/attention/ops/triton_reshape_and_cache_flash.py`` and
``int4_per_token_head.py``), one float32 scale per token and KV head:

* ``int8_per_token_head``: ``s = max(amax/127, 1e-6)``, ``q = trunc(clamp(x·(1/s) ± ½, −128,
  127))`` (half away from zero, then the int8 store truncates), ``x̂ = q·s``;
* ``fp8_per_token_head``: ``s = max(amax/448, 1e-6)``, ``q = e4m3(clamp(x·(1/s), ±448))``;
* ``int4_per_token_head``: a randomized Hadamard transform first, ``x' = H·(d₁ ⊙ x)`` with H
  unnormalized over the largest power-of-two block of the head dim and d₁ vLLM's seeded ±1
  signs (cast back to the model's dtype); then asymmetric 4 bits, ``s = max((max − min)/15,
  1e-6)``, zero point ``z = clamp(round(−min/s), 0, 15)``, ``q = clamp(round(x'·(1/s) + z), 0,
  15)`` (half away from zero), z hidden in the low 4 mantissa bits of the stored scale, read
  back as ``x̂' = (q − z)·s̃`` with s̃ those bits cleared, and ``x̂ = d₁ ⊙ (H·x̂')/b``.

SGLang 0.5.23 (``sglang/kernels/ops/kvcache/mxfp8_quant_store_kv.py``), ``mxfp8``: blocks of
32 channels per token and head, a UE8M0 scale ``e = clamp(⌈log2(amax/448)⌉ + 127, 0, 254)``,
``q = e4m3(clamp(x/2^(e−127), ±448))``.

Every token is stored right after its own step (``sink=0``, ``residual=1``, ``group=1``), as
the engines store it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvmix.core.packing import pack, unpack
from kvmix.core.transforms import walsh_hadamard
from kvmix.methods.base import Blocks, Method, ModelSpec, choice
from kvmix.methods.registry import register

FORMATS = ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head", "mxfp8")
E4M3_MAX = 448.0
MX_BLOCK = 32
RHT_SEED = 0x9E3779B9  # vLLM's seed of the first round's signs


@dataclass
class TokenCodes:
    """Codes [B, H, G, D] uint8 (int4: packed two per byte, [B, bytes]) and scales: float32
    [B, H, G] per token and head (int4: the zero point in the low mantissa bits), or mxfp8's
    UE8M0 exponents, one byte each, as int8 less the bias 127 [B, H, G, D/32]."""

    codes: torch.Tensor = field(metadata={"kind": "codes"})
    scale: torch.Tensor = field(metadata={"kind": "scales"})


def rht_block(dim: int) -> int:
    """The largest power-of-two divisor of the head dim: vLLM's block of the transform."""
    return dim & -dim


def rht_signs(block: int) -> torch.Tensor:
    """vLLM's deterministic ±1 signs d₁ [block] (float32)."""
    generator = torch.Generator().manual_seed(RHT_SEED)
    return 2.0 * torch.bernoulli(torch.full((block,), 0.5), generator=generator) - 1.0


def rht(x: torch.Tensor, signs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [..., D] in blocks of len(signs): H·(d₁ ⊙ x), or its inverse d₁ ⊙ (H·x)/b."""
    block = signs.numel()
    x, signs = x.float(), signs.to(x.device).repeat(x.shape[-1] // block)
    if inverse:
        return walsh_hadamard(x, block) * signs / block
    return walsh_hadamard(x * signs, block)


def _round_away(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, x + 0.5, x - 0.5).trunc()  # +½ or −½, then C's cast


def quantize(x: torch.Tensor, kind: str) -> TokenCodes:
    """x: [B, H, G, D] -> the engine's stored codes and scales."""
    x = x.float()
    if kind == "mxfp8":
        blocks = x.unflatten(-1, (-1, MX_BLOCK))
        amax = blocks.abs().amax(-1).clamp(min=1e-30)
        biased = (torch.log2(amax / E4M3_MAX).ceil() + 127).clamp(0, 254)
        scaled = blocks / torch.exp2(biased - 127)[..., None]
        codes = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).flatten(-2)
        return TokenCodes(codes.view(torch.uint8), (biased - 127).to(torch.int8))
    if kind == "int4_per_token_head":
        lo, hi = x.amin(-1), x.amax(-1)
        s = ((hi - lo) / 15).clamp(min=1e-6)
        zero = _round_away(-lo / s).clamp(0, 15)
        q = _round_away(x * (1 / s)[..., None] + zero[..., None]).clamp(0, 15)
        packed = (s.view(torch.int32) & -16) | zero.to(torch.int32)
        return TokenCodes(pack(q.to(torch.uint8), 4), packed.view(torch.float32))
    top = 127.0 if kind == "int8_per_token_head" else E4M3_MAX
    s = (x.abs().amax(-1) / top).clamp(min=1e-6)
    scaled = x * (1 / s)[..., None]
    if kind == "int8_per_token_head":
        codes = _round_away(scaled).clamp(-128, 127).to(torch.int8)
    else:
        codes = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return TokenCodes(codes.view(torch.uint8), s)


def dequantize(stored: TokenCodes, kind: str, shape: tuple[int, int, int]) -> torch.Tensor:
    """Stored rows [B, n, ...] of blocks ``shape`` = (H, G, D) -> float32 [B, n, H, G, D]
    (int4: still rotated)."""
    if kind == "mxfp8":
        codes = stored.codes.view(torch.float8_e4m3fn).float().unflatten(-1, (-1, MX_BLOCK))
        return (codes * torch.exp2(stored.scale.float())[..., None]).flatten(-2)
    if kind == "int4_per_token_head":
        bits = stored.scale.view(torch.int32)
        zero, s = (bits & 15).float(), (bits & -16).view(torch.float32)
        rows = stored.codes.shape[:-1]
        numel = shape[0] * shape[1] * shape[2]
        codes = unpack(stored.codes, 4, numel, shape[2]).view(*rows, *shape).float()
        return (codes - zero[..., None]) * s[..., None]
    dtype = torch.int8 if kind == "int8_per_token_head" else torch.float8_e4m3fn
    return stored.codes.view(dtype).float() * stored.scale[..., None]


def format_bits(kind: str, dim: int) -> float:
    """Bits per element: codes plus the scales (per token and head, or per block of 32)."""
    if kind == "mxfp8":
        return 8 + 8 / MX_BLOCK
    return (4 if kind == "int4_per_token_head" else 8) + 32 / dim


@register
@dataclass
class PerToken(Method):
    """vLLM's per-token-head cache modes and SGLang's mxfp8: every token's codes with dynamic
    scales, one format for keys and values.

    Bits per element: int8/fp8_per_token_head 8 + 32/D; int4_per_token_head 4 + 32/D; mxfp8
    8.25.
    """

    name: ClassVar[str] = "pertoken"
    summary: ClassVar[str] = ("vLLM's int8/fp8/int4_per_token_head and SGLang's mxfp8 cache "
                              "formats, as their kernels store them")
    presets: ClassVar[dict] = {"vllm-int8": {"format": "int8_per_token_head"},
                               "vllm-int4": {"format": "int4_per_token_head"},
                               "sglang-mxfp8": {"format": "mxfp8"}}

    format: str = "fp8_per_token_head"
    sink: int = 0
    residual: int = 1
    group: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        choice(self.format, "format", FORMATS)

    def bind(self, spec: ModelSpec) -> None:
        if self.format == "mxfp8" and spec.head_dim % MX_BLOCK:
            raise ValueError(f"pertoken:format=mxfp8 needs a head dim divisible by {MX_BLOCK}; "
                             f"the model's is {spec.head_dim}")
        if self.format == "int4_per_token_head" and spec.head_dim % 2:
            raise ValueError("pertoken:format=int4_per_token_head packs two channels per byte: "
                             f"it needs an even head dim; the model's is {spec.head_dim}")
        self.spec = spec
        rotates = self.format == "int4_per_token_head"
        self.signs = rht_signs(rht_block(spec.head_dim)) if rotates else None  # [b]

    def encode(self, keys: torch.Tensor, values: torch.Tensor, layer: int,
               selection: None) -> tuple[TokenCodes, TokenCodes]:
        # keys, values: [B, H, G, D]
        return self._encode(keys), self._encode(values)

    def _encode(self, x: torch.Tensor) -> TokenCodes:
        if self.signs is not None:  # vLLM rotates in float32, then casts to the model's dtype
            x = rht(x, self.signs).to(x.dtype)
        return quantize(x, self.format)

    def decode(self, blocks: Blocks, layer: int, selection: None,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        def read(stored: TokenCodes) -> torch.Tensor:
            shape = (self.spec.n_kv_heads, self.group, self.spec.head_dim)
            x = dequantize(stored, self.format, shape)  # [B, n, H, G, D]
            if self.signs is not None:
                x = rht(x, self.signs, inverse=True)
            return x.to(dtype)
        return read(blocks.keys), read(blocks.values)

    def bits(self, layer: int, dtype: torch.dtype) -> tuple[float, float]:
        bits = format_bits(self.format, self.spec.head_dim)
        return bits, bits

    def static_tensors(self) -> list[torch.Tensor]:
        return [] if self.signs is None else [self.signs]

    def static_nbytes(self, spec: ModelSpec) -> int:
        return 4 * rht_block(spec.head_dim) if self.format == "int4_per_token_head" else 0

    @classmethod
    def describe(cls) -> str:
        return ("int8/fp8_per_token_head 8 + 32/D, int4_per_token_head 4 + 32/D bits (float32 "
                "scale per token and head); mxfp8 8.25 (UE8M0 scale per 32 channels)")
