"""One matrix runs every registered method (and preset) through the same cache contract."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import METHODS, SINK, B, D, attend, expected_layout, feed, make, tokens

from kvmix.core.memory import reachable_bytes
from kvmix.core.tree import map_tensors, tagged_tensors
from kvmix.runtime.layer import take_pending
from kvmix.runtime.store import stored


def rows(cache):
    return cache.layers[0].rows


def history(cache):
    return cache.layers[0].history()


def assert_memory_is_honest(cache) -> None:
    """What the cache reports is every storage reachable from it, and what the formula says."""
    assert cache.nbytes() == reachable_bytes(cache)
    assert cache.nbytes() == pytest.approx(cache.theoretical_nbytes(), abs=0)


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("prompt", [2, SINK, SINK + 16 - 1, 45])
def test_flush_happens_at_the_right_token_counts(name, prompt):
    cache = make(name)
    feed(cache, prompt)
    for step in range(30):
        total = prompt + step
        for row in rows(cache):
            assert (row.sink_keys.shape[-2], len(row.lengths), row.res_keys.shape[-2]) == (
                expected_layout(total))
        assert cache.get_seq_length() == total
        assert cache.get_mask_sizes(1, 0) == (total + 1, 0)
        feed(cache, 1, seed=step)


@pytest.mark.parametrize("name", METHODS)
def test_a_prompt_shorter_than_the_sink_is_never_quantized(name):
    cache = make(name, sink=8)
    keys, values, queries = tokens(B, 6, seed=1, dtype=torch.float32)
    cache.update(keys, values, 0)
    take_pending().attend(cache.method.transform_queries(queries, 0), None, D**-0.5)
    assert all(row.blocks is None and not row.lengths for row in rows(cache))
    # kept exactly, at the slot dtype: float16 for a quantizing method of a float32 model
    assert rows(cache)[0].sink_keys.dtype == cache.method.slot_dtype(torch.float32)
    exact = stored(cache.method.transform_keys(keys, 0), cache.method)
    assert torch.equal(history(cache)[0], exact)
    assert torch.equal(history(cache)[1], stored(values, cache.method))


@pytest.mark.parametrize("name", METHODS)
def test_blocks_are_append_only(name, monkeypatch):
    cache = make(name)
    encoded = []
    real_encode = cache.method.encode
    monkeypatch.setattr(cache.method, "encode",
                        lambda *a, **k: encoded.append(a[0].shape[0]) or real_encode(*a, **k))
    feed(cache, 40)
    n = len(rows(cache)[0].lengths)
    before = copy.deepcopy(rows(cache)[0].blocks)
    keys, values = rows(cache)[0].decode_blocks(torch.float16)
    for step in range(40):
        feed(cache, 1, seed=100 + step)
    blocks = len(rows(cache)[0].lengths)
    assert blocks > n
    assert sum(encoded) == B * blocks  # every block encoded once, no block ever again
    # the prompt's blocks of every row in one call, then one call per flush for the batch
    assert len(encoded) == (n > 0) + blocks - n
    after = map_tensors(rows(cache)[0].blocks, lambda t: t[:, :n])
    pairs = zip(_tensors(before), _tensors(after), strict=True)
    assert _tensors(before) and all(torch.equal(a, b) for a, b in pairs)
    k, v = rows(cache)[0].decode_blocks(torch.float16)
    held = keys.shape[-2]
    assert torch.equal(k[..., :held, :], keys) and torch.equal(v[..., :held, :], values)


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("remove", [1, 5, 13, 30, 50])
def test_crop_keeps_the_prefix_on_every_segment(name, remove):
    cache = make(name)
    feed(cache, 50)
    keys, values = history(cache)
    cache.crop(-remove)
    assert cache.get_seq_length() == 50 - remove
    k, v = history(cache)
    kept = 50 - remove
    assert torch.equal(k, keys[..., :kept, :]) and torch.equal(v, values[..., :kept, :])
    assert_memory_is_honest(cache)
    feed(cache, 3)  # the cache keeps working after a crop
    assert cache.get_seq_length() == 53 - remove
    assert reachable_bytes(cache) == cache.nbytes()


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("op", ["reorder", "repeat", "select"])
def test_batch_ops_apply_to_every_segment(name, op):
    cache = make(name)
    feed(cache, 50)
    keys, values = history(cache)
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
    k, v = history(cache)
    assert torch.equal(k, expected[0]) and torch.equal(v, expected[1])
    assert_memory_is_honest(cache)  # a row used twice is a copy: every row owns its storage
    feed(cache, 2, batch=k.shape[0])
    assert_memory_is_honest(cache)


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("count", [3, 37, 64])
def test_nbytes_is_every_storage_held_and_what_the_formula_says(name, count):
    cache = make(name)
    feed(cache, count)
    assert_memory_is_honest(cache)
    held = sum(t.untyped_storage().nbytes() for layer in cache.layers for t in layer.tensors())
    static = cache.nbytes_breakdown().get("static", 0)
    assert cache.nbytes() == held + static  # no storage shared between kept tensors
    unused = sum(layer.pool.breakdown()["free"] + layer.store.breakdown()["free"]
                 for layer in cache.layers)  # capacity not in use is named, never hidden
    assert cache.nbytes_breakdown()["free"] == unused > 0
    assert static == reachable_bytes([cache.method, cache.spec])


@pytest.mark.parametrize("name", [m for m in METHODS if m.partition(":")[0] != "full"])
def test_bytes_shrink_and_something_is_really_quantized(name):
    cache = make(name)
    feed(cache, 64)
    row = rows(cache)[0]
    kinds = cache.nbytes_breakdown()
    assert cache.nbytes() - kinds.get("static", 0) < cache.fp16_nbytes()
    assert kinds.get("codes", 0) > 0 and "full" not in kinds
    codes = [t for t in _tensors(row.blocks) if t.dtype == torch.uint8]
    indices = sum(t.numel() for kind, t in tagged_tensors(row.blocks, "full") if kind == "masks")
    assert codes and B * sum(t.numel() for t in codes) == kinds["codes"] + B * indices
    keys = cache.method.transform_keys(tokens(B, 64, seed=0)[0], 0)  # what feed() stored
    exact = keys[:1, :, SINK : SINK + sum(row.lengths), :].float()
    decoded, _ = row.decode_blocks(torch.float16)
    error = (decoded.float() - exact).abs()
    assert 0 < error.mean() < exact.std()  # really quantized, still a reconstruction


def test_full_keeps_exact_blocks():
    cache = make("full")
    feed(cache, 64)
    assert cache.nbytes_breakdown()["full"] > 0
    kinds = cache.nbytes_breakdown()
    assert cache.nbytes() - kinds["static"] - kinds["free"] == cache.fp16_nbytes()


@pytest.mark.parametrize("name", ["kivi2", "full", "pnmix1"])
def test_no_view_pins_the_prompt(name):
    """A sink=0 method once kept the whole prompt alive behind empty views of it."""
    cache = make(name, sink=0)
    keys, values, queries = tokens(B, 300, seed=3, dtype=torch.float32)
    cache.update(keys, values, 0)
    take_pending().attend(queries, None, D**-0.5)
    prompt = {keys.untyped_storage().data_ptr(), values.untyped_storage().data_ptr()}
    held = {t.untyped_storage().data_ptr() for layer in cache.layers for t in layer.tensors()}
    assert not prompt & held
    assert reachable_bytes(cache) == cache.nbytes() < keys.nbytes + values.nbytes + 2**16


def _tensors(obj) -> list[torch.Tensor]:
    return [t for _, t in tagged_tensors(obj, "")]


@pytest.mark.parametrize("name", ["kivi2", "pnmix1", "wush"])
def test_fill_commits_what_attention_commits(name):
    """``KVMixLayer.fill`` (synthetic histories for the op benchmark) stores exactly what the
    update-and-attend path stores."""
    attended, filled = make(name), make(name)
    keys, values, queries = tokens(2, 45, seed=3, dtype=torch.float32)
    attended.update(keys, values, 0)
    attend(attended, queries)
    filled.layers[0].fill(keys, values, queries)
    assert filled.get_seq_length() == attended.get_seq_length() == 45
    for a, f in zip(attended.layers[0].rows, filled.layers[0].rows, strict=True):
        assert a.lengths == f.lengths and len(a.lengths) >= 2
        for part in ("sink_keys", "res_keys", "res_values"):
            assert torch.equal(getattr(a, part), getattr(f, part))
        for (_, x), (_, y) in zip(tagged_tensors(a.blocks, ""), tagged_tensors(f.blocks, ""),
                                  strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("name", ["kivi2", "pnmix1", "kxvy:key_bits=4,value_bits=2"])
def test_a_float32_model_keeps_its_sink_and_residual_at_16_bits(name):
    """``residual_dtype``: float16 by default, half the bytes of float32 slots, honest either
    way; the stored tokens are the model's rounded once to float16, and attention reads them
    as stored (a token's output is the same before and after it enters its slot)."""
    keys, values, queries = tokens(2, 45, seed=3, dtype=torch.float32)
    caches = {dtype: make(name, residual_dtype=dtype) for dtype in ("float16", "float32")}
    for cache in caches.values():
        cache.update(keys, values, 0)
        attend(cache, queries)
        assert_memory_is_honest(cache)
    half, full = (rows(caches[d])[0] for d in ("float16", "float32"))
    assert (half.res_keys.dtype, full.res_keys.dtype) == (torch.float16, torch.float32)
    assert torch.equal(half.res_values, full.res_values.half())
    assert half.lengths == full.lengths and half.res_keys.shape[-2] > 0
    kinds = {d: c.nbytes_breakdown() for d, c in caches.items()}
    for kind in ("sink", "residual"):
        assert 2 * kinds["float16"][kind] == kinds["float32"][kind] > 0
    assert caches["float16"].nbytes() < caches["float32"].nbytes()


def test_full_and_16_bit_models_keep_their_own_dtype():
    keys, values, queries = tokens(1, 20, seed=1, dtype=torch.float32)
    cache = make("full")
    cache.update(keys, values, 0)
    attend(cache, queries)
    assert torch.equal(history(cache)[0], keys)  # bit-exact: full never rounds
    method = make("kivi2", residual_dtype="float16").method
    assert method.slot_dtype(torch.bfloat16) == torch.bfloat16
    assert method.slot_dtype(torch.float32) == torch.float16
    assert make("kivi2", residual_dtype="bfloat16").method.slot_dtype(torch.float32) == \
        torch.bfloat16


def test_an_unknown_residual_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="residual_dtype='int8' is invalid; valid: float16"):
        make("kivi2", residual_dtype="int8")
