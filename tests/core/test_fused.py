"""The fused encoders (``kvmix.core.fused``: Triton, in its interpreter where there is no GPU,
and the CPU op's ``quantize``) bit for bit against the torch encoder: every width, min-max and
bin-center, float32, float16 and bfloat16, groups along either axis (the CPU op also through
strided views, PN-Mix's mixed keys and its selections), and the hard cases of the float16
statistics (constant groups, values near zero that round to -0 or a subnormal, large
magnitudes). Statistics compare as values: a group whose minimum is both +0 and -0 may keep
either (torch's own choice follows its reduction order, which follows its vector width)."""

from __future__ import annotations

import pytest
import torch

from kvmix.core import fused
from kvmix.core.importance import selected_channels
from kvmix.core.packing import pack
from kvmix.core.quantizers import fused_encoding, quantize, quantize_codes, quantize_mixed
from kvmix.runtime.kernels import cpu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # else Triton's interpreter
BACKENDS = [pytest.param("triton", marks=pytest.mark.skipif(fused.triton is None,
                                                            reason="Triton is not installed")),
            pytest.param("cpu", marks=pytest.mark.skipif(not cpu.available()[0],
                                                         reason="the CPU op is unavailable"))]


def hard_groups(dtype: torch.dtype, device: str = DEVICE) -> torch.Tensor:
    """[2, 3, 16, 32]: random groups of several scales plus the statistics' edge cases."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 16, 32, generator=g) * torch.tensor([1e-3, 3.0, 900.0])[:, None, None]
    x[0, 0, :, 0] = 1.5  # a constant group along the tokens
    x[0, 1, 0, :] = -2.0  # a constant group along the channels
    x[1, 0, :, :4] = torch.linspace(-3e-8, 2e-8, 16)[:, None]  # near zero: -0, subnormals
    x[1, 1, 3, :] = torch.linspace(-6e4, 6e4, 32)  # near the float16 limits
    return x.to(dtype).to(device)


def on(backend: str) -> str:
    return "cpu" if backend == "cpu" else DEVICE


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_codes_and_statistics_are_the_torch_encoders(bits, dtype, backend):
    x = hard_groups(dtype, on(backend))
    for dim in (-1, -2):
        for center in (False, True):
            expected = quantize_codes(x, bits, dim, center=center)
            got = fused.quantize_codes(x, bits, dim, center, packed=False, backend=backend)
            for e, g in zip(expected, got, strict=True):
                assert g.shape == e.shape and g.dtype == e.dtype
                assert torch.equal(g, e), (dim, center)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_packed_blocks_are_the_torch_encoders(bits, backend):
    x = hard_groups(torch.float16, on(backend)).transpose(-1, -2)  # keys: a channel's tokens
    expected = quantize(x, bits, dim=-1)
    with fused_encoding(backend):
        got = quantize(x, bits, dim=-1)
    assert got.codes.shape == expected.codes.shape
    assert torch.equal(got.codes, expected.codes)
    assert torch.equal(got.scale, expected.scale) and torch.equal(got.minimum, expected.minimum)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes_the_kernel_does_not_tile_stay_on_torch(backend):
    x = torch.randn(1, 2, 12, 32, device=on(backend))
    assert not fused.fits(x, -2, 2, backend)  # 12 tokens: not a power of two
    assert not fused.fits(x, -1, 5, backend) and fused.fits(x, -1, 2, backend)
    assert fused.fits(torch.randn(2, 512), -1, 2, backend) == (backend == "triton")  # CPU: <= 256
    with fused_encoding(backend):
        got = quantize(x.transpose(-1, -2), 2, dim=-1)
    assert torch.equal(got.codes, quantize(x.transpose(-1, -2), 2, dim=-1).codes)


@pytest.mark.skipif(not cpu.available()[0], reason="the CPU op is unavailable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_the_cpu_encoder_reads_strided_views_and_every_group_size(bits, dtype):
    """Views the methods hand it (transposed keys, channel groups cut from a token, a
    non-contiguous slice), groups of 8 to 256 elements, groups side by side and apart."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 3, 32, 128, generator=g) * 5 + 1).to(dtype)
    views = [x.transpose(-1, -2), x.unflatten(-1, (-1, 8)), x[:, :, ::2], x[..., 8:72],
             x.transpose(1, 2), x.flatten(2).unflatten(-1, (-1, 256))]  # the largest group
    for view in views:
        for dim in range(view.dim()):
            if not fused.fits(view, dim, bits, "cpu"):
                continue
            for center in (False, True):
                expected = quantize_codes(view, bits, dim, center=center)
                got = fused.quantize_codes(view, bits, dim, center, packed=False, backend="cpu")
                assert all(torch.equal(e, o) for e, o in zip(expected, got, strict=True))
        packed = fused.quantize_codes(view, bits, -1, False, packed=True, backend="cpu")[0]
        assert torch.equal(packed, pack(quantize_codes(view, bits, -1)[0], bits))


@pytest.mark.skipif(not cpu.available()[0], reason="the CPU op is unavailable")
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_the_cpu_encoder_packs_as_torch_packs(bits):
    g = torch.Generator().manual_seed(2)
    for shape in [(3, 4, 8), (2, 5, 64), (1, 256), (2, 3, 12)]:  # 12: a row the op leaves
        codes = torch.randint(0, 2**bits, shape, generator=g, dtype=torch.uint8)
        with fused_encoding("cpu"):
            got = pack(codes, bits)
        assert torch.equal(got, pack(codes, bits))
    assert fused.packs(torch.zeros(2, 64, dtype=torch.uint8))
    assert not fused.packs(torch.zeros(2, 12, dtype=torch.uint8))


@pytest.mark.skipif(not cpu.available()[0], reason="the CPU op is unavailable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("high, low, center", [(3, 1, True), (3, 1, False), (4, 2, False),
                                               (3, 2, False), (8, 4, True)])
def test_the_cpu_encoder_mixes_keys_as_torch_does(high, low, center, dtype):
    """PN-Mix's keys in one pass: both planes, scale and minimum as the two torch encodes and
    the plane split give them, for keys [B, H, G, D] as they come (strided views too)."""
    g = torch.Generator().manual_seed(3)
    hard = hard_groups(dtype, "cpu")  # [2, 3, 16 tokens, 32 channels]
    wide = (torch.randn(2, 3, 64, 128, generator=g) * 4).to(dtype)
    for keys in (hard, hard.transpose(-1, -2).contiguous().transpose(-1, -2), wide[:, :, ::2]):
        B, H, _, D = keys.shape
        for k in (1, D // 2, D):
            index = torch.rand(B, H, D, generator=g).argsort(-1)[..., :k].sort(-1).values
            expected = quantize_mixed(keys, index, high, low, center)
            assert fused.mixes(keys, high, low)
            with fused_encoding("cpu"):
                got = quantize_mixed(keys, index, high, low, center)
            for e, o in zip(expected, got, strict=True):
                assert o.shape == e.shape and o.dtype == e.dtype
                assert torch.equal(o, e), (keys.shape, k)


@pytest.mark.skipif(not cpu.available()[0], reason="the CPU op is unavailable")
@pytest.mark.parametrize("units, paired", [(32, True), (64, False), (16, True)])
def test_the_cpu_op_reads_selections_as_torch_does(units, paired):
    """A packed selection's channels, a pair's two or a channel's one, ascending; a row that
    selects more or fewer than ``count`` cut or filled as ``mask_index`` does."""
    g = torch.Generator().manual_seed(4)
    channels = 2 * units if paired else units
    for B, H in ((1, 3), (4, 8)):
        chosen = torch.rand(B, H, units, generator=g) < 0.5
        bits = pack(chosen.to(torch.uint8), 1)  # [B, H·units/8]
        pairs = torch.randperm(channels, generator=g).view(units, 2) if paired else None
        assert fused.selects(bits, units)
        for count in (channels // 2, 2, channels):
            expected = selected_channels(bits, H, units, pairs, count)
            with fused_encoding("cpu"):
                got = selected_channels(bits, H, units, pairs, count)
            assert got.dtype == torch.int64 and torch.equal(got, expected), (B, count)


def test_an_unknown_encoder_is_refused():
    with pytest.raises(ValueError, match="backend=True is invalid"), fused_encoding(True):
        pass
