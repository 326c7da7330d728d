"""Helpers the cache tests share: a cache on the tiny Llama's shapes for any method string, and
a driver that feeds one layer the way the model and the kvmix attention function do."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from conftest import TINY, tiny_llama
from transformers import LlamaConfig

from kvmix.core.transforms import TransformSet, save_transforms
from kvmix.core.tree import tagged_tensors
from kvmix.evaluation.calibration import collect_moments, compute_transforms
from kvmix.methods import method_classes, method_names, parse_method, presets
from kvmix.runtime.cache import KVMixCache, model_spec
from kvmix.runtime.layer import take_pending

SINK, RESIDUAL, GROUP = 4, 16, 8
B, H, HQ, D = 3, TINY["num_key_value_heads"], TINY["num_attention_heads"], TINY["head_dim"]
METHODS = [*(m for m in method_names() if m != "wush"), "wush", "wush:quantizer=percentile",
           "wush:transform=hadamard", "pnmix:selection=online", "pnmix:criterion=key_range",
           "kxvy:rotate=values", "kxvy:rotate=keys", "kxvy:backend=hqq,key_bits=4,value_bits=1",
           "kxvy:backend=quanto,key_bits=2,value_bits=4"]
def _class_of(name: str):
    base = name.partition(":")[0]
    return presets()[base][0] if base in presets() else method_classes()[base]


# methods with a fused path, as the registry declares it (less the configurations that fall back)
FAST = [m for m in METHODS if not m.startswith("pnmix:selection=online") and "backend=" not in m
        and not _class_of(m).fast_path.startswith("reference only")]
PAIRS = torch.stack([torch.arange(D // 2), torch.arange(D // 2, D)], 1)  # Llama's rotate_half


def tiny_transforms() -> str:
    """A WUSH transforms file for the tiny Llama's shapes (2 layers, 2 KV heads, D 32)."""
    return transforms_for(tiny_llama(seed=5))


_TRANSFORMS: dict[str, str] = {}


def transforms_for(model) -> str:
    """A WUSH transforms file calibrated on ``model`` (one per model kind and shape)."""
    spec = model_spec(model.config)
    key = f"{model.config.model_type}:{spec.n_layers}:{spec.n_kv_heads}:{spec.head_dim}"
    if key not in _TRANSFORMS:
        _TRANSFORMS[key] = _calibrate(model)
    return _TRANSFORMS[key]


def _calibrate(model) -> str:
    spec = model_spec(model.config)
    ids = torch.randint(1, 97, (1, 128), generator=torch.Generator().manual_seed(5))
    matrices = compute_transforms(model, collect_moments(model, ids, 64), spec.head_dim, 0.01)
    meta = {"model": spec.name, "layers": str(spec.n_layers), "kv_heads": str(spec.n_kv_heads),
            "head_dim": str(spec.head_dim), "block": str(spec.head_dim), "damping": "0.01",
            "data": "random", "tokens": "128"}
    path = Path(tempfile.mkdtemp()) / "transforms.safetensors"
    save_transforms(path, TransformSet(matrices["keys"], matrices["values"], meta))
    return str(path)


def method_string(name: str, model=None, **layout) -> str:
    """``name`` with the small test layout (and, for wush, transforms for ``model`` or the tiny
    Llama) filled in."""
    layout = {"sink": SINK, "residual": RESIDUAL, "group": GROUP, **layout}
    if name.startswith("wush"):
        overrides = name.partition(":")[2]
        path = transforms_for(model) if model is not None else tiny_transforms()
        name = f"wush:transforms={path}" + (f",{overrides}" if overrides else "")
    return name + ("," if ":" in name else ":") + ",".join(f"{k}={v}" for k, v in layout.items())


def make(name: str, backend: str = "torch", max_batch: int | None = None,
         max_tokens: int | None = None, window: int | None = None, **layout) -> KVMixCache:
    """A cache on the tiny Llama's shapes; ``window``: every layer a sliding-window layer."""
    method = parse_method(method_string(name, **layout))
    sliding = {} if window is None else {"sliding_window": window, "layer_types": [
        "sliding_attention"] * TINY["num_hidden_layers"]}
    config = LlamaConfig(**TINY, **sliding)
    # values of wush / rotate=values come from a folded model; the layer contract needs none
    fold = method.value_fold(model_spec(config))
    return KVMixCache(method, config, PAIRS, folded=fold[1] if fold else None,
                      backend=backend, max_batch=max_batch, max_tokens=max_tokens)


def tokens(batch: int, count: int, seed: int, dtype=torch.float16, device="cpu"):
    """Random keys, values [batch, H, count, D] and queries [batch, HQ, count, D]."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, H, count, D, generator=g).to(dtype) * 3 + 1
    values = torch.randn(batch, H, count, D, generator=g).to(dtype)
    queries = torch.randn(batch, HQ, count, D, generator=g).to(dtype)
    return keys.to(device), values.to(device), queries.to(device)


def feed(cache: KVMixCache, count: int, seed: int = 0, batch: int = B,
         device="cpu") -> torch.Tensor:
    """Drive layer 0 as a model does: update, then the attention hook's attend (which commits).
    Returns the attention output [batch, HQ, count, D]."""
    keys, values, queries = tokens(batch, count, seed + cache.get_seq_length(), device=device)
    cache.update(keys, values, 0)
    layer = take_pending()
    queries = cache.method.transform_queries(queries, 0)
    return layer.attend(queries, None, D**-0.5)


def expected_layout(total: int) -> tuple[int, int, int]:
    """(sink, blocks, residual) the flush rule gives after ``total`` tokens."""
    sink = min(total, SINK)
    rest = total - sink
    blocks = 0 if rest < RESIDUAL else (rest - RESIDUAL) // GROUP + 1
    return sink, blocks, rest - blocks * GROUP


def attend(cache: KVMixCache, queries: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """The hook's side of one attention call after ``cache.update``: queries into the cache's
    key space, attend, commit. mask: [B, 1, q, T] bool or None."""
    layer = take_pending()
    layer.attend(cache.method.transform_queries(queries, layer.layer_idx), mask, D**-0.5)


INTEGER_TOLERANCE = 2e-3  # of the largest output: the integer path's 16-bit weights (2-8e-4 a
# step at production shapes, 1.3e-3 the largest over 66 steps; README, "cpu")


def op_tolerance(method, fused=None) -> float:
    """What a fused op is held to against the reference (the largest error over the largest
    output): float32 reassociation for float kernels and float pages; the stated tolerance of
    the CPU op's integer path for packed codes."""
    from kvmix.runtime.kernels import cpu

    packed = method.name != "full"
    return INTEGER_TOLERANCE if (fused in (None, cpu) and packed and cpu.integer()) else 1e-5


def assert_near(fast: torch.Tensor, exact: torch.Tensor, tolerance: float) -> float:
    """The largest error over the largest magnitude, asserted within ``tolerance``."""
    error = ((fast - exact).abs().max() / exact.abs().max().clamp_min(1e-30)).item()
    assert error <= tolerance, f"off the reference by {error:.2e} (tolerance {tolerance:.0e})"
    return error


def per_row(layer, fn) -> torch.Tensor:
    """``fn(row)`` for every sequence of a layer, concatenated along the batch."""
    return torch.cat([fn(row) for row in layer.rows])


def compare_rows(cache, count: int, seed: int, batch: int, mask=None, fused=None,
                 tolerance: float | None = None, device="cpu") -> float:
    """Stage ``count`` tokens and compare a fused op (``fused``: a kernels module, the CPU op by
    default) with the reference on every row before the layer attends (and commits), within
    ``tolerance`` (the op's, by default); returns the worst relative error."""
    from kvmix.runtime.kernels import cpu, reference

    fused = fused or cpu
    keys, values, queries = tokens(batch, count, seed, dtype=torch.float32, device=device)
    mask = None if mask is None else mask.to(device)
    cache.update(keys, values, 0)
    layer = take_pending()
    queries = cache.method.transform_queries(queries, 0)
    staged_keys, staged_values = layer.pending
    worst = 0.0
    if mask is not None:
        layer._read_pads(mask)
    for b, row in enumerate(layer.rows):
        new = min(count, layer.length - layer.pads[b])
        if new <= 0 or not len(row):
            continue
        q = queries[b : b + 1, :, -new:]
        k, v = staged_keys[b : b + 1, :, -new:], staged_values[b : b + 1, :, -new:]
        view = None if row.blocks is None else cache.method.kernel_view(row.blocks, 0,
                                                                         row.selection)
        assert view is not None or row.blocks is None, "a method in FAST has no view"
        fast = fused.attend(row, view, q, k, v, D**-0.5)
        exact = reference.attend(row, q, k, v, D**-0.5)
        limit = tolerance or op_tolerance(cache.method, fused)
        worst = max(worst, assert_near(fast, exact, limit))
    layer.attend(queries, mask, D**-0.5)
    return worst


def padded_prompts(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and attention mask [B, T] of prompts, each row right-aligned after zeros."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row):], mask[b, width - len(row):] = row, 1
    return ids, mask


def left_padded(lengths: list[int]) -> torch.Tensor:
    """[B, 1, T, T] bool mask of left-padded rows holding ``lengths`` real tokens."""
    total = max(lengths)
    valid = torch.stack([torch.arange(total) >= total - n for n in lengths])  # [B, T]
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    return valid[:, None, None, :] & causal


def prefill(cache, lengths: list[int], seed: int = 0, device="cpu") -> None:
    """A left-padded prompt of ``lengths`` real tokens per row into layer 0."""
    keys, values, queries = tokens(len(lengths), max(lengths), seed, dtype=torch.float32,
                                   device=device)
    cache.update(keys, values, 0)
    layer = take_pending()
    layer.attend(cache.method.transform_queries(queries, 0), left_padded(lengths).to(device),
                 D**-0.5)


def step(cache, batch: int, seed: int, staged=None, device="cpu") -> torch.Tensor:
    """One decode step of layer 0 (one new token per row) -> its output [B, HQ, 1, D]."""
    keys, values, queries = staged or tokens(batch, 1, seed, dtype=torch.float32, device=device)
    cache.update(keys, values, 0)
    layer = take_pending()
    return layer.attend(cache.method.transform_queries(queries, 0), None, D**-0.5)


def compare_batched(name: str, backend: str, steps: int, device="cpu",
                    lengths: tuple[int, ...] = (46, 15, 31), window: int | None = None) -> None:
    """Rows of different lengths (left padding): each decode step's output from the backend's
    one batched call equals the reference path's, and both caches seal the same pages bit for
    bit (``window``: sliding-window layers, the window's edge inside the pages)."""
    from kvmix.runtime.kernels import cpu, gpu

    fast, exact = (make(name, backend=b, window=window) for b in (backend, "torch"))
    for cache in (fast, exact):
        prefill(cache, list(lengths), device=device)
    kernels = {"cpu": cpu, "triton": gpu}[backend]
    real, used = kernels.attend_batch, []
    kernels.attend_batch = lambda *a, **k: used.append(1) or real(*a, **k)
    tolerance = op_tolerance(fast.method, kernels)
    try:
        for i in range(steps):
            staged = tokens(len(lengths), 1, 100 + i, dtype=torch.float32, device=device)
            assert_near(step(fast, 0, 0, staged), step(exact, 0, 0, staged), tolerance)
    finally:
        kernels.attend_batch = real
    assert len(used) == steps  # every step was one batched call
    for a, b in zip(fast.layers[0].rows, exact.layers[0].rows, strict=True):
        assert a.lengths == b.lengths and a.seen == b.seen and (a.lengths or window)
        pairs = zip(tagged_tensors(a.blocks, ""), tagged_tensors(b.blocks, ""), strict=True)
        assert all(torch.equal(x, y) for (_, x), (_, y) in pairs)


# ---- production shapes: an 8B-like layer (32 query heads over 8 KV heads of dimension 128) ----

PROD_HQ, PROD_H, PROD_D = 32, 8, 128
PRODUCTION_METHODS = [
    "kivi2",                                               # 2-bit keys in groups of 32
    "kxvy:key_bits=1,value_bits=8,group=64,value_group=64",
    "kxvy:key_bits=3,value_bits=3,group=128,value_group=128",
    "kxvy:key_bits=4,value_bits=1,group=64,value_group=16",
    "kxvy:key_bits=8,value_bits=4,group=32,value_group=32",
    "pnmix1", "kitty", "chanmix",                          # mixed-precision planes
]


def production_cache(method: str, backend: str, heads: tuple[int, int] = (PROD_HQ, PROD_H)
                     ) -> KVMixCache:
    from kvmix.models.loading import attention_config

    pairs = torch.stack([torch.arange(PROD_D // 2), torch.arange(PROD_D // 2, PROD_D)], 1)
    return KVMixCache(parse_method(method), attention_config(*heads, PROD_D), pairs,
                      backend=backend)


def production_tokens(batch: int, count: int, seed: int, heads: tuple[int, int] = (PROD_HQ, PROD_H)
                      ) -> tuple[torch.Tensor, ...]:
    """Keys with outlier channels (as real keys have), values, queries: [batch, heads, count, D]
    (``heads``: query heads, KV heads)."""
    query_heads, kv_heads = heads
    g = torch.Generator().manual_seed(seed)
    outliers = 1 + 9 * (torch.rand(PROD_D, generator=g) > 0.9)
    keys = torch.randn(batch, kv_heads, count, PROD_D, generator=g) * outliers + 0.5
    values = torch.randn(batch, kv_heads, count, PROD_D, generator=g)
    return keys, values, torch.randn(batch, query_heads, count, PROD_D, generator=g)


def production_step(cache: KVMixCache, staged, mask=None) -> torch.Tensor:
    keys, values, queries = staged
    cache.update(keys, values, 0)
    layer = take_pending()
    return layer.attend(cache.method.transform_queries(queries, 0), mask, PROD_D**-0.5)


def compare_production(method: str, backend: str, tolerance: float,
                       lengths: tuple[int, ...] = (300, 40, 170), steps: int | None = None,
                       heads: tuple[int, int] = (PROD_HQ, PROD_H), device: str = "cpu") -> None:
    """A left-padded batch at production shapes (rows of ``lengths`` tokens: blocks, sink and
    residual, a row with no block yet), ``steps`` decode steps (by default across a block
    boundary), a crop inside a block and reordered beams halfway: each step's output from
    ``backend`` on ``device`` within ``tolerance`` of the reference path's on the CPU
    (``heads``: query and KV heads, of dimension ``PROD_D``)."""
    fast, exact = (production_cache(method, b, heads) for b in (backend, "torch"))
    places = ((fast, device), (exact, "cpu"))
    prompt = production_tokens(len(lengths), max(lengths), 0, heads)
    for cache, place in places:
        production_step(cache, [x.to(place) for x in prompt],
                        left_padded(list(lengths)).to(place))
    steps = steps or fast.method.group + 2
    for i in range(steps):
        staged = production_tokens(len(lengths), 1, 100 + i, heads)
        assert_near(production_step(fast, [x.to(device) for x in staged]).cpu(),
                    production_step(exact, staged), tolerance)
        if i == steps // 2:
            for cache, place in places:
                cache.crop(-5)
                cache.reorder_cache(torch.tensor([0, 0, len(lengths) - 1], device=place))
    assert fast.layers[0].rows[0].lengths  # packed blocks were read
