"""PN-Mix: selection, storage, bytes and ablations."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, tiny_llama
from helpers import attend, per_row
from transformers import LlamaConfig

import kvmix
from kvmix.core.importance import causal_pair_score, pair_norms, scores, spearman, top_overlap
from kvmix.core.packing import unpack
from kvmix.core.quantizers import dequantize, quantize
from kvmix.methods import ModelSpec, parse_method
from kvmix.runtime.cache import KVMixCache
from kvmix.runtime.store import stored as as_stored

H, HQ, D = TINY["num_key_value_heads"], TINY["num_attention_heads"], TINY["head_dim"]
PAIRS = torch.stack([torch.arange(D // 2), torch.arange(D // 2, D)], 1)
SMALL = "sink=4,residual=16,group=8"


def make(spec: str, layers: int = 2) -> KVMixCache:
    return KVMixCache(parse_method(spec), LlamaConfig(**{**TINY, "num_hidden_layers": layers}),
                      PAIRS)


def fill(cache: KVMixCache, keys, values, queries, valid=None, layer: int = 0) -> None:
    cache.update(keys, values, layer)
    attend(cache, queries, None if valid is None else valid[:, None, None, :])


def bits(row) -> torch.Tensor:
    return row.selection.bits


def decoded_keys(row) -> torch.Tensor:
    return row.decode_blocks(torch.float32)[0]


def gaussian(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def high_channels(cache, layer=0):
    return per_row(cache.layers[layer], lambda row: cache.method.high_index(row.selection))


def test_selection_follows_the_queries_when_keys_stay_the_same():
    keys, values = gaussian(1, H, 40, D), gaussian(1, H, 40, D, seed=1)
    chosen = []
    for boosted_pair in (0, 5):
        queries = gaussian(1, HQ, 40, D, seed=2) * 0.01
        queries[..., PAIRS[boosted_pair]] = 100.0  # one pair dominates the query side
        cache = make(f"pnmix:ratio=0.125,{SMALL}")
        fill(cache, keys, values, queries)
        chosen.append(set(high_channels(cache)[0, 0].tolist()))
    assert chosen[0] != chosen[1]
    assert set(PAIRS[0].tolist()) <= chosen[0] and set(PAIRS[5].tolist()) <= chosen[1]


def test_key_pair_norm_criterion_ignores_the_queries():
    keys, values = gaussian(1, H, 40, D), gaussian(1, H, 40, D, seed=1)
    chosen = []
    for seed in (2, 3):
        cache = make(f"pnmix:ratio=0.25,criterion=key_pair_norm,{SMALL}")
        fill(cache, keys, values, gaussian(1, HQ, 40, D, seed=seed) * seed**3)
        chosen.append(high_channels(cache))
    assert torch.equal(*chosen)


def test_gqa_importance_averages_the_query_heads_of_each_group():
    queries, keys = gaussian(2, HQ, 12, D).abs() + 0.1, gaussian(2, H, 12, D, seed=1)
    got = scores("qk_pair_norm", queries, keys, None, PAIRS)  # [2, H, P]
    g = HQ // H
    for head in range(H):
        q = pair_norms(queries[:, head * g : (head + 1) * g], PAIRS).mean(2).mean(1)
        expected = q * pair_norms(keys[:, head], PAIRS).mean(1)
        torch.testing.assert_close(got[:, head], expected)
    one_head = queries.clone()
    one_head[:, 1] = 0  # head 1 shares KV head 0 with head 0: the group mean must change
    assert not torch.allclose(scores("qk_pair_norm", one_head, keys, None, PAIRS)[:, 0], got[:, 0])
    torch.testing.assert_close(scores("qk_pair_norm", one_head, keys, None, PAIRS)[:, 1], got[:, 1])


def test_padding_stays_out_of_the_importance():
    queries, keys = gaussian(1, HQ, 10, D), gaussian(1, H, 10, D, seed=1)
    valid = torch.tensor([[False] * 3 + [True] * 7])
    padded = scores("qk_pair_norm", queries, keys, valid, PAIRS)
    unpadded = scores("qk_pair_norm", queries[:, :, 3:], keys[:, :, 3:], None, PAIRS)
    torch.testing.assert_close(padded, unpadded)


def test_the_mask_has_one_bit_per_sequence_layer_head_and_pair():
    batch, layers = 3, 2
    cache = make(f"pnmix1:{SMALL}", layers)
    for layer in range(layers):
        fill(cache, gaussian(batch, H, 30, D, seed=layer), gaussian(batch, H, 30, D),
             gaussian(batch, HQ, 30, D), layer=layer)
    assert cache.nbytes_breakdown()["masks"] * 8 == batch * layers * H * D // 2
    masks = [per_row(layer, bits) for layer in cache.layers]
    index = torch.tensor([2, 0, 0])
    cache.reorder_cache(index)
    for layer, mask in zip(cache.layers, masks, strict=True):
        assert torch.equal(per_row(layer, bits), mask[index])
    cache.batch_repeat_interleave(2)
    assert per_row(cache.layers[0], bits).shape[0] == 6
    cache.batch_select_indices(torch.tensor([1, 4]))
    assert torch.equal(per_row(cache.layers[0], bits), masks[0][[2, 0]])
    cache.crop(-5)
    assert torch.equal(per_row(cache.layers[0], bits), masks[0][[2, 0]])


@pytest.mark.parametrize("preset, high, group", [("pnmix1", 16, 128), ("pnmix2", 12, 64)])
def test_bytes_match_the_formula_for_both_presets(preset, high, group):
    cache = make(preset, layers=1)
    tokens = 32 + 128 + 2 * group
    fill(cache, gaussian(2, H, tokens, D), gaussian(2, H, tokens, D, seed=1),
         gaussian(2, HQ, tokens, D, seed=2))
    key_bits, value_bits = cache.method.bits(0, torch.float32)
    assert key_bits == pytest.approx(1 + high / D * 2 + 32 / group)
    if preset == "pnmix1":
        assert key_bits == pytest.approx(0.5 * 3 + 0.5 * 1 + 32 / 128)  # the paper's formula
    kinds = cache.nbytes_breakdown()
    blocks = len(cache.layers[0].rows[0].lengths)
    assert blocks == 3
    elements = 2 * H * blocks * group * D
    assert (kinds["codes"] + kinds["scales"] + kinds["zeros"]) * 8 == pytest.approx(
        elements * (key_bits + value_bits))
    assert kinds["masks"] * 8 == 2 * H * D // 2
    assert cache.nbytes() == cache.theoretical_nbytes()


def test_one_bit_correction_halves_the_error_of_one_bit_min_max():
    keys = gaussian(4, H, 128, D)
    errors = {}
    for correction in (True, False):
        cache = make(f"pnmix:ratio=0,one_bit_correction={correction},sink=0,residual=128,group=128")
        fill(cache, torch.cat([keys, keys[:, :, :1]], 2), torch.zeros(4, H, 129, D),
             gaussian(4, HQ, 129, D))
        decoded = per_row(cache.layers[0], decoded_keys)
        errors[correction] = (decoded - keys).pow(2).mean().item()
    assert errors[True] <= errors[False] / 2


def test_ratio_one_is_three_bit_per_channel_keys_exactly():
    keys = gaussian(2, H, 129, D) * 2 + 0.5
    layout = "sink=0,residual=128,group=128"
    decoded = {}
    for spec in (f"pnmix:ratio=1,high_bits=3,low_bits=1,{layout}",
                 f"kxvy:key_bits=3,{layout}"):
        cache = make(spec)
        fill(cache, keys, torch.zeros_like(keys), gaussian(2, HQ, 129, D))
        decoded[spec[:4]] = per_row(cache.layers[0], decoded_keys)
    assert torch.equal(decoded["pnmi"], decoded["kxvy"])


def test_high_channels_store_their_one_bit_code_in_the_top_bit():
    keys = gaussian(1, H, 17, D)
    cache = make("pnmix:ratio=0.5,sink=0,residual=16,group=8")
    fill(cache, keys, torch.zeros_like(keys), gaussian(1, HQ, 17, D))
    stored = cache.layers[0].rows[0].blocks.keys
    low = unpack(stored.low, 1, H * 8 * D, 8).view(1, 1, H, D, 8)[0, 0].transpose(-1, -2)
    one_bit = dequantize(quantize(keys[:, :, :8], 1, dim=-2, center=True))  # [1, H, 8, D]
    lower_half = one_bit < keys[:, :, :8].amin(-2, keepdim=True) + (
        keys[:, :, :8].amax(-2, keepdim=True) - keys[:, :, :8].amin(-2, keepdim=True)) / 2
    assert torch.equal(low.bool(), ~lower_half[0])


def test_sink_zero_quantizes_from_the_first_token():
    cache = make("pnmix:sink=0,residual=16,group=8")
    fill(cache, gaussian(1, H, 30, D), gaussian(1, H, 30, D), gaussian(1, HQ, 30, D))
    with_sink = make(f"pnmix:{SMALL}")
    fill(with_sink, gaussian(1, H, 30, D), gaussian(1, H, 30, D), gaussian(1, HQ, 30, D))
    bare, sunk = cache.layers[0].rows[0], with_sink.layers[0].rows[0]
    assert bare.sink_keys.shape[-2] == 0 and len(bare.lengths) == 2
    assert sunk.sink_keys.shape[-2] == 4 and len(sunk.lengths) == 2
    torch.testing.assert_close(sunk.history(torch.float32)[0][..., :4, :],
                               as_stored(gaussian(1, H, 30, D)[..., :4, :], with_sink.method),
                               rtol=0, atol=0)  # the sink: each token as its float slot keeps it


def test_online_selection_reselects_per_block_and_pays_for_its_indices():
    prefill = make(f"pnmix:{SMALL}")
    online = make(f"pnmix:selection=online,{SMALL}")
    keys, values = gaussian(1, H, 20, D), gaussian(1, H, 20, D, seed=1)
    for cache in (prefill, online):
        fill(cache, keys, values, gaussian(1, HQ, 20, D, seed=2))
    for step in range(24):  # decode queries that favour a different pair every step
        query = torch.zeros(1, HQ, 1, D)
        query[..., PAIRS[step % (D // 2)]] = 1000.0
        for cache in (prefill, online):
            fill(cache, gaussian(1, H, 1, D, seed=10 + step), gaussian(1, H, 1, D), query)
    index = online.layers[0].rows[0].blocks.keys.index  # [1, n, H, k]
    assert index is not None and prefill.layers[0].rows[0].blocks.keys.index is None
    assert not torch.equal(index[:, 0], index[:, -1])  # re-selected from accumulated statistics
    extra = online.nbytes_breakdown()["masks"] - prefill.nbytes_breakdown()["masks"]
    assert extra > index.numel()  # per-block indices plus running sums
    assert online.nbytes() == online.theoretical_nbytes()


def test_separable_score_agrees_with_the_causal_score_on_stationary_data():
    queries = gaussian(1, HQ, 64, D).abs() * torch.linspace(0.1, 3, D)
    keys = gaussian(1, H, 64, D) * torch.linspace(3, 0.1, D)
    separable = scores("qk_pair_norm", queries, keys, None, PAIRS)
    causal = causal_pair_score(queries, keys, PAIRS)
    assert (spearman(separable, causal) > 0.8).all()
    assert (top_overlap(separable, causal, 0.5) >= 0.75).all()
    assert spearman(separable, -causal).max() < 0


@pytest.mark.parametrize("bad, message", [
    ("pnmix:ratio=1.5", r"ratio=1.5 is invalid; expected a number in \[0, 1\]"),
    ("pnmix:high_bits=1", r"high_bits=1 is not supported"),
    ("pnmix:high_bits=2,low_bits=2", r"high_bits=2 must be greater than low_bits=2"),
    ("pnmix:group=48", r"group=48 must divide residual=128"),
    ("pnmix:criterion=qk", r"criterion='qk' is invalid; valid: qk_pair_norm"),
    ("pnmix:selection=online,criterion=key_range", r"selection='online' needs a pair criterion"),
])
def test_bad_pnmix_parameters(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_method(bad)


def test_models_without_pairs_or_with_odd_heads_are_refused():
    with pytest.raises(ValueError, match="RoPE layout could not be determined"):
        KVMixCache("pnmix1", LlamaConfig(**TINY))  # no pairs given
    with pytest.raises(ValueError, match="even head dim; the model's is 33"):
        parse_method("pnmix1").bind(ModelSpec(2, 4, 2, 33, None))


def test_pnmix_generates_on_the_tiny_model(tiny_model):
    ids = torch.randint(1, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    cache = kvmix.make_cache(tiny_model, f"pnmix1:{SMALL}")
    with torch.no_grad():
        out = tiny_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                                  min_new_tokens=20, do_sample=False, num_beams=2, cache=cache)
    assert out.shape == (2, 60)
    assert cache.nbytes() == cache.theoretical_nbytes()


def test_tiny_llama_pairs_are_found_by_make_cache():
    cache = kvmix.make_cache(tiny_llama(), "pnmix1")
    assert torch.equal(cache.spec.pairs, PAIRS)
