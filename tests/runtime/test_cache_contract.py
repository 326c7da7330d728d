"""One matrix runs every registered method (and preset) through the same cache contract."""

from __future__ import annotations

import copy
import dataclasses
import functools
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import TINY, tiny_llama
from transformers import LlamaConfig

from kvmix.core.transforms import TransformSet, save_transforms
from kvmix.core.tree import map_tensors, tensor_bytes
from kvmix.evaluation.calibration import collect_moments, compute_transforms
from kvmix.methods import method_names, parse_method
from kvmix.runtime.cache import KVMixCache, model_spec
from kvmix.runtime.layer import take_pending

SINK, RESIDUAL, GROUP = 4, 16, 8
B, H, HQ, D = 3, TINY["num_key_value_heads"], TINY["num_attention_heads"], TINY["head_dim"]
METHODS = [*(m for m in method_names() if m != "wush"), "wush", "wush:quantizer=percentile",
           "wush:transform=hadamard", "pnmix:selection=online", "pnmix:criterion=key_range",
           "kxvy:rotate=values", "kxvy:backend=hqq,key_bits=4,value_bits=1",
           "kxvy:backend=quanto,key_bits=2,value_bits=4"]
PAIRS = torch.stack([torch.arange(D // 2), torch.arange(D // 2, D)], 1)  # Llama's rotate_half


@functools.cache
def tiny_transforms() -> str:
    """A WUSH transforms file for the tiny Llama's shapes (2 layers, 2 KV heads, D 32)."""
    model = tiny_llama(seed=5)
    ids = torch.randint(1, 97, (1, 128), generator=torch.Generator().manual_seed(5))
    matrices = compute_transforms(model, collect_moments(model, ids, 64), 32, 0.01)
    meta = {"model": "", "layers": "2", "kv_heads": "2", "head_dim": "32", "block": "32",
            "damping": "0.01", "data": "random", "tokens": "128"}
    path = Path(tempfile.mkdtemp()) / "transforms.safetensors"
    save_transforms(path, TransformSet(matrices["keys"], matrices["values"], meta))
    return str(path)


def make(name: str, **layout) -> KVMixCache:
    layout = {"sink": SINK, "residual": RESIDUAL, "group": GROUP, **layout}
    wush = name.startswith("wush")
    if wush:
        overrides = name.partition(":")[2]
        name = f"wush:transforms={tiny_transforms()}" + (f",{overrides}" if overrides else "")
    spec = name + ("," if ":" in name else ":") + ",".join(f"{k}={v}" for k, v in layout.items())
    method = parse_method(spec)
    # values of wush / rotate=values come from a folded model; the layer contract needs none
    fold = method.value_fold(model_spec(LlamaConfig(**TINY)))
    return KVMixCache(method, LlamaConfig(**TINY), PAIRS, folded=fold[1] if fold else None)


def feed(cache: KVMixCache, tokens: int, seed: int = 0, dtype=torch.float16) -> None:
    """Drive layer 0 the way a model does: update, attend, commit."""
    g = torch.Generator().manual_seed(seed + cache.get_seq_length())
    keys = torch.randn(B, H, tokens, D, generator=g).to(dtype) * 3 + 1
    values = torch.randn(B, H, tokens, D, generator=g).to(dtype)
    queries = torch.randn(B, HQ, tokens, D, generator=g).to(dtype)
    cache.update(keys, values, 0)
    layer = take_pending()
    layer.commit(queries, None)


def layer0(cache):
    return cache.layers[0].store


def view(cache):
    return layer0(cache).materialize()


def expected_layout(total: int) -> tuple[int, int, int]:
    """(sink, blocks, residual) the flush rule gives after ``total`` tokens."""
    sink = min(total, SINK)
    rest = total - sink
    blocks = 0 if rest < RESIDUAL else (rest - RESIDUAL) // GROUP + 1
    return sink, blocks, rest - blocks * GROUP


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("prompt", [2, SINK, SINK + RESIDUAL - 1, 45])
def test_flush_happens_at_the_right_token_counts(name, prompt):
    cache = make(name)
    feed(cache, prompt)
    for step in range(30):
        layer = layer0(cache)
        total = prompt + step
        sink, blocks, residual = expected_layout(total)
        assert (layer.sink_keys.shape[-2], len(layer.lengths), layer.res_keys.shape[-2]) == (
            sink, blocks, residual)
        assert cache.get_seq_length() == total
        assert cache.get_mask_sizes(1, 0) == (total + 1, 0)
        feed(cache, 1, seed=step)


@pytest.mark.parametrize("name", METHODS)
def test_a_prompt_shorter_than_the_sink_is_never_quantized(name):
    cache = make(name, sink=8)
    cache.update(torch.randn(B, H, 6, D), torch.randn(B, H, 6, D), 0)
    keys_in = layer0(cache).res_keys.clone()
    take_pending().commit(torch.randn(B, HQ, 6, D), None)
    assert layer0(cache).blocks is None and not layer0(cache).lengths
    assert torch.equal(view(cache)[0], keys_in)


@pytest.mark.parametrize("name", METHODS)
def test_blocks_are_append_only(name):
    cache = make(name)
    feed(cache, 40)
    n = len(layer0(cache).lengths)
    before = copy.deepcopy(layer0(cache).blocks)
    keys, values = layer0(cache).decode_blocks()
    for step in range(40):
        feed(cache, 1, seed=100 + step)
    assert len(layer0(cache).lengths) > n
    after = map_tensors(layer0(cache).blocks, lambda t: t[:, :n])
    pairs = zip(_tensors(before), _tensors(after), strict=True)
    assert _tensors(before) and all(torch.equal(a, b) for a, b in pairs)
    k, v = layer0(cache).decode_blocks()
    held = keys.shape[-2]
    assert torch.equal(k[..., :held, :], keys) and torch.equal(v[..., :held, :], values)


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("remove", [1, 5, 13, 30, 50])
def test_crop_keeps_the_prefix_on_every_segment(name, remove):
    cache = make(name)
    feed(cache, 50)
    keys, values = view(cache)
    cache.crop(-remove)
    assert cache.get_seq_length() == 50 - remove
    k, v = view(cache)
    kept = 50 - remove
    assert torch.equal(k, keys[..., :kept, :]) and torch.equal(v, values[..., :kept, :])
    feed(cache, 3)  # the cache keeps working after a crop
    assert cache.get_seq_length() == 53 - remove


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("op", ["reorder", "repeat", "select"])
def test_batch_ops_apply_to_every_segment(name, op):
    cache = make(name)
    feed(cache, 50)
    keys, values = view(cache)
    index = torch.tensor([2, 0, 0])
    if op == "reorder":
        cache.reorder_cache(index)
        expected = keys[index], values[index]
    elif op == "repeat":
        cache.batch_repeat_interleave(2)
        expected = keys.repeat_interleave(2, 0), values.repeat_interleave(2, 0)
    else:
        cache.batch_select_indices(torch.tensor([1]))
        expected = keys[[1]], values[[1]]
    k, v = view(cache)
    assert torch.equal(k, expected[0]) and torch.equal(v, expected[1])
    feed_batch = k.shape[0]
    assert all(t.shape[0] == feed_batch for t in _tensors(layer0(cache).blocks))


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("tokens", [3, 37, 64])
def test_nbytes_is_what_is_held_and_what_the_formula_says(name, tokens):
    cache = make(name)
    feed(cache, tokens)
    held = sum(t.numel() * t.element_size() for t in _tensors(vars(layer0(cache))))
    assert cache.nbytes() == held
    assert cache.nbytes() == pytest.approx(cache.theoretical_nbytes(), abs=0)
    assert sum(cache.nbytes_breakdown().values()) == held


@pytest.mark.parametrize("name", [m for m in METHODS if m.partition(":")[0] != "full"])
def test_bytes_shrink_and_something_is_really_quantized(name):
    cache = make(name)
    feed(cache, 64)
    layer = layer0(cache)
    assert cache.nbytes() < cache.fp16_nbytes()
    kinds = cache.nbytes_breakdown()
    assert kinds.get("codes", 0) > 0 and "full" not in kinds
    codes = [t for t in _tensors(layer.blocks) if t.dtype == torch.uint8]
    indices = tensor_bytes(layer.blocks, "full").get("masks", 0)  # online per-block indices
    assert codes and sum(t.numel() for t in codes) == kinds["codes"] + indices
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(B, H, 64, D, generator=g).half() * 3 + 1  # what feed() stored
    keys = cache.method.transform_keys(keys, 0)  # the cache's key space (rotations, WUSH)
    exact = keys[..., SINK : SINK + sum(layer.lengths), :].float()
    decoded, _ = layer.decode_blocks()
    error = (decoded.float() - exact).abs()
    assert 0 < error.mean() < exact.std()  # really quantized, still a reconstruction


def test_full_keeps_exact_blocks():
    cache = make("full")
    feed(cache, 64)
    assert cache.nbytes_breakdown()["full"] > 0
    assert cache.nbytes() == cache.fp16_nbytes()  # float16 input: the reference holds 16 bits


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor reachable from obj (independent of kvmix's own walker)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []
