"""The packed KV cache (SPEC §2) as a transformers ``Cache``: one ``KVMixLayer`` per
full-attention layer, transformers' own layers for the others, and the cache-wide figures
(bytes held, bytes by the bit formula, bits per element)."""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    get_layer_types_and_kwargs,
)

from kvmix.core.tree import tensor_bytes
from kvmix.methods import Method, ModelSpec, parse_method
from kvmix.runtime.layer import KVMixLayer, clear_pending

QUANTIZED_LAYER_TYPES = ("full_attention",)


def model_spec(config: Any, pairs: torch.Tensor | None = None,
               kv_norms: torch.Tensor | None = None, folded: str | None = None) -> ModelSpec:
    """The attention layout of a transformers config; a clear error when it is not there."""
    config = config.get_text_config(decoder=True)
    missing = [a for a in ("num_hidden_layers", "num_attention_heads") if not hasattr(config, a)]
    if missing:
        raise ValueError(
            f"model config {type(config).__name__} lacks {missing}: kvmix needs a decoder with "
            "multi-head attention (num_hidden_layers, num_attention_heads, num_key_value_heads)"
        )
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of "
                         f"num_key_value_heads={kv_heads}")
    name = getattr(config, "_name_or_path", "") or ""
    return ModelSpec(config.num_hidden_layers, heads, kv_heads, head_dim, pairs, kv_norms, name,
                     folded)


class KVMixCache(Cache):
    """A transformers Cache whose full-attention layers are packed by one kvmix method."""

    def __init__(self, method: Method | str, config: Any, pairs: torch.Tensor | None = None,
                 kv_norms: torch.Tensor | None = None, folded: str | None = None):
        self.method = parse_method(method)
        self.spec = model_spec(config, pairs, kv_norms, folded)
        self.method.bind(self.spec)
        text_config = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
        layers = [
            KVMixLayer(self.method, i) if kind in QUANTIZED_LAYER_TYPES
            else DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs)
            for i, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True))
        ]
        other = sorted({k for k in layer_types if k not in QUANTIZED_LAYER_TYPES})
        if other:
            warnings.warn(f"kvmix quantizes full-attention layers only; layers of kind {other} "
                          "keep their ordinary full-precision cache", stacklevel=2)
        clear_pending()
        super().__init__(layers=layers)

    @property
    def packed_layers(self) -> list[KVMixLayer]:
        return [layer for layer in self.layers if isinstance(layer, KVMixLayer)]

    def nbytes_breakdown(self) -> dict[str, int]:
        total = Counter()
        for layer in self.layers:
            if isinstance(layer, KVMixLayer):
                total += layer.nbytes_breakdown()
            elif getattr(layer, "keys", None) is not None:
                total += tensor_bytes([layer.keys, layer.values], "other_layers")
        return dict(total)

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds."""
        return sum(self.nbytes_breakdown().values())

    def theoretical_nbytes(self) -> float:
        """Bytes the method's bit formula predicts for the tokens held (packed layers only)."""
        return sum(layer.theoretical_nbytes(self.spec) for layer in self.packed_layers)

    def bits(self) -> tuple[float, float]:
        """Key and value bits per element of a stored block, averaged over packed layers."""
        bits = [self.method.bits(layer.layer_idx, layer.dtype) for layer in self.packed_layers
                if layer.is_initialized]
        if not bits:
            return 0.0, 0.0
        return sum(k for k, _ in bits) / len(bits), sum(v for _, v in bits) / len(bits)

    def fp16_nbytes(self) -> int:
        """Bytes the same tokens would take as 16-bit keys and values (the papers' baseline)."""
        return sum(
            2 * 2 * layer.get_seq_length() * self.spec.n_kv_heads * self.spec.head_dim
            * layer.store.res_keys.shape[0]
            for layer in self.packed_layers if layer.is_initialized
        )
