"""transformers' own caches, the ones users would pick instead of kvmix: ``DynamicCache``
(float, grows by concatenation) and ``QuantizedCache`` (KIVI-like, re-quantizes its whole
history at every flush) with the quanto or HQQ backend."""

from __future__ import annotations

from typing import Any

BASELINES = ("dynamic", "quanto2", "quanto4", "hqq2", "hqq4")


def transformers_cache(name: str, model: Any):
    """A fresh transformers cache by name; the model keeps kvmix's attention function, which is
    plain SDPA for any cache that is not kvmix's."""
    from transformers import DynamicCache, QuantizedCache

    if name not in BASELINES:
        raise ValueError(f"baseline={name!r} is unknown; valid: {', '.join(BASELINES)}")
    if name == "dynamic":
        return DynamicCache(config=model.config)
    return QuantizedCache(backend=name[:-1], config=model.config, nbits=int(name[-1]))
