"""``kxvy``: key-priority bit allocation ("more bits for keys, fewer for values",
docs/guide/methods.md).

Keys are quantized per channel over groups of ``group`` tokens and values per token over groups of
``value_group`` channels, both asymmetric min-max with a float16 scale and minimum, at independent
bit widths. ``key_bits`` and ``value_bits`` may be one width for every layer or a per-layer list
(``key_bits=4/4/2/...`` in a method string).

``budget=3`` instead allocates per-layer widths from ``allowed`` (default 1/2/3/4/8) averaging
exactly the budget over keys and values, by water-filling on ‖W_K‖², ‖W_V‖² (kvmix.core.allocation);
the plan is kept in ``plan`` and printed by the commands.

``rotate``: ``keys`` multiplies keys by a normalized Hadamard matrix H as they enter the cache
(after RoPE) and queries by the same H in the attention hook, so ``q'·k' = q·k`` and only the
quantization sees the rotated basis; ``values`` folds H into W_V and Hᵀ into W_O of a copy of the
model (``kvmix.prepare_model``; the cache refuses an unfolded model), so the values
arrive rotated and need no online work; ``both`` does both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvmix.core.allocation import allocate
from kvmix.core.bits import WIDTHS, check_bits
from kvmix.core.quantizers import (
    QuantizedTensor,
    dequantize,
    dequantize_per_token,
    quantize,
    quantize_per_token,
)
from kvmix.core.transforms import hadamard, walsh_hadamard
from kvmix.methods.backends import (
    check_backend,
    dequantize_rows,
    key_rows,
    quantize_rows,
    value_rows,
)
from kvmix.methods.base import (
    KEY_TRANSFORM,
    PER_CHANNEL_KEYS,
    STAT_BITS,
    VALUE_FOLD,
    Blocks,
    KernelView,
    Method,
    ModelSpec,
    PageEncoding,
    channel_keys,
    choice,
    positive,
    token_groups,
)
from kvmix.methods.registry import register

Bits = int | tuple[int, ...]
ROTATIONS = ("none", "keys", "values", "both")
VALUE_ROTATION = "hadamard-values"  # marks a model copy with H folded into W_V/W_O


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
    fast_path: ClassVar[str] = "cpu op + triton (backend=native; quanto/hqq: reference)"
    allowed_bits: ClassVar[tuple[int, ...]] = WIDTHS

    key_bits: Bits = 4
    value_bits: Bits = 2
    group: int = 32
    value_group: int = 32
    sink: int = 0
    residual: int = 128
    budget: float | None = None
    allowed: tuple[int, ...] = WIDTHS
    rotate: str = "none"
    backend: str = "native"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bit_list(self.key_bits, "key_bits", self.allowed_bits)
        check_bit_list(self.value_bits, "value_bits", self.allowed_bits)
        self.allowed = (self.allowed,) if isinstance(self.allowed, int) else tuple(self.allowed)
        check_bit_list(self.allowed, "allowed", self.allowed_bits)
        if self.budget is not None and not isinstance(self.budget, (int, float)):
            raise ValueError(f"budget={self.budget!r} is invalid; expected average bits")
        positive(self.value_group, "value_group")
        choice(self.rotate, "rotate", ROTATIONS)
        widths = self.allowed if self.budget is not None else tuple(
            b for bits in (self.key_bits, self.value_bits)
            for b in ((bits,) if isinstance(bits, int) else bits))
        check_backend(self.backend, widths, "budget widths" if self.budget is not None
                      else "key/value widths")
        self.plan: dict[str, list[int]] | None = None

    def bind(self, spec: ModelSpec) -> None:
        self.spec = spec
        if self.budget is not None:
            self._allocate(spec)
        self.rotates_keys = self.rotate in ("keys", "both")
        if self.rotate in ("values", "both") and spec.folded != VALUE_ROTATION:
            raise ValueError(f"rotate={self.rotate!r} needs the model with the value rotation "
                             "folded into W_V/W_O: use kvmix.prepare_model(model, method) "
                             "and make the cache for the model it returns")
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

    def _allocate(self, spec: ModelSpec) -> None:
        if spec.kv_norms is None:
            raise ValueError("budget mode needs the model's W_K/W_V norms: build the cache with "
                             "kvmix.make_cache(model, ...)")
        plan = allocate(spec.kv_norms, float(self.budget), self.allowed)  # [L, 2]
        self.key_bits, self.value_bits = tuple(plan[:, 0].tolist()), tuple(plan[:, 1].tolist())
        self.plan = {"key_bits": list(self.key_bits), "value_bits": list(self.value_bits)}

    def value_fold(self, spec: ModelSpec) -> tuple[torch.Tensor, str] | None:
        """The Hadamard rotation the runtime folds into W_V/W_O: ([L, H, D, D], an id)."""
        if self.rotate not in ("values", "both"):
            return None
        rotation = hadamard(spec.head_dim, torch.float64)
        return rotation.expand(spec.n_layers, spec.n_kv_heads, -1, -1), VALUE_ROTATION

    def transform_keys(self, keys: torch.Tensor, layer: int) -> torch.Tensor:
        """The normalized Hadamard rotation (a butterfly: no matrix to hold or move)."""
        if not self.rotates_keys:
            return keys
        dim = keys.shape[-1]
        return (walsh_hadamard(keys.float(), dim) * dim**-0.5).to(keys.dtype)

    def transform_queries(self, queries: torch.Tensor, layer: int) -> torch.Tensor:
        return self.transform_keys(queries, layer)

    def encode(self, keys: torch.Tensor, values: torch.Tensor, layer: int,
               selection: Any) -> tuple[Any, Any]:
        # keys, values: [B, H, G, D] -> per-channel keys, per-token values
        key_bits, value_bits = per_layer(self.key_bits, layer), per_layer(self.value_bits, layer)
        if self.backend != "native":
            return (quantize_rows(key_rows(keys), key_bits, self.backend),
                    quantize_rows(value_rows(values, self.value_group), value_bits, self.backend))
        k = quantize(keys.transpose(-1, -2), key_bits, dim=-1)  # rows: a channel's tokens
        return k, quantize_per_token(values, value_bits, self.value_group)

    def token_values(self, values: torch.Tensor, layer: int) -> QuantizedTensor | None:
        if self.backend != "native":
            return None
        return quantize_per_token(values, per_layer(self.value_bits, layer), self.value_group)

    def decode(self, blocks: Blocks, layer: int, selection: Any,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.backend != "native":
            keys, values = _decode_rows(blocks, self.spec, dtype)
        else:
            keys = dequantize(blocks.keys, dtype).transpose(-1, -2)  # [B, n, H, G, D]
            values = dequantize_per_token(blocks.values, dtype)  # [B, n, H, G, D]
        return keys, values

    def unfused(self) -> str:
        return "" if self.backend == "native" else \
            f"kxvy:backend={self.backend} decodes through its library (the reference path)"

    def page_encoding(self, layer: int) -> PageEncoding | None:
        if self.backend != "native":
            return None
        bits = per_layer(self.key_bits, layer)
        return PageEncoding(bits, bits, False, per_layer(self.value_bits, layer),
                            self.value_group, ("codes", "scale", "minimum"))

    def kernel_view(self, blocks: Blocks, layer: int, selection: Any) -> KernelView | None:
        if self.backend != "native":
            return None
        return KernelView(channel_keys(blocks.keys), token_groups(blocks.values, self.value_group))

    def bits(self, layer: int, dtype: torch.dtype) -> tuple[float, float]:
        return (per_layer(self.key_bits, layer) + STAT_BITS / self.group,
                per_layer(self.value_bits, layer) + STAT_BITS / self.value_group)

    def engine_limits(self) -> list[str]:
        limits = [PER_CHANNEL_KEYS]
        if self.rotate in ("keys", "both"):
            limits.append(KEY_TRANSFORM)
        if self.rotate in ("values", "both"):
            limits.append(VALUE_FOLD)
        return limits

    @classmethod
    def describe(cls) -> str:
        return ("key bits = key_bits + 32/group; value bits = value_bits + 32/value_group "
                "(budget mode: per-layer widths averaging the budget)")



def _decode_rows(blocks: Blocks, spec: ModelSpec, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Library rows back to keys and values [B, n, H, G, D]."""
    keys = dequantize_rows(blocks.keys, dtype)  # [B, n, H·D, G]
    keys = keys.unflatten(-2, (spec.n_kv_heads, spec.head_dim)).transpose(-1, -2)
    values = dequantize_rows(blocks.values, dtype)  # [B, n, H·G·D/Gv, Gv]
    return keys, values.reshape(keys.shape)
