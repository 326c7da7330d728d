"""The ``kvmix`` attention function, registered in transformers' attention registry.

For a kvmix cache layer it transforms the queries into the cache's key space and lets the layer
attend each sequence over its own history (the torch reference path: sink, decoded blocks and
residual) and commit the new tokens. For any other layer or cache it is plain SDPA.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from kvmix.methods import Method, parse_method
from kvmix.models.rope import rope_pairs
from kvmix.models.weights import attention_modules, iter_kv_weights, squared_frobenius
from kvmix.runtime.cache import KVMixCache, UnservedShape
from kvmix.runtime.kernels import resolve
from kvmix.runtime.layer import KVMixLayer, take_pending

NAME = "kvmix"
FOLDED = "_kvmix_folded"  # set on the folded copies runtime.folding makes, never on yours
# Called as fn(layer_idx, query, key, value, scaling) on every kvmix attention call (for analysis):
# the post-RoPE queries and, for a kvmix layer, the new tokens' keys and values.
Observer = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], None]
_OBSERVERS: list[Observer] = []


def kvmix_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    # query: [B, Hq, q, D]; key, value: [B, Hkv, q or T, D]; attention_mask: [B, 1, q, T] or None
    layer = take_pending()
    if layer is not None:
        query = layer.method.transform_queries(query, layer.layer_idx)
    scaling = kwargs.get("scaling") or module.scaling
    for observe in _OBSERVERS:
        observe(module.layer_idx, query, key, value, scaling)
    if layer is None:
        if isinstance(attention_mask, RowMask):
            attention_mask = attention_mask.full()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    check_window(layer, kwargs.get("sliding_window"))
    if isinstance(attention_mask, RowMask):
        attention_mask = attention_mask.last_row()  # [B, 1, 1, T]: all a kvmix layer reads
    out = layer.attend(query, attention_mask, scaling)  # [B, Hq, q, D]
    return out.transpose(1, 2).contiguous(), None


def check_window(layer: KVMixLayer, window: int | None) -> None:
    """Refuse an attention call whose sliding window is not the one its cache layer keeps."""
    if window is not None and window != layer.sliding_window:
        raise ValueError(f"layer {layer.layer_idx} attends over a sliding window of {window} "
                         f"tokens but its cache layer is built for sliding_window="
                         f"{layer.sliding_window} (the config's layer_types and sliding_window "
                         "disagree with the model's attention)")


class RowMask:
    """The ``kvmix`` mask function's answer for a chunk of queries: the arguments of
    transformers' SDPA mask instead of the mask. A kvmix layer reads only each row's padding:
    the last query row of the causal mask, [B, 1, 1, T] (a sliding window is the layer's own);
    a layer kvmix does not serve gets the full [B, 1, q, T] mask, built when first asked (for a
    padded prefill of 8 × 32K tokens that is 8.6 GB, which a model whose layers are all
    kvmix's never builds)."""

    def __init__(self, arguments: dict[str, Any]):
        self.arguments = arguments
        self._rows: dict[str, torch.Tensor | None] = {}

    def last_row(self) -> torch.Tensor | None:
        if "last" not in self._rows:
            q = self.arguments["q_length"]
            offset = self.arguments.get("q_offset", 0) + q - 1
            padding = {**self.arguments, "q_length": 1, "q_offset": offset, "local_size": None,
                       "mask_function": causal_mask_function}
            self._rows["last"] = sdpa_mask(**padding)
        return self._rows["last"]

    def full(self) -> torch.Tensor | None:
        if "full" not in self._rows:
            self._rows["full"] = sdpa_mask(**self.arguments)
        return self._rows["full"]


def kvmix_mask(*args, **kwargs) -> torch.Tensor | RowMask | None:
    """transformers' SDPA mask for a decode step (one row already); a ``RowMask`` otherwise."""
    if args or kwargs.get("q_length", 1) == 1:
        return sdpa_mask(*args, **kwargs)
    return RowMask(kwargs)


def register() -> None:
    AttentionInterface.register(NAME, kvmix_attention)
    AttentionMaskInterface.register(NAME, kvmix_mask)


def use_kvmix_attention(model: Any) -> None:
    """Route the model's attention through kvmix; refuse models that cannot be routed."""
    register()
    if getattr(model.config, "_attn_implementation", None) == NAME:
        return
    can_set = getattr(model, "_can_set_attn_implementation", lambda: False)
    if not can_set():
        raise ValueError(
            f"{type(model).__name__} does not dispatch attention through transformers' "
            "AttentionInterface, so kvmix cannot see its queries or serve its cache"
        )
    model.set_attn_implementation(NAME)


def make_cache(model: Any, method: str | Method = "kivi2", backend: str = "auto",
               max_batch: int | None = None, max_tokens: int | None = None) -> KVMixCache:
    """A packed cache for ``model``: ``model.generate(..., cache=make_cache(model, "kivi2"))``.

    Sets the model's attention implementation to ``kvmix`` (for any other cache it behaves
    exactly as SDPA). backend: "auto" (the fused CPU op where it runs, else the reference),
    "torch" (the reference path: decode blocks, then SDPA) or "cpu" (the fused op, or an error).
    max_batch, max_tokens: size each layer's page pool up front for that many sequences of that
    many real tokens (beyond it: a clear error, nothing cached lost); by default it grows.
    """
    cache = build_cache(model, method, backend, max_batch, max_tokens)
    use_kvmix_attention(model)
    return cache


def build_cache(model: Any, method: str | Method = "kivi2", backend: str = "auto",
                max_batch: int | None = None, max_tokens: int | None = None) -> KVMixCache:
    """``make_cache`` without routing the model's attention (continuous batching routes it to
    its own attention function)."""
    method = parse_method(method)  # a bad method string fails before the op is built
    refuse_unsupported(model)
    pairs, norms = model_facts(model)
    facts = (method, model.config, pairs, norms, getattr(model, FOLDED, None))
    resolved = resolve(backend, model.device)
    try:
        return KVMixCache(*facts, resolved, max_batch, max_tokens)
    except UnservedShape as cause:
        if backend != "auto":
            raise
        warnings.warn(f"kvmix: {cause}; using the reference path", stacklevel=3)
        return KVMixCache(*facts, "torch", max_batch, max_tokens)


def refuse_unsupported(model: Any) -> None:
    """Refuse, before anything runs, a model whose attention computes what kvmix's does not:
    logit soft-capping (Gemma-2) and learned attention sinks (gpt-oss) — never ignored."""
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        raise ValueError(f"{type(model).__name__} caps attention logits "
                         f"(attn_logit_softcapping={softcap}); kvmix's attention does not apply "
                         "soft-capping, so its cache is refused rather than silently wrong")
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} has learned attention sinks (a per-head logit "
                         "added to every softmax); kvmix's attention does not add them, so its "
                         "cache is refused rather than silently wrong")


@contextmanager
def observe_attention(model: Any, observer: Observer) -> Iterator[None]:
    """Within the block, hand every attention call's post-RoPE query, keys and values to
    ``observer`` (analysis only: criteria, pair scores, attention KL)."""
    use_kvmix_attention(model)
    _OBSERVERS.append(observer)
    try:
        yield
    finally:
        _OBSERVERS.remove(observer)


def model_facts(model: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The model's RoPE pairs and K/V weight norms, computed once per model and reused by every
    ``make_cache`` (again only when a projection weight changed in place, e.g. by folding)."""
    versions = _weight_versions(model)
    cached = _FACTS.get(model)
    if cached is None or cached[0] != versions:
        cached = (versions, rope_pairs(model), _kv_norms(model))
        _FACTS[model] = cached
    return cached[1], cached[2]


_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weight_versions(model: Any) -> tuple[int, ...]:
    """The in-place version counters of the attention projections' weights."""
    try:
        modules = attention_modules(model)
    except ValueError:
        return ()
    return tuple(p._version for m in modules for p in m.parameters(recurse=True))


def _kv_norms(model: Any) -> torch.Tensor | None:
    """Squared Frobenius norms of W_K, W_V per layer (one layer's float32 copy at a time), or
    None where they cannot be read."""
    try:
        return squared_frobenius(iter_kv_weights(model))
    except ValueError:
        return None
