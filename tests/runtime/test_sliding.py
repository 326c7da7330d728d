"""Sliding-window layers packed (Mistral, Gemma-3, Qwen2 with sliding layers): each query sees
itself and the W - 1 tokens before it, as transformers' sliding layers; pages the window has
passed are released (groups that leave it at once are never encoded); the fused CPU op and the
reference path mask the window's edge inside the first page, the sink and the residual."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers import FAST, D, compare_batched, left_padded, make
from transformers import DynamicCache

import kvmix
from kvmix.runtime.kernels import cpu
from kvmix.runtime.layer import take_pending

WINDOWS = [5, 11, 20]  # inside the sink + residual, shorter than the residual, across pages


def drive(cache, keys, values, queries, mask=None):
    cache.update(keys, values, 0)
    layer = take_pending()
    return layer.attend(cache.method.transform_queries(queries, 0), mask, D**-0.5)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("window", WINDOWS)
def test_a_windowed_full_layer_is_sdpa_over_each_rows_last_window(backend, window):
    """Left-padded rows of 45, 9 and 30 tokens, then 25 decode steps: every output equals SDPA
    over that row's own last ``window`` tokens."""
    if backend == "cpu" and not cpu.available()[0]:
        pytest.skip("the CPU op is not built")
    cache, lengths = make("full", backend=backend, window=window), [45, 9, 30]
    g = torch.Generator().manual_seed(0)
    width = max(lengths)
    keys, values = (torch.randn(3, 2, width, D, generator=g) for _ in range(2))
    queries = torch.randn(3, 4, width, D, generator=g)
    out = drive(cache, keys, values, queries, left_padded(lengths))
    rows = [(keys[b, :, width - n:], values[b, :, width - n:]) for b, n in enumerate(lengths)]
    for b, n in enumerate(lengths):
        visible = torch.ones(n, n, dtype=torch.bool).tril() & ~torch.ones(n, n, dtype=torch.bool
                                                                         ).tril(-window)
        expected = F.scaled_dot_product_attention(queries[b : b + 1, :, width - n:],
                                                  rows[b][0][None], rows[b][1][None],
                                                  attn_mask=visible, scale=D**-0.5,
                                                  enable_gqa=True)
        torch.testing.assert_close(out[b : b + 1, :, width - n:], expected, rtol=1e-5,
                                   atol=1e-5)
    for _ in range(25):
        k, v = torch.randn(3, 2, 1, D, generator=g), torch.randn(3, 2, 1, D, generator=g)
        q = torch.randn(3, 4, 1, D, generator=g)
        out = drive(cache, k, v, q)
        rows = [(torch.cat([rk, k[b]], 1), torch.cat([rv, v[b]], 1))
                for b, (rk, rv) in enumerate(rows)]
        for b, (rk, rv) in enumerate(rows):
            expected = F.scaled_dot_product_attention(q[b : b + 1], rk[None, :, -window:],
                                                      rv[None, :, -window:], scale=D**-0.5,
                                                      enable_gqa=True)
            torch.testing.assert_close(out[b : b + 1], expected, rtol=1e-5, atol=1e-5)
    store = cache.layers[0].store
    assert all(len(store.row(b)) < row[0].shape[1] for b, row in enumerate(rows))


@pytest.mark.skipif(not cpu.available()[0], reason="the CPU op is not built")
@pytest.mark.parametrize("window", [11, 20])
@pytest.mark.parametrize("name", [m for m in FAST if m in ("kivi2", "pnmix1", "wush", "full",
                                                          "chanmix", "kitty", "ggml-k8v4")])
def test_one_batched_call_masks_the_window_as_the_reference_does(name, window):
    compare_batched(name, "cpu", steps=30, window=window)


@pytest.mark.parametrize("name", ["kivi2", "pnmix1", "full"])
def test_pages_behind_the_window_return_to_the_pool(name):
    """200 decode steps over a window of 20: the pool stops growing (released pages are
    reused), each row holds at most the pages that meet the window, and every byte the cache
    keeps is what the bit formulas say."""
    cache = make(name, window=20)
    g = torch.Generator().manual_seed(1)
    drive(cache, *(torch.randn(2, h, 40, D, generator=g) for h in (2, 2, 4)))
    capacity = []
    for _ in range(200):
        drive(cache, *(torch.randn(2, h, 1, D, generator=g) for h in (2, 2, 4)))
        capacity.append(cache.layers[0].pool.capacity)
    store = cache.layers[0].store
    assert capacity[-1] == capacity[50] and capacity[-1] <= 2 * 4
    assert all(len(pages) <= 4 for pages in store.pages)  # ceil(19 / 8) + 1
    assert [store.seen(b) for b in range(2)] == [240, 240]
    assert cache.nbytes() == cache.theoretical_nbytes()


def test_a_long_prompt_encodes_only_the_groups_its_window_still_sees(monkeypatch):
    cache = make("kivi2", window=20)
    encoded = []
    real = cache.method.encode
    monkeypatch.setattr(cache.method, "encode",
                        lambda keys, *a: encoded.append(keys.shape[0]) or real(keys, *a))
    g = torch.Generator().manual_seed(2)
    drive(cache, *(torch.randn(1, h, 500, D, generator=g) for h in (2, 2, 4)))
    assert sum(encoded) <= 3 and cache.layers[0].pool.capacity <= 3
    assert cache.layers[0].store.seen(0) == 500


def test_crops_inside_the_window_work_and_beyond_it_are_refused():
    cache = make("kivi2", window=20)
    g = torch.Generator().manual_seed(3)
    drive(cache, *(torch.randn(1, h, 60, D, generator=g) for h in (2, 2, 4)))
    cache.crop(-4)
    assert cache.get_seq_length() == 56 and cache.layers[0].store.seen(0) == 56
    with pytest.raises(ValueError, match="cannot keep 20 tokens of a sliding-window layer"):
        cache.crop(-36)


def test_bad_windows_are_named():
    with pytest.raises(ValueError, match=r"sliding_window=0 is invalid; expected an integer >= 1"):
        kvmix.runtime.layer.KVMixLayer(make("kivi2").method, 0, sliding_window=0)


def test_beam_search_on_a_sliding_model_gives_dynamic_cache_tokens():
    """Beams share and reorder pages; a window releases them per beam: Mistral-style layers
    (window 8) with ``full`` give DynamicCache's beams."""
    config = transformers.MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=32, sliding_window=8)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    prompt = torch.randint(1, 97, (1, 13), generator=torch.Generator().manual_seed(4))
    beams = {"max_new_tokens": 12, "min_new_tokens": 12, "num_beams": 3, "do_sample": False}
    with torch.no_grad():
        expected = model.generate(prompt, cache=DynamicCache(config=config), **beams)
        cache = kvmix.make_cache(model, "full:sink=2,residual=8,group=4", backend="torch")
        got = model.generate(prompt, cache=cache, **beams)
    assert torch.equal(got, expected)
    assert all(layer.sliding_window == 8 for layer in cache.layers)
