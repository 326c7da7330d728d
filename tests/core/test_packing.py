import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmix.core.packing import WIDTHS, check_bits, pack, packed_bytes, unpack

shapes = st.lists(st.integers(1, 9), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from(WIDTHS), shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_pack_round_trip_is_bit_exact_on_odd_shapes(bits, shape, seed):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, shape, generator=generator).to(torch.uint8)
    packed = pack(codes, bits)
    numel = codes[0].numel() if codes.dim() > 1 else 1
    assert packed.dtype == torch.uint8
    assert packed.shape == (shape[0], packed_bytes(numel, bits))
    assert torch.equal(unpack(packed, bits, numel).view(codes.shape), codes)


@pytest.mark.parametrize("bits", WIDTHS)
def test_no_wasted_bits(bits):
    # 8 codes of b bits take exactly b bytes; one more code costs one more byte per plane.
    codes = torch.full((1, 8), 2**bits - 1, dtype=torch.uint8)
    assert pack(codes, bits).numel() == bits
    assert packed_bytes(9, bits) == bits + (2 if bits == 3 else 1)


def test_three_bits_is_a_two_bit_plane_plus_the_top_bit():
    codes = torch.tensor([[5, 2, 7, 0]], dtype=torch.uint8)  # 101, 010, 111, 000
    packed = pack(codes, 3)
    low = 0b01 | 0b10 << 2 | 0b11 << 4
    top = 1 | 0 << 1 | 1 << 2
    assert packed.tolist() == [[low, top]]


@pytest.mark.parametrize("bits", [0, 5, 6, 16, 2.0, True])
def test_unsupported_bits_name_the_valid_ones(bits):
    with pytest.raises(ValueError, match=r"bits=.*valid values: \[1, 2, 3, 4, 8\]"):
        check_bits(bits)
