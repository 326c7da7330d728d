"""``wush``: WUSH-KV, calibrated transforms with clipped quantizers (WUSH-KV, arXiv:2609.38121).

Keys are transformed after RoPE as they enter the cache (``k' = T_k k``) and queries by
``T_k^{-ᵀ}`` in the attention hook, so ``q'·k' = q·k``. Values are transformed by weights folded
into W_V and W_O (``kvmix.prepare_model`` makes the folded copy; the cache refuses a model
that is not folded with these transforms), so they need no online work. Both are then quantized
per token over each block of transformed channels with QuEST INT (``quantizer=quest``: symmetric,
clip ``c_b·RMS``, one float16 step per group) or percentile-clipped affine
(``quantizer=percentile``, ``percentile`` p: range [p-th, (100−p)-th percentile], float16 scale
and minimum).

Parameters: ``transforms`` (a file from ``kvmix calibrate``), ``transform`` (identity, hadamard,
wus, wush), ``quantizer``, ``key_bits``, ``value_bits``, ``sink``, ``residual``, ``group``.
Bits per element: ``bits + 16/block`` (QuEST) or ``bits + 32/block`` (percentile).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvmix.core.bits import check_bits
from kvmix.core.quantizers import (
    dequantize,
    percentile_quantize,
    quest_dequantize,
    quest_quantize,
)
from kvmix.core.transforms import KINDS, TransformSet, load_transforms
from kvmix.methods.base import (
    KEY_TRANSFORM,
    VALUE_FOLD,
    Blocks,
    KernelView,
    Method,
    ModelSpec,
    choice,
    token_groups,
)
from kvmix.methods.registry import register

QUANTIZERS = ("quest", "percentile")


@register
@dataclass
class Wush(Method):
    """WUSH-KV: calibrated key/value transforms, then QuEST or percentile-clipped quantizers."""

    name: ClassVar[str] = "wush"
    summary: ClassVar[str] = "WUSH-KV: calibrated transforms + clipped per-token quantizers"
    fast_path: ClassVar[str] = "cpu op + triton (queries transformed in the hook)"

    transforms: str = ""
    transform: str = "wush"
    quantizer: str = "quest"
    percentile: float = 1.0
    key_bits: int = 2
    value_bits: int = 2
    sink: int = 32
    residual: int = 128
    group: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        choice(self.transform, "transform", KINDS)
        choice(self.quantizer, "quantizer", QUANTIZERS)
        check_bits(self.key_bits, "key_bits")
        check_bits(self.value_bits, "value_bits")
        if not 0 <= self.percentile < 50:
            raise ValueError(f"percentile={self.percentile!r} is invalid; expected [0, 50)")
        if not self.transforms:
            raise ValueError("wush needs transforms=PATH, a file made by kvmix calibrate")
        self.meta = load_transforms(self.transforms).meta  # the matrices are read when needed
        self.block = int(self.meta["block"])

    def transform_set(self) -> TransformSet:
        """The calibrated transforms, read again from the file (the method keeps only what the
        cache needs); an error if the file changed since the method was made."""
        loaded = load_transforms(self.transforms)
        if loaded.checksum != self.meta["checksum"]:
            raise ValueError(f"transforms={self.transforms!r} changed on disk since the method "
                             "was made; make the method again")
        return loaded

    def bind(self, spec: ModelSpec) -> None:
        meta = self.meta
        shape = (str(spec.n_layers), str(spec.n_kv_heads), str(spec.head_dim))
        if meta.get("model") != spec.name or (meta["layers"], meta["kv_heads"],
                                              meta["head_dim"]) != shape:
            raise ValueError(f"transforms={self.transforms!r} were calibrated for model "
                             f"{meta.get('model')!r} ({meta.get('layers')} layers, "
                             f"{meta.get('kv_heads')} KV heads, head dim {meta.get('head_dim')}),"
                             f" not for {spec.name!r} ({', '.join(shape)})")
        if spec.folded != self.fold_id:
            raise ValueError("wush needs the model with its value transforms folded in: use "
                             "kvmix.prepare_model(model, method) and make the cache for "
                             "the model it returns")
        self.spec = spec
        keys = self.transform_set().keys[self.transform]  # [L, H, D, D] float64
        # per layer [H, D, D] float32, moved to the layer's device at its first use
        self.key_right = [m.clone() for m in keys.transpose(-1, -2).float()]  # k' = k @ T_kᵀ
        self.query_right = [m.clone() for m in torch.linalg.inv(keys).float()]  # q' = q T_k⁻¹

    @property
    def fold_id(self) -> str:
        return f"{self.meta['checksum']}:{self.transform}"

    def value_fold(self, spec: ModelSpec) -> tuple[torch.Tensor, str] | None:
        """What the runtime folds into W_V/W_O for this method: (T_v [L, H, D, D], an id)."""
        return self.transform_set().values[self.transform], self.fold_id

    def static_tensors(self) -> list[torch.Tensor]:
        return [*self.key_right, *self.query_right]

    def static_nbytes(self, spec: ModelSpec) -> int:
        return 2 * 4 * spec.n_layers * spec.n_kv_heads * spec.head_dim**2  # two float32 [L,H,D,D]

    def engine_limits(self) -> list[str]:
        return [KEY_TRANSFORM, VALUE_FOLD,
                f"{self.quantizer} clipped per-token quantizers (engines use absmax/min-max)"]

    def bits(self, layer: int, dtype: torch.dtype) -> tuple[float, float]:
        stats = 16 if self.quantizer == "quest" else 32
        return self.key_bits + stats / self.block, self.value_bits + stats / self.block

    @classmethod
    def describe(cls) -> str:
        return "bits + 16/block (quest) or + 32/block (percentile), for keys and values"

    def transform_keys(self, keys: torch.Tensor, layer: int) -> torch.Tensor:
        right = _placed(self.key_right, layer, keys.device)  # [H, D, D]
        return torch.einsum("bhtd,hde->bhte", keys.float(), right).to(keys.dtype)

    def transform_queries(self, queries: torch.Tensor, layer: int) -> torch.Tensor:
        right = _placed(self.query_right, layer, queries.device)  # [H, D, D]
        right = right.repeat_interleave(queries.shape[1] // right.shape[0], 0)
        return torch.einsum("bhtd,hde->bhte", queries.float(), right).to(queries.dtype)

    def encode(self, keys: torch.Tensor, values: torch.Tensor, layer: int,
               selection: Any) -> tuple[Any, Any]:
        # keys, values: [B, H, G, D], already transformed -> per token, per block of channels
        return (self.quantize_tokens(keys, self.key_bits),
                self.quantize_tokens(values, self.value_bits))

    def decode(self, blocks: Blocks, layer: int, selection: Any,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.dequantize_tokens(blocks.keys, dtype),
                self.dequantize_tokens(blocks.values, dtype))

    def kernel_view(self, blocks: Blocks, layer: int, selection: Any) -> KernelView:
        symmetric = self.quantizer == "quest"
        return KernelView(token_groups(blocks.keys, self.block, symmetric),
                          token_groups(blocks.values, self.block, symmetric))

    def quantize_tokens(self, x: torch.Tensor, bits: int):
        """x: [B, H, T, D] transformed -> per token, per block of channels."""
        grouped = x.unflatten(-1, (-1, self.block))  # [B, H, G, D/block, block]
        if self.quantizer == "quest":
            return quest_quantize(grouped, bits)
        return percentile_quantize(grouped, bits, self.percentile)

    def dequantize_tokens(self, stored, dtype: torch.dtype) -> torch.Tensor:
        if self.quantizer == "quest":
            return quest_dequantize(stored, dtype).flatten(-2)
        return dequantize(stored, dtype).flatten(-2)


def _placed(matrices: list[torch.Tensor], layer: int, device: torch.device) -> torch.Tensor:
    """A layer's matrix on the device of its layer: moved there once, at its first use, not
    copied at every step."""
    if matrices[layer].device != device:
        matrices[layer] = matrices[layer].to(device)
    return matrices[layer]
