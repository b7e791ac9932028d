"""Level 0: packing is bit-exact, MLX-affine-compatible, and unpacks through mx.dequantize."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.turboquant.packing import (
    _unpack_whole_bytes,
    pack_indices,
    packed_words,
    unpack_indices,
    unpack_indices_dequantize,
    unpack_indices_reference,
)
from kvstore.turboquant.quantizer import TQ_BITS

ALL_BITS = [1, 2, 3, 4, 5, 6, 8]


def bitstream(idx: np.ndarray, bits: int) -> np.ndarray:
    """The spec's definition, written out: value j at bits [j*b, (j+1)*b) of a
    little-endian stream of uint32 words, padding 0."""
    rows, dim = idx.shape
    words = np.zeros((rows, packed_words(dim, bits)), np.uint64)
    for j in range(dim):
        for k in range(bits):
            bit = j * bits + k
            words[:, bit // 32] |= ((idx[:, j].astype(np.uint64) >> k) & 1) << (bit % 32)
    return words.astype(np.uint32)


@given(
    bits=st.sampled_from(ALL_BITS),
    dim=st.sampled_from([8, 32, 64, 80, 96, 112, 128, 160, 256]),
    rows=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_pack_is_the_spec_bitstream_and_round_trips(bits, dim, rows, seed):
    idx = np.random.default_rng(seed).integers(0, 1 << bits, (rows, dim)).astype(np.uint8)
    codes = pack_indices(mx.array(idx), bits)
    assert codes.dtype == mx.uint32 and codes.shape == (rows, packed_words(dim, bits))
    assert np.array_equal(np.array(codes), bitstream(idx, bits))
    assert np.array_equal(np.array(unpack_indices_reference(codes, bits, dim)), idx)
    unpacked = unpack_indices(codes, bits, dim)
    assert unpacked.dtype == mx.uint32 and np.array_equal(np.array(unpacked), idx)


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_dequantize_unpack_equals_reference(bits, dim):
    idx = mx.random.randint(0, 1 << bits, (2, 3, 5, dim)).astype(mx.uint8)
    codes = pack_indices(idx, bits)
    via_mlx = unpack_indices_dequantize(codes, bits, dim)
    assert via_mlx.dtype == mx.float32
    reference = unpack_indices_reference(codes, bits, dim)
    assert mx.array_equal(via_mlx.astype(mx.uint32), reference).item()
    assert mx.array_equal(unpack_indices(codes, bits, dim), reference).item()


@pytest.mark.parametrize("bits", TQ_BITS)
def test_unpack_of_a_strided_slice(bits):
    # Cache buffers are sliced along tokens; unpacking a view must read the right bytes.
    idx = mx.random.randint(0, 1 << bits, (2, 3, 40, 128)).astype(mx.uint8)
    codes = pack_indices(idx, bits)
    part = codes[:, 1:, 5:29, :]
    want = idx[:, 1:, 5:29, :].astype(mx.uint32)
    assert mx.array_equal(unpack_indices(part, bits, 128), want).item()


def test_dequantize_unpack_needs_whole_groups():
    with pytest.raises(ValueError, match="multiple of 32 values; received dim 80"):
        unpack_indices_dequantize(mx.zeros((1, 8), mx.uint32), 3, 80)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_layout_is_mx_quantize_layout(bits):
    # Rows idx - top whose every group holds both ends quantize with scale 1 and
    # bias -top (MLX keeps the larger-magnitude edge exact), so q == idx and
    # mx.quantize's packed words are exactly our packing of idx.
    top = (1 << bits) - 1
    rng = np.random.default_rng(bits)
    idx = rng.integers(0, 1 << bits, (6, 128))
    idx[:, ::32] = 0
    idx[:, 1::32] = top
    codes, scales, biases = mx.quantize(
        mx.array((idx - top).astype(np.float32)), group_size=32, bits=bits
    )
    assert np.all(np.array(scales) == 1) and np.all(np.array(biases) == -top)
    assert mx.array_equal(codes, pack_indices(mx.array(idx.astype(np.uint8)), bits)).item()


@pytest.mark.parametrize("bits", TQ_BITS)
def test_single_bit_probes(bits):
    # Each set bit of a word decodes to exactly one index bit, wherever a value
    # crosses a word boundary.
    dim = 128
    words = packed_words(dim, bits)
    for bit in range(words * 32):
        probe = np.zeros((1, words), np.uint32)
        probe[0, bit // 32] = np.uint32(1 << (bit % 32))
        idx = np.array(unpack_indices_dequantize(mx.array(probe), bits, dim)).astype(np.int64)[0]
        expected = np.zeros(dim, np.int64)
        expected[bit // bits] = 1 << (bit % bits)
        assert np.array_equal(idx, expected), bit


def test_packed_words_is_ceil():
    assert [packed_words(128, b) for b in (2, 3, 4, 5)] == [8, 12, 16, 20]
    assert packed_words(256, 3) == 24  # mlx-lm's D // (32 // bits) would say 25
    assert packed_words(80, 3) == 8 and packed_words(80, 5) == 13


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dim", [8, 80, 128])
def test_whole_byte_unpack_equals_reference(bits, dim):
    # The path unpack_indices takes for 4 bits, held to the reference at every width
    # whose values fill whole bytes (a strided slice included).
    idx = mx.random.randint(0, 1 << bits, (2, 3, 9, dim)).astype(mx.uint8)
    codes = pack_indices(idx, bits)[:, :, 2:7]
    got = _unpack_whole_bytes(codes, bits, dim)
    assert got.dtype == mx.uint32
    assert mx.array_equal(got, unpack_indices_reference(codes, bits, dim)).item()
    assert mx.array_equal(got, idx[:, :, 2:7].astype(mx.uint32)).item()
