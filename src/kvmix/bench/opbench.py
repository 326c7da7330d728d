"""The attention op alone on synthetic caches (``kvmix bench --shape``): one layer of a model's
attention shape (e.g. an 8B model's 32 query heads, 8 KV heads, head dim 128), its cache filled
with random keys and values of ``context`` tokens per sequence, then single-token decode steps
of that layer — the cache's ``update`` and attention, as a model calls them — timed beside:

* ``sdpa``: torch's ``scaled_dot_product_attention`` over float K/V of the same length in the
  model's dtype (what a float cache does each step);
* ``full``: kvmix's float cache on the same backend, i.e. the float variant of the same split-K
  kernels — the fair baseline for the packed ones.

``us_per_step`` is the median over ``rounds`` of the mean step time, rounds interleaved across
the candidates; ``gb_per_s`` is the bytes each step must read (the cache's ``nbytes()``, or the
float K/V for SDPA) over that time; ``encode_us`` is one flushed block's encode (keys and values
of one sequence and layer). Timings are measurements of this machine, never test verdicts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kvmix.bench.resources import memory_bandwidth, synchronize
from kvmix.core.quantizers import fused_encoding
from kvmix.models.loading import attention_config
from kvmix.runtime.cache import KVMixCache
from kvmix.runtime.layer import take_pending


@dataclass(frozen=True)
class Shape:
    """One layer's attention shape."""

    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        try:
            heads, kv_heads, head_dim = (int(part) for part in text.split(","))
        except ValueError:
            raise ValueError(f"shape={text!r} is invalid; expected HEADS,KV_HEADS,HEAD_DIM, "
                             "e.g. 32,8,128") from None
        if min(heads, kv_heads, head_dim) < 1 or heads % kv_heads or head_dim % 2:
            raise ValueError(f"shape={text!r} is invalid; expected positive heads divisible by "
                             "kv_heads and an even head dim")
        return cls(heads, kv_heads, head_dim)

    def config(self) -> Any:
        """A one-layer Llama config of this shape (RoPE pairs as Llama's rotate_half)."""
        return attention_config(self.heads, self.kv_heads, self.head_dim)

    def pairs(self) -> torch.Tensor:
        half = self.head_dim // 2
        return torch.stack([torch.arange(half), torch.arange(half, self.head_dim)], 1)


@dataclass
class Candidate:
    """One op under test: ``step`` runs a decode step; ``read_bytes`` what a step reads."""

    method: str
    backend: str
    step: Callable[[], None]
    read_bytes: int
    nbytes: int | None = None
    encode_us: float | None = None
    seconds: list[float] = field(default_factory=list)
    host_seconds: list[float] = field(default_factory=list)  # the calls alone, before a sync


def run(shape: Shape, methods: list[str], backend: str, contexts: list[int], batches: list[int],
        dtype: torch.dtype, device: torch.device, steps: int, rounds: int) -> list[dict]:
    """Rows per (context, batch): SDPA, then every method (``full`` first), side by side, each
    beside the time its bytes need at the device's measured copy bandwidth."""
    rows, bandwidth = [], memory_bandwidth(device=str(device))
    names = list(dict.fromkeys(["full", *methods]))
    for context in contexts:
        for batch in batches:
            generator = Tokens(shape, batch, dtype, device)
            candidates = [_sdpa(shape, context, batch, generator)]
            candidates += [_kvmix(shape, name, backend, context, batch, generator)
                           for name in names]
            for _ in range(rounds):
                for candidate in candidates:
                    host, total = _timed(candidate.step, steps, device)
                    candidate.seconds.append(total)
                    candidate.host_seconds.append(host)
            rows += _rows(candidates, context, batch, bandwidth)
            del candidates
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


class Tokens:
    """Random keys, values and queries of a shape (keys with a few outlier channels, as real
    keys have, so that channel selection has something to find)."""

    def __init__(self, shape: Shape, batch: int, dtype: torch.dtype, device: torch.device):
        self.shape, self.batch, self.dtype, self.device = shape, batch, dtype, device
        self.generator = torch.Generator(device).manual_seed(0)
        self.outliers = 1 + 4 * (torch.rand(shape.head_dim, generator=self.generator,
                                            device=device) > 0.9)

    def __call__(self, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, b = self.shape, self.batch
        def draw(heads):
            return torch.randn(b, heads, count, s.head_dim, generator=self.generator,
                               device=self.device)
        keys = (draw(s.kv_heads) * self.outliers).to(self.dtype)
        return keys, draw(s.kv_heads).to(self.dtype), draw(s.heads).to(self.dtype)


def _sdpa(shape: Shape, context: int, batch: int, tokens: Tokens) -> Candidate:
    chunks = [tokens(min(4096, context - start)) for start in range(0, context, 4096)]
    keys = torch.cat([c[0] for c in chunks], dim=2)  # [B, H, T, D]
    values = torch.cat([c[1] for c in chunks], dim=2)
    query = tokens(1)[2]  # [B, Hq, 1, D]

    def step() -> None:
        F.scaled_dot_product_attention(query, keys, values, enable_gqa=True)

    return Candidate("sdpa", "torch", step, keys.nbytes + values.nbytes)


def synthetic(shape: Shape, method: str, backend: str, context: int, tokens: Tokens,
              **sizes) -> tuple[KVMixCache, Callable[[], None]]:
    """A one-layer cache holding ``context`` random tokens per sequence (``sizes``: the
    cache's ``max_batch``/``max_tokens``), and its decode step (update and attention, as a
    model calls them)."""
    cache = KVMixCache(method, shape.config(), shape.pairs(), backend=backend, **sizes)
    layer = cache.layers[0]
    for start in range(0, context, 4096):  # in chunks: a float prompt of 128K is large
        layer.fill(*tokens(min(4096, context - start)))
    scaling = shape.head_dim ** -0.5

    def step() -> None:
        keys, values, queries = tokens(1)
        cache.update(keys, values, 0)
        take_pending().attend(cache.method.transform_queries(queries, 0), None, scaling)

    return cache, step


def _kvmix(shape: Shape, method: str, backend: str, context: int, batch: int,
           tokens: Tokens) -> Candidate:
    cache, step = synthetic(shape, method, backend, context, tokens)
    nbytes = cache.nbytes()
    return Candidate(method, backend, step, nbytes, nbytes, _encode_us(cache, tokens, backend))


def _encode_us(cache: KVMixCache, tokens: Tokens, backend: str) -> float:
    """Median time to encode one block (keys and values) of one sequence and layer."""
    method, row = cache.method, cache.layers[0].rows[0]
    keys, values, _ = tokens(method.group)
    keys, values = keys[:1], values[:1]  # [1, H, G, D]
    device = keys.device

    def encode() -> None:
        with fused_encoding(backend):
            method.encode(keys, values, 0, row.selection)

    return 1e6 * statistics.median(_timed(encode, 10, device)[1] for _ in range(5))


def _timed(fn: Callable[[], None], steps: int, device: torch.device) -> tuple[float, float]:
    """Seconds per call: (host, total). Host: the calls returned, before the device finished
    (the host work of a step where the device keeps up; on CPU the two are one)."""
    fn()  # warm: compiles and caches kernels
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    host = time.perf_counter() - start
    synchronize(device)
    return host / steps, (time.perf_counter() - start) / steps


def _rows(candidates: list[Candidate], context: int, batch: int,
          bandwidth: float) -> list[dict]:
    """``limit_us``: a step's bytes at ``bandwidth`` (bytes/s the memory moves in a copy, read
    and write together); ``of_limit``: the fraction of that limit the step reaches."""
    us = {c.method: 1e6 * statistics.median(c.seconds) for c in candidates}
    return [{"method": c.method, "backend": c.backend, "context": context, "batch": batch,
             "us_per_step": us[c.method],
             "host_us_per_step": 1e6 * statistics.median(c.host_seconds),
             "gb_per_s": c.read_bytes / us[c.method] / 1e3,
             "limit_us": 1e6 * c.read_bytes / bandwidth,
             "of_limit": 1e6 * c.read_bytes / bandwidth / us[c.method],
             "copy_gb_per_s": bandwidth / 1e9,
             "vs_sdpa": us["sdpa"] / us[c.method], "vs_float_kernel": us["full"] / us[c.method],
             "nbytes": c.nbytes, "encode_us": c.encode_us} for c in candidates]

