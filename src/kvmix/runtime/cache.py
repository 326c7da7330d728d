"""The packed KV cache (docs/design/cache-layout.md) as a transformers ``Cache``: one ``KVMixLayer``
per full-attention or sliding-window layer (the window's pages only), transformers' own layers for
the others (chunked attention, ...), and the cache-wide figures (bytes held, bytes by the bit
formula, bits per element)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    get_layer_types_and_kwargs,
)

from kvmix.core.memory import kind_bytes
from kvmix.methods import Method, ModelSpec, parse_method
from kvmix.runtime.accounting import segments
from kvmix.runtime.kernels import cpu, gpu, unserved
from kvmix.runtime.layer import KVMixLayer, clear_pending
from kvmix.runtime.pool import FREE
from kvmix.runtime.steps import Kind

QUANTIZED_LAYER_TYPES = ("full_attention", "sliding_attention")
FULL_PRECISION_KINDS = ("sink", "residual", "full", "other_layers")


def max_pages(method: Method, max_batch: int | None, max_tokens: int | None,
              window: int | None = None) -> int | None:
    """Pages a pool sized up front holds: every sequence's full groups at ``max_tokens`` (in a
    sliding-window layer at most the pages that meet the window, twice: a commit seals new
    pages before it releases old ones)."""
    if max_batch is None and max_tokens is None:
        return None
    if max_batch is None or max_tokens is None:
        raise ValueError(f"max_batch={max_batch} and max_tokens={max_tokens}: give both to size "
                         "the pool up front, or neither to let it grow")
    for name, value in (("max_batch", max_batch), ("max_tokens", max_tokens)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid; expected an integer >= 1")
    blocks = segments(method, max_tokens).blocks
    if window is not None:
        blocks = min(blocks, 2 * (-(-(window - 1) // method.group) + 1))
    return max_batch * blocks


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


class UnservedShape(ValueError):
    """A fused backend's kernels do not tile the method's group or head sizes (raised when the
    cache is made, never in a decode; ``auto`` falls back to the reference path)."""


class KVMixCache(Cache):
    """A transformers Cache whose attention layers (full and sliding-window) are packed by one
    kvmix method."""

    def __init__(self, method: Method | str, config: Any, pairs: torch.Tensor | None = None,
                 kv_norms: torch.Tensor | None = None, folded: str | None = None,
                 backend: str = "torch", max_batch: int | None = None,
                 max_tokens: int | None = None):
        """backend: "torch" (the reference path), "cpu" (the fused op) or "triton" (the GPU
        kernels); kvmix.make_cache resolves "auto". max_batch, max_tokens: a pool sized up
        front for that many sequences of that many real tokens (a larger batch, or pages
        beyond it, is refused before anything changes); by default the pool grows."""
        if backend not in ("torch", "cpu", "triton"):
            raise ValueError(f"backend={backend!r} is invalid here; valid: torch, cpu, triton "
                             "(kvmix.make_cache also takes auto)")
        for name, kernels in (("cpu", cpu), ("triton", gpu)):
            ok, cause = kernels.available() if backend == name else (True, "")
            if not ok:
                raise ValueError(f"backend={name!r} is unavailable: {cause}")
        self.backend = backend
        self.method = parse_method(method)
        self.spec = model_spec(config, pairs, kv_norms, folded)
        self.method.bind(self.spec)
        reason = unserved(backend, self.method, self.spec.head_dim)
        if reason:
            raise UnservedShape(f"backend={backend!r} cannot read {self.method.name}'s blocks: "
                                f"{reason} (use backend='torch' or 'auto')")
        max_pages(self.method, max_batch, max_tokens)  # both or neither, before any layer
        text_config = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
        kinds: dict[int | None, Kind] = {}  # per kind: its layers move in lockstep
        layers = [
            KVMixLayer(self.method, i, backend, max_batch,
                       max_pages(self.method, max_batch, max_tokens,
                                 kwargs.get("sliding_window")), kwargs.get("sliding_window"),
                       kinds.setdefault(kwargs.get("sliding_window"), Kind()))
            if kind in QUANTIZED_LAYER_TYPES
            else DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs)
            for i, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True))
        ]
        other = sorted({k for k in layer_types if k not in QUANTIZED_LAYER_TYPES})
        if other:
            warnings.warn(f"kvmix quantizes full-attention and sliding-window layers; layers of "
                          f"kind {other} keep their ordinary full-precision cache", stacklevel=2)
        clear_pending()
        super().__init__(layers=layers)

    @property
    def packed_layers(self) -> list[KVMixLayer]:
        return [layer for layer in self.layers if isinstance(layer, KVMixLayer)]

    @property
    def other_layers(self) -> list[CacheLayerMixin]:
        """Layers kvmix does not pack (chunked attention, ...) that hold tokens."""
        return [layer for layer in self.layers if not isinstance(layer, KVMixLayer)
                and getattr(layer, "keys", None) is not None]

    def nbytes_breakdown(self) -> dict[str, int]:
        """Bytes of the distinct storages the cache keeps alive, by kind: sink, residual, codes,
        scales, zeros, masks, full (blocks of ``full``), static (per-model tensors of the method
        and model spec), other_layers (layers kvmix does not pack), and free (float slots and
        pool pages held but not in use)."""
        tagged = [("static", t) for t in (*self.spec.tensors(), *self.method.static_tensors())]
        tagged += [("other_layers", t) for layer in self.other_layers
                   for t in vars(layer).values() if isinstance(t, torch.Tensor)]
        total = kind_bytes(tagged)
        for layer in self.packed_layers:
            total += layer.nbytes_breakdown()
        return dict(total)

    def check(self) -> None:
        """Raise if a decode step stored a non-finite value since the last check (decode steps
        validate on the device, without a host sync; prompts and chunks check at once)."""
        for layer in self.packed_layers:
            layer.check()

    def nbytes(self) -> int:
        """Bytes of every storage the cache keeps alive."""
        return sum(self.nbytes_breakdown().values())

    def held_nbytes(self) -> int:
        """Bytes the cache keeps for the tokens it holds: ``nbytes()`` less capacity reserved
        ahead (``free``: float slots no token fills yet, pool pages not in use)."""
        kinds = self.nbytes_breakdown()
        return sum(kinds.values()) - kinds.get(FREE, 0)

    def theoretical_nbytes(self) -> float:
        """Bytes the bit formulas predict: packed layers from the method's bits for the tokens
        each sequence holds (pages shared by beams once) plus the capacity held unused
        (``free``), static tensors from their shapes; plus what the layers kvmix does not pack
        hold (transformers' own: not a kvmix formula)."""
        packed = sum(layer.theoretical_nbytes(self.spec) for layer in self.packed_layers)
        static = self.spec.static_nbytes() + self.method.static_nbytes(self.spec)
        return packed + static + self.nbytes_breakdown().get("other_layers", 0)

    def bits(self) -> tuple[float, float]:
        """Key and value bits per element of a stored block, averaged over packed layers."""
        bits = [self.method.bits(layer.layer_idx, layer.dtype) for layer in self.packed_layers
                if layer.is_initialized]
        if not bits:
            return 0.0, 0.0
        return sum(k for k, _ in bits) / len(bits), sum(v for _, v in bits) / len(bits)

    def nbytes_16bit(self) -> int:
        """What the same cache holds in a 16-bit model (capacity reserved ahead aside): the
        full-precision kinds (sink, residual, full blocks, unpacked layers) priced at 16 bits,
        everything else as held."""
        layers = [layer for layer in self.packed_layers if layer.is_initialized]
        dtype = layers[0].dtype if layers else torch.float16
        widths = dict.fromkeys(FULL_PRECISION_KINDS, dtype.itemsize)
        widths["sink"] = widths["residual"] = self.method.slot_dtype(dtype).itemsize
        return round(sum(held * (2 / widths[kind] if kind in widths else 1)
                         for kind, held in self.nbytes_breakdown().items() if kind != FREE))

    def fp16_nbytes(self) -> int:
        """Bytes the same tokens of every layer would take as 16-bit keys and values."""
        per_token = 2 * 2 * self.spec.n_kv_heads * self.spec.head_dim
        packed = sum(layer.real_tokens() for layer in self.packed_layers)
        other = sum(layer.keys.shape[0] * layer.keys.shape[-2] for layer in self.other_layers)
        return per_token * (packed + other)
