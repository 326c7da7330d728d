"""The CPU op's integer path at production shapes (32 query heads over 8 KV heads of dimension
128, groups of 32, 64 and 128 tokens, every code width) against the reference path.

The integer path rounds the float weights it dots with codes (the pre-scaled query per key
block, p·scale per value group) to 16 bits relative to each block's largest weight; the stated
tolerance (``helpers.INTEGER_TOLERANCE``) is 1e-3 of the output's largest magnitude, and the
rounding measures about 1e-4 here. Without the lower int8 plane it would be 5-8e-2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import INTEGER_TOLERANCE, assert_near, left_padded

from kvmix.methods import parse_method
from kvmix.models.loading import attention_config
from kvmix.runtime.cache import KVMixCache
from kvmix.runtime.kernels import cpu
from kvmix.runtime.layer import take_pending

pytestmark = pytest.mark.skipif(not cpu.available()[0], reason="the CPU op is not built")

HQ, H, D = 32, 8, 128
PAIRS = torch.stack([torch.arange(D // 2), torch.arange(D // 2, D)], 1)
INTEGER = all(flag in Path("/proc/cpuinfo").read_text().split() for flag in cpu.INTEGER_FLAGS) \
    if Path("/proc/cpuinfo").exists() else False


def make(method: str, backend: str) -> KVMixCache:
    return KVMixCache(parse_method(method), attention_config(HQ, H, D), PAIRS, backend=backend)


def draw(batch: int, count: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Keys with outlier channels (as real keys have), values, queries: [batch, heads, count, D]."""
    g = torch.Generator().manual_seed(seed)
    outliers = 1 + 9 * (torch.rand(D, generator=g) > 0.9)
    keys = torch.randn(batch, H, count, D, generator=g) * outliers + 0.5
    values = torch.randn(batch, H, count, D, generator=g)
    return keys, values, torch.randn(batch, HQ, count, D, generator=g)


def attend(cache: KVMixCache, staged, mask=None) -> torch.Tensor:
    keys, values, queries = staged
    cache.update(keys, values, 0)
    layer = take_pending()
    return layer.attend(cache.method.transform_queries(queries, 0), mask, D**-0.5)


def test_the_op_says_which_kernels_it_runs():
    kernels = cpu.describe()
    assert kernels.startswith("integer dot products" if INTEGER else "float kernels"), kernels


@pytest.mark.parametrize("method", [
    "kivi2",                                               # 2-bit keys in groups of 32
    "kxvy:key_bits=1,value_bits=8,group=64,value_group=64",
    "kxvy:key_bits=3,value_bits=3,group=128,value_group=128",
    "kxvy:key_bits=4,value_bits=1,group=64,value_group=16",
    "kxvy:key_bits=8,value_bits=4,group=32,value_group=32",
    "pnmix1", "kitty", "chanmix",                          # mixed-precision planes
])
def test_production_shapes_match_the_reference(method):
    """A left-padded batch (rows of 300, 40 and 170 tokens: blocks, sink and residual, and a
    row with no block yet), decode steps across a block boundary, a crop inside a block and
    reordered beams: each step's output within the stated tolerance of the reference path."""
    fast, exact = make(method, "cpu"), make(method, "torch")
    lengths = [300, 40, 170]
    prompt = draw(3, max(lengths), 0)
    for cache in (fast, exact):
        attend(cache, prompt, left_padded(lengths))
    steps = fast.method.group + 2
    for i in range(steps):
        staged = draw(3, 1, 100 + i)
        assert_near(attend(fast, staged), attend(exact, staged), INTEGER_TOLERANCE)
        if i == steps // 2:
            for cache in (fast, exact):
                cache.crop(-5)
                cache.reorder_cache(torch.tensor([0, 0, 2]))
    assert fast.layers[0].rows[0].lengths  # packed blocks were read
