"""The Triton encoder (``kvmix.core.fused``) bit for bit against the torch encoder, in Triton's
interpreter where there is no GPU: every width, min-max and bin-center, float32, float16 and
bfloat16, groups along either axis, and the hard cases of the float16 statistics (constant
groups, values near zero that round to -0 or a subnormal, large magnitudes)."""

from __future__ import annotations

import pytest
import torch

from kvmix.core import fused
from kvmix.core.quantizers import fused_encoding, quantize, quantize_codes

pytestmark = pytest.mark.skipif(fused.triton is None, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # else Triton's interpreter


def hard_groups(dtype: torch.dtype) -> torch.Tensor:
    """[2, 3, 16, 32]: random groups of several scales plus the statistics' edge cases."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 16, 32, generator=g) * torch.tensor([1e-3, 3.0, 900.0])[:, None, None]
    x[0, 0, :, 0] = 1.5  # a constant group along the tokens
    x[0, 1, 0, :] = -2.0  # a constant group along the channels
    x[1, 0, :, :4] = torch.linspace(-3e-8, 2e-8, 16)[:, None]  # near zero: -0, subnormals
    x[1, 1, 3, :] = torch.linspace(-6e4, 6e4, 32)  # near the float16 limits
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_codes_and_statistics_are_the_torch_encoders(bits, dtype):
    x = hard_groups(dtype)
    for dim in (-1, -2):
        for center in (False, True):
            expected = quantize_codes(x, bits, dim, center=center)
            got = fused.quantize_codes(x, bits, dim, center, packed=False)
            for e, g in zip(expected, got, strict=True):
                assert g.shape == e.shape and g.dtype == e.dtype
                assert torch.equal(g, e), (dim, center)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_packed_blocks_are_the_torch_encoders(bits):
    x = hard_groups(torch.float16).transpose(-1, -2)  # keys: rows are a channel's tokens
    expected = quantize(x, bits, dim=-1)
    with fused_encoding():
        got = quantize(x, bits, dim=-1)
    assert got.codes.shape == expected.codes.shape
    assert torch.equal(got.codes, expected.codes)
    assert torch.equal(got.scale, expected.scale) and torch.equal(got.minimum, expected.minimum)


def test_shapes_the_kernel_does_not_tile_stay_on_torch():
    x = torch.randn(1, 2, 12, 32, device=DEVICE)
    assert not fused.fits(x, -2, 2)  # 12 tokens: not a power of two
    assert not fused.fits(x, -1, 5) and fused.fits(x, -1, 2)
    with fused_encoding():
        got = quantize(x.transpose(-1, -2), 2, dim=-1)
    assert torch.equal(got.codes, quantize(x.transpose(-1, -2), 2, dim=-1).codes)
