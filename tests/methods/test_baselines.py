"""Kitty, ChanMix, PolarQuant and the sweep's parameter mapping."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TINY
from helpers import attend, per_row
from transformers import LlamaConfig

import kvmix
from kvmix.commands.sweep import BUDGETS, method_at
from kvmix.methods import ModelSpec, parse_method
from kvmix.runtime.cache import KVMixCache

H, HQ, D = TINY["num_key_value_heads"], TINY["num_attention_heads"], TINY["head_dim"]
PAIRS = torch.stack([torch.arange(D // 2), torch.arange(D // 2, D)], 1)
SPEC64 = ModelSpec(30, 9, 3, 64, torch.stack([torch.arange(32), torch.arange(32, 64)], 1))


def gaussian(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def filled(spec: str, keys, queries, values=None) -> KVMixCache:
    cache = KVMixCache(parse_method(spec), LlamaConfig(**TINY), PAIRS)
    cache.update(keys, torch.zeros_like(keys) if values is None else values, 0)
    attend(cache, queries)
    return cache


def bound(spec: str, model_spec: ModelSpec = SPEC64):
    method = parse_method(spec)
    method.bind(model_spec)
    return method


@pytest.mark.parametrize("spec, key_bits", [
    ("kitty", 2 + 2 * 6 / 64 + 32 / 128),  # round(0.1·64) = 6 channels promoted to 4 bits
    ("chanmix", 2 + 32 / 128),
    ("polar", (4 + 4) / 2 + 32 / 128),
    ("polar:radius_bits=3,angle_bits=2,group=64", 2.5 + 32 / 64),
])
def test_bits_follow_each_formula(spec, key_bits):
    assert bound(spec).bits(0, torch.float32) == pytest.approx((key_bits, 2 + 32 / 32))


@pytest.mark.parametrize("spec", ["kitty", "chanmix", "polar"])
def test_bytes_held_match_the_formula_at_default_groups(spec):
    tokens = 32 + 128 + 2 * 128
    cache = filled(spec, gaussian(2, H, tokens, D), gaussian(2, HQ, tokens, D),
                   gaussian(2, H, tokens, D, seed=3))
    key_bits, value_bits = cache.method.bits(0, torch.float32)
    kinds = cache.nbytes_breakdown()
    elements = 2 * H * len(cache.layers[0].rows[0].lengths) * 128 * D
    assert (kinds["codes"] + kinds["scales"] + kinds["zeros"]) * 8 == pytest.approx(
        elements * (key_bits + value_bits))
    assert cache.nbytes() == cache.theoretical_nbytes()


def test_kitty_promotes_the_largest_magnitude_channels():
    keys = gaussian(2, H, 40, D) * 0.1
    loud = {0: [3, 17, 30], 1: [0, 9, 21]}
    for head, channels in loud.items():
        keys[:, head, :, channels] *= 100
    cache = filled("kitty:ratio=0.1,sink=4,residual=16,group=8", keys, gaussian(2, HQ, 40, D))
    promoted = per_row(cache.layers[0], lambda row: cache.method.high_index(row.selection))
    # promoted: [B, H, round(0.1·32)]
    for head, channels in loud.items():
        assert promoted[:, head].tolist() == [channels, channels]


def test_kitty_channels_ignore_queries_and_cost_a_d_bit_mask():
    keys = gaussian(1, H, 40, D)
    a = filled("kitty:sink=4,residual=16,group=8", keys, gaussian(1, HQ, 40, D))
    b = filled("kitty:sink=4,residual=16,group=8", keys, gaussian(1, HQ, 40, D, seed=9) * 50)
    assert torch.equal(a.layers[0].rows[0].selection.bits, b.layers[0].rows[0].selection.bits)
    assert a.nbytes_breakdown()["masks"] * 8 == H * D


def test_chanmix_classes_have_the_documented_fractions_and_criteria():
    method = bound("chanmix")
    assert method.counts(64) == (4, 8, 36, 16)
    assert sum(n * b for n, b in zip(method.counts(64), (4, 3, 2, 1), strict=True)) / 64 == 2
    keys = gaussian(1, 3, 50, 64) * 0.5 + 1.0
    queries = gaussian(1, 9, 50, 64)
    queries[:, :3, :, 5] = 40.0  # channel 5: the largest query-key contribution in KV head 0
    keys[:, 0, :, 7] = torch.linspace(-30, 30, 50)  # channel 7: the widest key range...
    queries[:, :3, :, 7] = 0.0  # ...and no query-key contribution
    keys[:, 0, :, 11] = 1e-3  # channel 11: the smallest magnitude
    classes = method.classify(method.query_sums(queries) / 50, keys)  # [1, 3, 64]
    counts = [(classes == c).sum(-1) for c in range(4)]
    assert all(torch.equal(n, torch.full((1, 3), m)) for n, m in zip(counts, (4, 8, 36, 16),
                                                                    strict=True))
    assert classes[0, 0, 5] == 0 and classes[0, 0, 7] == 1 and classes[0, 0, 11] == 3


def test_chanmix_reconstruction_error_falls_with_class_bits():
    keys = gaussian(1, H, 17, D)
    cache = filled("chanmix:sink=0,residual=16,group=8", keys, gaussian(1, HQ, 17, D))
    decoded = per_row(cache.layers[0], lambda row: row.decode_blocks(torch.float32)[0])
    error = (decoded - keys[:, :, :8]).abs().amax(-2)  # [1, H, D]
    step = (keys[:, :, :8].amax(-2) - keys[:, :, :8].amin(-2))  # [1, H, D]
    classes = cache.method.class_index(cache.layers[0].rows[0].selection, 1)
    for index, bits in zip(classes, (4, 3, 2, 1), strict=True):
        ratio = error.gather(-1, index) / step.gather(-1, index)
        assert (ratio <= 0.5 / (2**bits - 1) + 1e-3).all()


@pytest.mark.parametrize("radius_bits, angle_bits", [(4, 4), (2, 3)])
def test_polar_reconstructs_each_pair_within_its_radius_and_angle_steps(radius_bits, angle_bits):
    keys = gaussian(2, H, 129, D) * 3
    spec = f"polar:radius_bits={radius_bits},angle_bits={angle_bits},sink=0"
    cache = filled(spec, keys, gaussian(2, HQ, 129, D))
    decoded = per_row(cache.layers[0], lambda row: row.decode_blocks(torch.float32)[0])
    # decoded: [2, H, 128, D]
    exact = keys[:, :, :128]
    a, b = exact[..., PAIRS[:, 0]], exact[..., PAIRS[:, 1]]
    a_hat, b_hat = decoded[..., PAIRS[:, 0]], decoded[..., PAIRS[:, 1]]
    radius, angle = torch.hypot(a, b), torch.atan2(b, a)
    r_step = (radius.amax(-2) - radius.amin(-2)) / (2**radius_bits - 1)
    t_step = (angle.amax(-2) - angle.amin(-2)) / (2**angle_bits - 1)
    r_err = (torch.hypot(a_hat, b_hat) - radius).abs()
    t_err = torch.remainder(torch.atan2(b_hat, a_hat) - angle + math.pi, 2 * math.pi) - math.pi
    assert (r_err <= r_step.unsqueeze(-2) / 2 * 1.01 + 1e-4).all()
    assert (t_err.abs() <= t_step.unsqueeze(-2) / 2 * 1.01 + 1e-4).all()
    assert r_err.mean() > 0  # really quantized


def test_polar_needs_rope_pairs():
    with pytest.raises(ValueError, match="polar needs the model's RoPE channel pairs"):
        KVMixCache("polar", LlamaConfig(**TINY))


@pytest.mark.parametrize("spec", ["kitty", "chanmix", "polar"])
def test_generate_on_the_tiny_model(tiny_model, spec):
    ids = torch.randint(1, 97, (2, 30), generator=torch.Generator().manual_seed(0))
    cache = kvmix.make_cache(tiny_model, f"{spec}:sink=4,residual=16,group=8")
    with torch.no_grad():
        out = tiny_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                  min_new_tokens=24, do_sample=False, num_beams=2, cache=cache)
    assert out.shape == (2, 54) and cache.layers[0].rows[0].lengths
    assert cache.nbytes() == cache.theoretical_nbytes()


@pytest.mark.parametrize("family", ["pnmix", "kitty"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_sweep_settings_hit_each_budget(family, budget):
    method = bound(method_at(family, budget))
    assert method.bits(0, torch.float32)[0] == pytest.approx(budget)


def test_sweep_refuses_an_unreachable_budget():
    with pytest.raises(ValueError, match=r"pnmix cannot reach 4\.0 key bits"):
        method_at("pnmix", 4.0)
    with pytest.raises(ValueError, match="family='kivi' is invalid"):
        method_at("kivi", 2.0)
