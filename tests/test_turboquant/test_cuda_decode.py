"""The CUDA decode kernel's switch, its fallback, and its bit arithmetic (the kernel
itself runs on the device machine: tools/bench/gpu/check.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvstore.codecs.turboquant_params import TurboQuantParams
from kvstore.turboquant import cuda_decode
from kvstore.turboquant.packing import pack_indices, unpack_indices_reference
from kvstore.turboquant.quantizer import TQ_BITS
from tests.test_turboquant.refusing import refuse, sample


def kernel_formula(codes: np.ndarray, bits: int, dim: int) -> np.ndarray:
    """What ``cuda_decode._SOURCE`` computes for each value's index, in numpy: its bit
    offset's word shifted down, the next word's low bits above it when it crosses."""
    codes = codes.astype(np.uint64)
    out = np.empty((codes.shape[0], dim), np.uint64)
    for j in range(dim):
        bit = j * bits
        w, o = bit >> 5, bit & 31
        v = codes[:, w] >> o
        if o + bits > 32:
            v |= (codes[:, w + 1] << (32 - o)) & 0xFFFFFFFF
        out[:, j] = v & ((1 << bits) - 1)
    return out


@pytest.mark.parametrize("bits", TQ_BITS)
@pytest.mark.parametrize("dim", [64, 80, 128])
def test_the_kernels_bit_arithmetic_reads_the_packed_stream(bits, dim):
    index = np.random.default_rng(bits + dim).integers(0, 1 << bits, (9, dim)).astype(np.uint8)
    codes = pack_indices(mx.array(index), bits)
    got = kernel_formula(np.array(codes), bits, dim)
    assert np.array_equal(got, index)
    assert np.array_equal(got, np.array(unpack_indices_reference(codes, bits, dim)))
    source = cuda_decode._SOURCE  # the same steps, named as above
    for step in ("w = bit >> 5, o = bit & 31", "row[w] >> o", "if (o + BITS > 32)"):
        assert step in source


def test_on_by_default_on_a_cuda_gpu_and_off_when_switched_off(monkeypatch):
    on_a_cuda_gpu = mx.cuda.is_available() and mx.default_device() == mx.gpu
    monkeypatch.setenv(cuda_decode.ENV, "0")
    assert not cuda_decode.enabled()
    monkeypatch.delenv(cuda_decode.ENV, raising=False)
    assert cuda_decode.enabled() == on_a_cuda_gpu
    monkeypatch.setenv(cuda_decode.ENV, "1")
    assert cuda_decode.enabled() == on_a_cuda_gpu
    rows = mx.zeros((4, 16), mx.uint32)
    if not cuda_decode.enabled():
        assert cuda_decode.decoded(rows, mx.ones((4, 1)), mx.ones((16,)), 4, 128) is None


def test_a_kernel_that_fails_its_proof_leaves_the_ops_in_place(monkeypatch):
    # Switched on where the kernel cannot build (as on a GPU whose compiler refuses
    # it): the decode is the MLX ops', bit for bit, and nothing raises.
    kq, _ = TurboQuantParams.defaults(4, 4, 128).quantizers()
    x = sample(3)
    codes, scales = kq.encode(x)
    want = kq.decode(codes, scales, mx.bfloat16)
    launches = refuse(monkeypatch, cuda_decode, ("_launch",))
    got = kq.decode(codes, scales, mx.bfloat16)
    assert len(launches) == 1  # the proof's, once; the decode itself never launched
    assert cuda_decode._PROVEN == {(4, 128, 16): False}
    assert mx.array_equal(got, want).item()
    kq.decode(codes, scales, mx.bfloat16)
    assert len(launches) == 1  # proven (or not) once per process and width


def test_no_rows_need_no_kernel(monkeypatch):
    monkeypatch.setattr(cuda_decode, "enabled", lambda: True)
    monkeypatch.setattr(cuda_decode, "_PROVEN", {})
    empty = mx.zeros((0, 16), mx.uint32)
    assert cuda_decode.decoded(empty, mx.zeros((0, 1)), mx.ones((16,)), 4, 128) is None
    assert cuda_decode._PROVEN == {}  # not even the proof ran
