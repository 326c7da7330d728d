import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmix.core.bits import WIDTHS, check_bits, packed_bytes, row_bytes
from kvmix.core.packing import pack, unpack

shapes = st.lists(st.integers(1, 9), min_size=1, max_size=4)


@settings(max_examples=80, deadline=None)
@given(bits=st.sampled_from(WIDTHS), shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_pack_round_trip_is_bit_exact_on_odd_shapes(bits, shape, seed):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, shape, generator=generator).to(torch.uint8)
    packed = pack(codes, bits)
    numel = codes[0].numel() if codes.dim() > 1 else 1
    row = shape[-1] if len(shape) > 1 else 1
    assert packed.dtype == torch.uint8
    assert packed.shape == (shape[0], packed_bytes(numel, bits, row))
    assert torch.equal(unpack(packed, bits, numel, row).view(codes.shape), codes)


@pytest.mark.parametrize("bits", WIDTHS)
def test_rows_that_fill_bytes_waste_no_bits(bits):
    codes = torch.full((1, 3, 16), 2**bits - 1, dtype=torch.uint8)
    assert pack(codes, bits).numel() == 3 * 16 * bits // 8
    assert row_bytes(9, bits) == (3 + 2 if bits == 3 else -(-9 * bits // 8))  # padded per plane


def test_a_row_shifted_by_i_bits_is_its_ith_segment():
    """Byte w of a W-byte row holds codes w, w+W, w+2W, ...: what a kernel unpacks with shifts."""
    codes = torch.arange(16, dtype=torch.uint8).view(1, 16) % 4  # 2 bits, W = 4 bytes
    packed = pack(codes, 2)[0]
    for segment in range(4):
        got = (packed >> (2 * segment)) & 3
        assert got.tolist() == codes[0, 4 * segment : 4 * segment + 4].tolist()


def test_three_bits_is_a_two_bit_plane_plus_the_top_bit_per_row():
    codes = torch.tensor([[5, 2, 7, 0, 1, 6, 3, 4]], dtype=torch.uint8)
    packed = pack(codes, 3)[0]
    low, top = packed[:2], packed[2:]
    assert [((low >> (2 * i)) & 3).tolist() for i in range(4)] == [
        (codes[0, 2 * i : 2 * i + 2] & 3).tolist() for i in range(4)]
    assert [((top >> i) & 1).item() for i in range(8)] == (codes[0] >> 2).tolist()


@pytest.mark.parametrize("bits", [0, 5, 6, 16, 2.0, True])
def test_unsupported_bits_name_the_valid_ones(bits):
    with pytest.raises(ValueError, match=r"bits=.*valid values: \[1, 2, 3, 4, 8\]"):
        check_bits(bits)
