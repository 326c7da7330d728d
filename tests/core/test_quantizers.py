import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmix.core.quantizers import dequantize, quantize

BITS = (1, 2, 3, 4, 8)


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from(BITS), center=st.booleans(), seed=st.integers(0, 10_000),
       spread=st.floats(1e-2, 1e3))
def test_error_is_at_most_half_a_stored_step(bits, center, seed, spread):
    x = torch.randn(2, 3, 16, 8, generator=torch.Generator().manual_seed(seed)) * spread
    q = quantize(x, bits, dim=-2, center=center)
    error = (x - dequantize(q)).abs()
    step = q.scale.float()  # [2, 3, 1, 8]
    assert (error <= step / 2 * (1 + 1e-4) + 1e-6 * spread).all()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("center", [False, True])
def test_constant_group_is_exact(bits, center):
    x = torch.tensor([1.5, -3.25, 0.0, 1024.0]).repeat(5, 1).T.reshape(1, 4, 5)  # rows constant
    q = quantize(x, bits, dim=-1, center=center)
    assert torch.equal(dequantize(q), x)
    assert (q.scale == 0).all()


def test_one_bit_bin_center_levels_are_quarter_and_three_quarters():
    x = torch.tensor([[0.0, 0.1, 0.6, 1.0]])
    out = dequantize(quantize(x, 1, dim=-1, center=True))
    assert torch.allclose(out, torch.tensor([[0.25, 0.25, 0.75, 0.75]]), atol=1e-3)
    minmax = dequantize(quantize(x, 1, dim=-1, center=False))
    assert torch.allclose(minmax, torch.tensor([[0.0, 0.0, 1.0, 1.0]]), atol=1e-3)


def test_invalid_positions_stay_out_of_the_statistics():
    x = torch.tensor([[[1000.0], [1.0], [2.0], [3.0]]])  # [1, 4 tokens, 1 channel]
    valid = torch.tensor([[[False], [True], [True], [True]]])
    q = quantize(x, 2, dim=-2, valid=valid)
    assert q.minimum.item() == pytest.approx(1.0, abs=1e-3)
    assert q.scale.item() == pytest.approx(2 / 3, rel=1e-3)
    assert (dequantize(q)[0, 1:] - x[0, 1:]).abs().max() <= 1 / 3 + 1e-3


def test_scale_and_minimum_are_16_bit():
    q = quantize(torch.randn(1, 8, 4), 2, dim=-2)
    assert q.scale.dtype == q.minimum.dtype == torch.float16
    assert q.codes.dtype == torch.uint8
