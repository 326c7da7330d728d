"""The Triton kernels against the torch reference path, in Triton's CPU interpreter where there
is no GPU (TRITON_INTERPRET=1, set in conftest): every method they serve, GQA, several
sequences, left padding, crops (ragged blocks), reordered beams, chunked decode, edge lengths
of sink and residual, every kxvy width; and how the backend is chosen and refused."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    FAST,
    PRODUCTION_METHODS,
    compare_batched,
    compare_production,
    compare_rows,
    make,
)

from kvmix.runtime.kernels import gpu, interpreting, resolve

pytestmark = pytest.mark.skipif(not gpu.available()[0], reason="Triton is not installed")
TOLERANCE = 1e-5  # float32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # else Triton's interpreter


@pytest.fixture(autouse=True)
def exact_float32():
    """TF32 off (on a GPU the reference's float32 matmuls would round to 10 bits)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def check(cache, count, seed, batch, mask=None):
    return compare_rows(cache, count, seed, batch, mask, fused=gpu, tolerance=TOLERANCE,
                        device=DEVICE)


@pytest.mark.parametrize("name", FAST)
def test_the_kernels_match_the_reference_through_a_generation(name):
    cache = make(name)
    check(cache, 45, seed=0, batch=2)
    for step, count in enumerate([1, 5, 1]):  # single and chunked decode
        check(cache, count, seed=step + 1, batch=2)
    cache.crop(-13)  # the crop ends inside a block: a ragged last block
    check(cache, 1, seed=40, batch=2)
    cache.reorder_cache(torch.tensor([1, 0], device=DEVICE))
    check(cache, 2, seed=41, batch=2)
    assert len(cache.layers[0].rows[0].lengths) >= 2


@pytest.mark.interpreted
@pytest.mark.parametrize("method", [PRODUCTION_METHODS[i] for i in (0, 2, 3, 5, 7)])
def test_production_shapes_match_the_reference(method):
    """Heads of 128 with 4 query heads to a KV head, groups of 32-128: rows load as words where
    they are whole words (``_word_rows``), byte by byte elsewhere (the 1-bit values in groups of
    16). 8:2 heads, not 32:8: a program per sequence and KV head has the same tiles, and the
    interpreter runs programs one by one (a quarter of the time; the CPU op runs 32:8). Block
    boundaries are crossed in the small-shape tests; here a few steps (the interpreter)."""
    compare_production(method, "triton", TOLERANCE, steps=4, heads=(8, 2), device=DEVICE)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("row", [16, 32, 64, 128])
def test_word_loads_give_the_packed_codes(bits, row):
    """Rows that are whole 32-bit words decode by word loads to the codes ``pack`` wrote;
    others are refused the word path (they load byte by byte)."""
    from kvmix.core.bits import row_bytes
    from kvmix.core.packing import pack

    count = 16
    codes = torch.randint(0, 2**bits, (count, row), generator=torch.Generator().manual_seed(bits))
    packed = pack(codes, bits).reshape(-1).to(DEVICE)  # rows back to back
    words = gpu._words(packed[None], row, bits)
    parts = [row_bytes(row, 2), row_bytes(row, 1)] if bits == 3 else [row_bytes(row, bits)]
    assert words == all(p % 4 == 0 for p in parts)
    if not words:
        return
    out = torch.empty(count, row, device=DEVICE)
    _decode_rows[(1,)](packed, out, row_bytes(row, bits), row_bytes(row, 2), count, row, bits)
    assert torch.equal(out.cpu().long(), codes)


if gpu.triton is not None:
    tl = gpu.tl

    @gpu.triton.jit
    def _decode_rows(packed, out, width, low_width, A: tl.constexpr, N: tl.constexpr,
                     BITS: tl.constexpr):
        a = tl.arange(0, A)
        n = tl.arange(0, N)
        x = gpu._word_rows(packed + a * width, a < A, low_width, A, N, BITS)
        tl.store(out + a[:, None] * N + n[None, :], x)


@pytest.mark.parametrize("name", ["kivi2", "pnmix1", "chanmix", "wush", "full"])
def test_one_batched_pass_matches_the_reference_on_a_ragged_batch(name):
    """Per-channel planes (1, 2 and 4 of them), per-token keys and float pages through the
    batched kernels, a program per sequence and KV head (without a GPU): each one's online
    softmax runs across all of its sequence's pages, then its float slots'."""
    compare_batched(name, "triton", steps=7, device=DEVICE)  # each row seals a page, then reads it


@pytest.mark.parametrize("name", ["kivi2", "wush"])
def test_splits_of_a_sequence_merge_to_the_reference(name, monkeypatch):
    """Many programs per sequence and KV head (as on a GPU): pages split between them, splits
    with no page (the grid does not follow the page count), merged by log-sum-exp."""
    monkeypatch.setattr(gpu, "PROGRAMS", 64)
    compare_batched(name, "triton", steps=2, device=DEVICE, lengths=(46, 25, 31))  # with pages


@pytest.mark.parametrize("name", ["pnmix1", "wush", "full"])
def test_one_batched_pass_masks_a_sliding_window_as_the_reference_does(name):
    """Sliding-window layers of 20 tokens: the window's edge inside each sequence's first page
    (the kernels' skip), the sink and the residual (the spans)."""
    compare_batched(name, "triton", steps=7, device=DEVICE, window=20)


@pytest.mark.parametrize("name", ["kivi2", "pnmix1", "wush"])
@pytest.mark.parametrize("sink, prompt", [(0, 17), (1, 25), (8, 8), (4, 4 + 16 + 8)])
def test_edge_lengths_of_sink_and_residual(name, sink, prompt):
    cache = make(name, sink=sink)
    check(cache, prompt, seed=3, batch=1)
    check(cache, 1, seed=10, batch=1)


def test_left_padded_rows_read_only_their_own_tokens():
    cache = make("pnmix1")
    lengths, total = torch.tensor([50, 31]), 50
    mask = (torch.arange(total)[None] >= total - lengths[:, None])[:, None, None, :]
    check(cache, total, seed=5, batch=2, mask=mask)
    grown = torch.cat([mask, torch.ones(2, 1, 1, 1, dtype=torch.bool)], -1)
    check(cache, 1, seed=20, batch=2, mask=grown)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_every_width_of_kxvy(bits):
    cache = make(f"kxvy:key_bits={bits},value_bits={ {1: 8, 2: 4, 3: 3, 4: 2, 8: 1}[bits]}")
    check(cache, 60, seed=bits, batch=1)
    assert check(cache, 1, seed=100 + bits, batch=1) < TOLERANCE


@pytest.mark.parametrize("name", ["kivi2", "pnmix1", "chanmix", "kxvy:key_bits=3,value_bits=3"])
def test_blocks_encoded_by_triton_are_the_torch_blocks(name, monkeypatch):
    from helpers import feed

    from kvmix.core import fused
    from kvmix.core.tree import tagged_tensors

    calls = []
    kernel = fused.quantize_codes
    monkeypatch.setattr(fused, "quantize_codes",
                        lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    caches = [make(name, backend=backend) for backend in ("torch", "triton")]
    for cache in caches:
        feed(cache, 41, seed=7, batch=2, device=DEVICE)  # float16 tokens: the prompt flushes blocks
        feed(cache, 8, seed=8, batch=2, device=DEVICE)  # decode flushes one more
    rows = [cache.layers[0].rows for cache in caches]
    for torch_row, triton_row in zip(*rows, strict=True):
        assert len(torch_row.lengths) >= 2
        expected = tagged_tensors(torch_row.blocks, "")
        got = tagged_tensors(triton_row.blocks, "")
        assert len(got) == len(expected)
        for (_, e), (_, g) in zip(expected, got, strict=True):
            assert torch.equal(e, g)
    # keys and values of every block of both rows went through the kernel, a batch per call
    assert sum(calls) >= 2 * 2 * 3


def test_float16_stays_within_1e3():
    from helpers import tokens

    from kvmix.runtime.kernels import reference
    from kvmix.runtime.layer import take_pending

    cache = make("kivi2")
    keys, values, queries = tokens(1, 70, 9, dtype=torch.float16, device=DEVICE)
    cache.update(keys, values, 0)
    layer = take_pending()
    layer.attend(queries, None, 32**-0.5)
    keys, values, queries = tokens(1, 1, 10, dtype=torch.float16, device=DEVICE)
    cache.update(keys, values, 0)
    layer = take_pending()
    row = layer.rows[0]
    view = cache.method.kernel_view(row.blocks, 0, row.selection)
    staged_keys, staged_values = layer.pending
    fast = gpu.attend(row, view, queries, staged_keys, staged_values, 32**-0.5)
    exact = reference.attend(row, queries, staged_keys, staged_values, 32**-0.5)
    assert fast.dtype == torch.float16
    torch.testing.assert_close(fast, exact, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's case")
def test_triton_needs_cuda_tensors_unless_interpreting(monkeypatch):
    assert interpreting()
    assert resolve("triton", "cpu") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton' is unavailable: Triton runs on CUDA "
                                         "tensors; the model is on cpu"):
        resolve("triton", "cpu")
    assert resolve("auto", "cpu") in ("cpu", "torch")  # auto on CPU never picks Triton


def test_unsupported_widths_and_head_dims_are_named():
    from kvmix.methods import KernelView, TokenGroups

    groups = TokenGroups(torch.zeros(1, 4, dtype=torch.uint8), 5, 32, torch.zeros(1), None)
    with pytest.raises(ValueError, match="bits=5 has no Triton kernel; valid: 1, 2, 3, 4, 8"):
        gpu.check_view(KernelView(groups, groups), 64)
    groups.bits = 2
    with pytest.raises(ValueError, match="head_dim=512 is too large"):
        gpu.check_view(KernelView(groups, groups), 512)


def test_a_head_dim_beyond_the_kernels_is_refused_when_the_cache_is_made():
    from kvmix.models.loading import attention_config
    from kvmix.runtime.cache import KVMixCache

    config = attention_config(4, 2, 320)
    with pytest.raises(ValueError, match="backend='triton' cannot read kivi's blocks: "
                                         "head_dim=320 is too large for the Triton kernels"):
        KVMixCache("kivi2", config, backend="triton")
    assert KVMixCache("kivi2", attention_config(4, 2, 256), backend="triton").backend == "triton"
