"""``ggml``: llama.cpp's KV cache types (``--cache-type-k/-v``), bit for bit, so kvmix predicts
what the engine's cache costs in quality.

Each token's keys (and values) of a head are cut into blocks of 32 channels; a block keeps a
float16 scale ``d`` (and a float16 minimum ``m`` for the ``_1`` types), computed as llama.cpp's
reference quantizers compute them (``quantize_row_*_ref``: float32 arithmetic, codes against the
unrounded scale):

* ``q8_0``: ``d = amax/127``, ``q = round(x/d)`` (half away from zero), ``x̂ = q·d``;
* ``q4_0`` / ``q5_0``: ``d = max/−8`` (``/−16``) with ``max`` the value of largest magnitude,
  ``q = min(15, trunc(x/d + 8.5))`` (31, 16.5), ``x̂ = (q − 8)·d`` (16);
* ``q4_1`` / ``q5_1``: ``d = (max − min)/15`` (31), ``q = min(15, trunc((x − min)/d + ½))``,
  ``x̂ = q·d + m``;
* ``f16`` / ``bf16``: the float16 / bfloat16 value (round to nearest even, as ggml's
  conversions).

Since llama.cpp's activation rotation (ggml-org/llama.cpp#21038, April 2026), a quantized side is
stored rotated by a block-diagonal normalized Hadamard matrix H (queries alike, the output
rotated back), when the head dim is a multiple of 64 (``src/llama-kv-cache.cpp``): keys in blocks
of the largest power of two dividing the head dim, values in blocks of 64. ``rotate=auto`` does
the same (``x̂ = H·Q(H·x)``, exactly equivalent); ``rotate=none`` is the engine with
``LLAMA_ATTN_ROT_DISABLE=1``.

Keys enter the cache in the engine's frame (``transform_keys``: channel order, then rotation;
queries alike, so every score is kept) and are stored and read there: no rotation per page at
each step; values are rotated back when read. The rotations are butterflies (additions only), so
a sequence's codes are the same in any batch.

The engine's CPU flash attention converts each query to the key type's dot type before the dot
products (``ggml/src/ggml-cpu/ops.cpp``): q8_0 blocks for q8_0, q5_0 and q4_0 keys, q8_1 for
q5_1 and q4_1 (the same codes and scale as q8_0; the sum q8_1 keeps for the minimum term is
float16 in the engine, exact here). ``query=engine`` (the default) rounds the query the same way,
in the engine's channel order and rotation; ``query=float`` keeps it float. f16 keys: the
query stays float (the engine's single-token decode rounds it to float16, its batched prompt
path does not; below the cache's own float16 rounding either way).

llama.cpp stores every token quantized, the prompt's too, with no sink and no float residual:
the defaults here (``sink=0``, ``residual=1``, ``group=1``: a token is encoded right after its
own attention step). ``key_order="pairs"`` groups key channels in the engine's order for
Llama-family GGUF files, whose converter interleaves each RoPE pair (channels ``i`` and
``i + D/2`` become ``2i`` and ``2i + 1``); ``"model"`` keeps the model's order (NEOX-style
architectures such as Qwen2). Values are never permuted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvmix.core.packing import pack, unpack
from kvmix.core.transforms import walsh_hadamard
from kvmix.methods.base import Blocks, Method, ModelSpec, choice, require_pairs
from kvmix.methods.registry import register

BLOCK = 32
# type: (code bits, has a minimum); f16 is the float16 value itself
FLOATS = {"f16": torch.float16, "bf16": torch.bfloat16}  # stored as the float itself
FORMATS = {"f16": (16, False), "bf16": (16, False), "q8_0": (8, False), "q5_0": (5, False),
           "q5_1": (5, True),
           "q4_0": (4, False), "q4_1": (4, True)}
ORDERS = ("pairs", "model")
ROTATIONS = ("auto", "none")
QUERIES = ("engine", "float")
ROTATION_STEP = 64  # the engine rotates a side when the head dim is a multiple of this


@dataclass
class GgmlBlocks:
    """Per-token blocks of 32 channels: codes [B, bytes] (q8_0: int8 as bytes; 5 bits: a 4-bit
    then a 1-bit plane per block), float16 scale and minimum [B, H, G, D/32]."""

    codes: torch.Tensor = field(metadata={"kind": "codes"})
    scale: torch.Tensor = field(metadata={"kind": "scales"})
    minimum: torch.Tensor | None = field(default=None, metadata={"kind": "zeros"})


def quantize_blocks(x: torch.Tensor, kind: str) -> GgmlBlocks | torch.Tensor:
    """x: [B, H, G, D] -> llama.cpp's ``kind`` blocks over the last axis (float16 for f16)."""
    if kind in FLOATS:
        return x.to(FLOATS[kind])
    bits, affine = FORMATS[kind]
    x = x.float().unflatten(-1, (-1, BLOCK))  # [B, H, G, D/32, 32]
    if affine:
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (hi - lo) / (2**bits - 1)
        codes = _trunc((x - lo) * _inverse(d) + 0.5).clamp_(max=2**bits - 1)
        minimum = lo.to(torch.float16)[..., 0]
    else:
        top = x.gather(-1, x.abs().argmax(-1, keepdim=True))  # the first of largest magnitude
        if bits == 8:
            d = x.abs().amax(-1, keepdim=True) / 127
            codes = _round_away(x * _inverse(d)) + 128  # int8 as a byte
        else:
            d = top / -(2 ** (bits - 1))
            codes = _trunc(x * _inverse(d) + 2 ** (bits - 1) + 0.5).clamp_(max=2**bits - 1)
        minimum = None
    codes = codes.to(torch.uint8)
    return GgmlBlocks(_pack(codes, bits), d.to(torch.float16)[..., 0], minimum)


def dequantize_blocks(stored: GgmlBlocks | torch.Tensor, kind: str, shape: tuple[int, ...],
                      dtype: torch.dtype) -> torch.Tensor:
    """Stored blocks (rows [B, n]) -> [B, n, H, G, D] in ``dtype``."""
    if kind in FLOATS:
        return stored.to(dtype)
    bits, affine = FORMATS[kind]
    rows = stored.codes.shape[:-1]
    codes = _unpack(stored.codes, bits, int(torch.Size(shape).numel())).float()
    codes = codes.view(*rows, *shape[:-1], -1, BLOCK)  # [B, n, H, G, D/32, 32]
    d = stored.scale.float()[..., None]
    if affine:
        x = codes * d + stored.minimum.float()[..., None]
    else:
        x = (codes - (128 if bits == 8 else 2 ** (bits - 1))) * d
    return x.flatten(-2).to(dtype)


def format_bits(kind: str) -> float:
    """Bits per element: codes plus a float16 scale (and minimum) per 32."""
    bits, affine = FORMATS[kind]
    return float(bits) if kind in FLOATS else bits + 16 * (1 + affine) / BLOCK


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d != 0, 1 / d, torch.zeros_like(d))


def _trunc(x: torch.Tensor) -> torch.Tensor:
    return x.trunc()  # C's (int8_t) cast


def _round_away(x: torch.Tensor) -> torch.Tensor:
    return x.sign() * (x.abs() + 0.5).floor()  # C's roundf


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 5:  # llama.cpp's qs (low 4 bits) and qh (the fifth): here two planes
        return torch.cat([pack(codes & 15, 4), pack(codes >> 4, 1)], dim=-1)
    return pack(codes, bits)


def _unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    if bits == 5:
        low = numel // 2
        return unpack(packed[..., :low], 4, numel, BLOCK) | (
            unpack(packed[..., low:], 1, numel, BLOCK) << 4)
    return unpack(packed, bits, numel, BLOCK)


@register
@dataclass
class Ggml(Method):
    """llama.cpp's cache types per side: ``k`` and ``v`` in f16, bf16, q8_0, q5_1, q5_0, q4_1,
    q4_0.

    Bits per element: f16, bf16 16; q8_0 8.5; q5_1 6; q5_0 5.5; q4_1 5; q4_0 4.5.
    """

    name: ClassVar[str] = "ggml"
    summary: ClassVar[str] = "llama.cpp's KV cache types (q8_0, q5_x, q4_x, f16), bit for bit"
    presets: ClassVar[dict] = {"ggml-k8v4": {"k": "q8_0", "v": "q4_0"},
                               "ggml-q4": {"k": "q4_0", "v": "q4_0"}}

    k: str = "q8_0"
    v: str = "q8_0"
    key_order: str = "pairs"
    rotate: str = "auto"
    query: str = "engine"
    sink: int = 0
    residual: int = 1
    group: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        choice(self.k, "k", tuple(FORMATS))
        choice(self.v, "v", tuple(FORMATS))
        choice(self.key_order, "key_order", ORDERS)
        choice(self.rotate, "rotate", ROTATIONS)
        choice(self.query, "query", QUERIES)

    def bind(self, spec: ModelSpec) -> None:
        if spec.head_dim % BLOCK:
            raise ValueError(f"ggml needs a head dim divisible by {BLOCK}; the model's is "
                             f"{spec.head_dim}")
        if self.key_order == "pairs" and self.k not in FLOATS:
            require_pairs(spec, "ggml:key_order=pairs")
        self.spec = spec
        # the engine's channel of each stored key channel (a view of the model's pairs), or None
        pairs = self.key_order == "pairs" and self.k not in FLOATS
        self.order = spec.pairs.flatten() if pairs else None
        self.rotation = self._blocks(spec)  # each side's Hadamard block (0: not rotated)

    def transform_keys(self, keys: torch.Tensor, layer: int) -> torch.Tensor:
        """Keys [B, H, q, D] into the engine's frame as they enter the cache: its channel
        order, then its rotation (orthogonal: queries alike keep every score)."""
        return self._rotated(self._ordered(keys), "k").to(keys.dtype)

    def transform_queries(self, queries: torch.Tensor, layer: int) -> torch.Tensor:
        """Queries [B, Hq, q, D] into the engine's frame, rounded as the engine's flash
        attention rounds them against this key type (``query=engine``: q8_0 codes)."""
        dtype, queries = queries.dtype, self._rotated(self._ordered(queries), "k")
        if self.query == "float" or self.k in FLOATS:
            return queries.to(dtype)
        rounded = quantize_blocks(queries, "q8_0")
        return dequantize_blocks(rounded, "q8_0", queries.shape[1:], dtype)

    def encode(self, keys: torch.Tensor, values: torch.Tensor, layer: int,
               selection: Any) -> tuple[Any, Any]:
        # keys, values: [B, H, G, D]; keys already in the engine's frame (transform_keys)
        return quantize_blocks(keys, self.k), quantize_blocks(self._rotated(values, "v"), self.v)

    def _ordered(self, x: torch.Tensor) -> torch.Tensor:
        """Key channels in the engine's order."""
        return x if self.order is None else x.index_select(-1, self.order.to(x.device))

    def _rotated(self, x: torch.Tensor, side: str) -> torch.Tensor:
        """x·H over each block for a side the engine rotates (H normalized, H = H⁻¹: also the
        way back); a butterfly, so a sequence's codes do not depend on its batch."""
        block = self.rotation[side]
        if not block:
            return x
        return walsh_hadamard(x.float(), block) * block**-0.5

    def decode(self, blocks: Blocks, layer: int, selection: Any,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.spec.n_kv_heads, self.group, self.spec.head_dim)
        keys = dequantize_blocks(blocks.keys, self.k, shape, dtype)  # the engine's frame
        values = dequantize_blocks(blocks.values, self.v, shape, torch.float32)
        return keys, self._rotated(values, "v").to(dtype)

    def bits(self, layer: int, dtype: torch.dtype) -> tuple[float, float]:
        return format_bits(self.k), format_bits(self.v)

    def _blocks(self, spec: ModelSpec) -> dict[str, int]:
        """Per side, the engine's rotation block (0: not rotated): a quantized side of a head
        dim that is a multiple of 64; keys over the largest power of two dividing it, values
        over 64."""
        rotates = self.rotate == "auto" and spec.head_dim % ROTATION_STEP == 0
        blocks = {"k": spec.head_dim & -spec.head_dim, "v": ROTATION_STEP}
        kinds = {"k": self.k, "v": self.v}
        return {side: block if rotates and kinds[side] not in FLOATS else 0
                for side, block in blocks.items()}

    @classmethod
    def describe(cls) -> str:
        return ("per side: f16/bf16 16, q8_0 8.5, q5_1 6, q5_0 5.5, q4_1 5, q4_0 4.5 bits "
                "(codes + float16 scale/min per 32 channels)")
