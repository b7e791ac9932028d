"""TurboQuant's one-kernel encode and decode: their arithmetic, their proof, their switch
and their fallback (the kernels themselves run on the device machine:
tools/bench/gpu/rht_probe.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvstore.errors import EncodingError
from kvstore.turboquant import cuda_rht
from kvstore.turboquant.codebook import codebook
from kvstore.turboquant.packing import pack_indices
from kvstore.turboquant.quantizer import (
    FLOAT16_SCALE_LIMIT,
    TQ_BITS,
    TurboQuantizer,
    decode_many,
    encode_many,
    quantizer_for,
)
from kvstore.turboquant.rotation import rotation_for
from kvstore.turboquant.verdict import FINE, NOT_FINITE, WIDE_SCALE
from tests.test_turboquant.refusing import refuse, sample


def lanes_butterflies(x: np.ndarray) -> np.ndarray:
    """What ``cuda_rht._BUTTERFLIES`` computes on each row, in numpy: lane ``l`` holds
    coordinates ``l * V .. l * V + V - 1``; strides inside a lane, then lane masks."""
    rows, dim = x.shape
    per = dim // 32
    v = x.reshape(rows, 32, per).astype(np.float32).copy()
    h = 1
    while h < per:
        for i in range(per):
            if i & h == 0:
                a, b = v[:, :, i].copy(), v[:, :, i + h].copy()
                v[:, :, i], v[:, :, i + h] = a + b, a - b
        h <<= 1
    lane = np.arange(32)
    m = 1
    while m < 32:
        other = v[:, lane ^ m, :]
        upper = (lane & m).astype(bool)[None, :, None]
        v = np.where(upper, other - v, v + other).astype(np.float32)
        m <<= 1
    return v.reshape(rows, dim)


def sylvester(dim: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < dim:
        h = np.block([[h, h], [h, -h]])
    return h


@pytest.mark.parametrize("dim", [32, 64, 128, 256])
def test_the_kernels_butterflies_are_the_natural_order_hadamard_transform(dim):
    x = np.random.default_rng(dim).standard_normal((7, dim)).astype(np.float32)
    got = lanes_butterflies(x)
    exact = x.astype(np.float64) @ sylvester(dim)
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-4)
    ops = np.array(mx.hadamard_transform(mx.array(x), scale=1.0))
    np.testing.assert_allclose(got, ops, rtol=0, atol=1e-4)
    for step in ("v[i] = a + b; v[i + h] = a - b", "__shfl_xor_sync(0xffffffffu, v[i], m)"):
        assert step in cuda_rht._BUTTERFLIES
    assert "(lane & m) ? (o - v[i]) : (v[i] + o)" in cuda_rht._BUTTERFLIES


@pytest.mark.parametrize("bits", TQ_BITS)
@pytest.mark.parametrize("dim", [64, 128])
def test_the_encode_kernels_packing_writes_the_packed_stream(bits, dim):
    index = np.random.default_rng(bits * dim).integers(0, 1 << bits, (5, dim)).astype(np.uint64)
    words = np.zeros((5, -(-dim * bits // 32)), np.uint64)
    for j in range(dim):  # the kernel's loop: each value ORed into its word(s)
        bit = j * bits
        w, o = bit >> 5, bit & 31
        words[:, w] |= (index[:, j] << o) & 0xFFFFFFFF
        if o + bits > 32:
            words[:, w + 1] |= index[:, j] >> (32 - o)
    want = np.array(pack_indices(mx.array(index.astype(np.uint8)), bits))
    assert np.array_equal(words.astype(np.uint32), want)
    for step in ("atomicOr(&packed[warp][w], idx[i] << o)", "idx[i] >> (32 - o)"):
        assert step in cuda_rht._ENCODE


def _rows_with_a_coordinate_at_a_threshold(q: TurboQuantizer, k: int) -> np.ndarray:
    """Rows whose rotated, normalised first coordinate is the table's threshold ``k``."""
    rng = np.random.default_rng(k)
    t = float(codebook(q.bits).thresholds[k])
    z = rng.standard_normal((3, q.dim))
    z[:, 0] = 0.0
    z[:, 1:] *= np.sqrt((q.dim - t * t) / (z[:, 1:] ** 2).sum(axis=1, keepdims=True))
    z[:, 0] = t
    return np.array(q.rotation.inverse(mx.array(z.astype(np.float32))))


def test_the_encode_proof_lets_a_cell_differ_only_beside_a_threshold():
    q = quantizer_for(3, 128, "k")
    k = 3
    rows = _rows_with_a_coordinate_at_a_threshold(q, k)
    idx, scale, norm = (np.array(a) for a in q.quantize(mx.array(rows)))
    idx = idx.astype(np.int64)

    def agrees(got_idx: np.ndarray, got_scale: np.ndarray) -> bool:
        return cuda_rht._encode_agrees(rows, idx, scale, norm, got_idx, got_scale, q)

    assert agrees(idx, scale)
    beside = idx.copy()
    beside[0, 0] = k if idx[0, 0] == k + 1 else k + 1  # across threshold k
    assert agrees(beside, scale)  # that row's scale is not held to the ops'
    far = idx.copy()
    far[1, 5] += 1 if far[1, 5] < 7 else -1
    assert not agrees(far, scale)
    two = idx.copy()
    two[0, 0] += 2 if two[0, 0] < 6 else -2
    assert not agrees(two, scale)
    off = scale.copy()
    off[2] *= 1 + 1e-3
    assert not agrees(idx, off)


def test_switched_off_or_off_a_cuda_gpu_the_ops_run(monkeypatch):
    q = quantizer_for(4, 128, "v")
    on_a_cuda_gpu = mx.cuda.is_available() and mx.default_device() == mx.gpu
    monkeypatch.setenv(cuda_rht.ENV, "0")
    assert not cuda_rht.enabled() and not cuda_rht.usable(q)
    monkeypatch.delenv(cuda_rht.ENV)
    assert cuda_rht.enabled() == on_a_cuda_gpu == cuda_rht.usable(q)
    if not on_a_cuda_gpu:
        rows = mx.zeros((4, 128), mx.bfloat16)
        assert cuda_rht.encoded(rows, q, 60000.0) is None
        assert cuda_rht.decoded(mx.zeros((4, 16), mx.uint32), mx.ones((4,)), q, mx.float32) is None


def test_only_one_round_rht_over_whole_lanes_is_the_kernels(monkeypatch):
    monkeypatch.setattr(cuda_rht, "enabled", lambda: True)
    assert cuda_rht.usable(quantizer_for(4, 128, "k"))
    assert not cuda_rht.usable(quantizer_for(4, 80, "k"))  # a dense rotation
    assert not cuda_rht.usable(quantizer_for(4, 16, "k"))  # under a lane each
    two_rounds = TurboQuantizer(4, 128, "k", rotation=rotation_for(128, "k", rounds=2))
    assert not cuda_rht.usable(two_rounds)


def test_kernels_that_fail_their_proof_leave_the_ops_in_place(monkeypatch):
    # Switched on where the kernels cannot build (a GPU whose compiler refuses them):
    # encode and decode are the MLX ops', bit for bit, and nothing raises.
    kq = quantizer_for(4, 128, "k")
    x = sample(5)
    codes, scales = kq.encode(x)
    want = kq.decode(codes, scales, mx.bfloat16)
    launches = refuse(monkeypatch, cuda_rht, ("_encode", "_decode"))
    got_codes, got_scales = kq.encode(x)
    got = kq.decode(got_codes, got_scales, mx.bfloat16)
    assert len(launches) == 2  # each proof's, once; encode and decode never launched
    assert sorted(key[0] for key, ok in cuda_rht._PROVEN.items() if not ok) == [
        "decode",
        "encode",
    ]
    assert mx.array_equal(got_codes, codes).item() and mx.array_equal(got_scales, scales).item()
    assert mx.array_equal(got, want).item()
    kq.decode(got_codes, got_scales, mx.bfloat16)
    assert len(launches) == 2  # proven (or not) once per process and kernel


def test_a_quantizers_constants_are_made_once_and_are_its_own():
    q = quantizer_for(3, 64, "v")
    tables = cuda_rht._tables(q)
    assert cuda_rht._tables(q) is tables
    assert np.array_equal(np.array(tables.signs), q.rotation.signs[0].astype(np.float32))
    assert np.array_equal(np.array(tables.thresholds), codebook(3).thresholds.astype(np.float32))
    assert np.array_equal(np.array(tables.centroids), np.array(q.centroids))
    assert cuda_rht._tables(quantizer_for(3, 64, "k")) is not tables


def _ops_launch(tensors, scale_limit):
    """What one launch of the encode kernel over ``tensors`` returns, made by the ops: a
    stand-in for the kernel on this CPU (its arithmetic is tested above)."""
    made, verdicts = [], []
    for x, q in tensors:
        idx, scale, norm = q.quantize(x)
        wide = mx.where(mx.abs(scale) > scale_limit, WIDE_SCALE, FINE)
        verdict = mx.where(mx.isfinite(norm), wide, NOT_FINITE).astype(mx.uint8)
        verdicts.append(verdict.reshape(-1))
        made.append((pack_indices(idx, q.bits), scale, scale.astype(mx.float16)))
    return made, mx.concatenate(verdicts)


def _kernels_standing_in(monkeypatch, launch=_ops_launch):
    """The encode kernels switched on, each launch made by ``launch``; returns the
    launches, as the tensors' row counts of each."""
    launches = []

    def launched(tensors, scale_limit):
        launches.append([x.size // x.shape[-1] for x, _ in tensors])
        return launch(tensors, scale_limit)

    monkeypatch.setattr(cuda_rht, "enabled", lambda: True)
    monkeypatch.setattr(cuda_rht, "_encode", launched)
    monkeypatch.setattr(cuda_rht, "_PROVEN", {})
    return launches


def _keys_and_values():
    kq, vq = quantizer_for(4, 128, "k"), quantizer_for(3, 128, "v")
    return kq, vq, sample(11), sample(12)


def _by_the_ops(q, x):
    """``q.encode(x)`` as the ops make it: codes and float16 scales."""
    idx, scale, _ = q.quantize(x.reshape(-1, q.dim))
    lead = x.shape[:-1]
    return pack_indices(idx, q.bits).reshape(*lead, q.words), scale.astype(mx.float16).reshape(lead)


def test_a_layers_keys_and_values_are_encoded_in_one_launch(monkeypatch):
    kq, vq, keys, values = _keys_and_values()
    launches = _kernels_standing_in(monkeypatch)
    got = encode_many([(kq, keys, None), (vq, values, None)])
    # The pair's kernel proven on trial rows of 96 and 91 (each tensor's own kernel is
    # not built), then one launch for the layer's 80 + 80 rows.
    assert launches == [[96, 91], [80, 80]]
    for (codes, scales), q, x in zip(got, (kq, vq), (keys, values)):
        want_codes, want_scales = _by_the_ops(q, x)
        assert codes.shape == (1, 2, 40, q.words) and scales.dtype == mx.float16
        assert mx.array_equal(codes, want_codes).item()
        assert mx.array_equal(scales, want_scales).item()
    encode_many([(kq, keys, None), (vq, values, None)])
    assert launches[-1] == [80, 80] and len(launches) == 3  # proven once per process


def test_together_a_tensors_verdict_is_its_own(monkeypatch):
    kq, vq, keys, values = _keys_and_values()
    _kernels_standing_in(monkeypatch)
    wide = keys.astype(mx.float32) * 1e6  # every key's scale past float16's
    (_, key_scales), (_, value_scales) = encode_many([(kq, wide, None), (vq, values, None)])
    assert key_scales.dtype == mx.float32 and value_scales.dtype == mx.float16
    assert mx.array_equal(value_scales, _by_the_ops(vq, values)[1]).item()
    broken = mx.concatenate(
        [values[:, :, :5], mx.full((1, 2, 1, 128), mx.nan), values[:, :, 6:]], axis=2
    )
    with pytest.raises(EncodingError, match=r"v vectors must be finite.*\(1, 2, 40, 128\) tensor"):
        encode_many([(kq, keys, None), (vq, broken.astype(mx.bfloat16), None)])


def test_a_pair_kernel_that_mixes_its_tensors_up_is_not_used(monkeypatch):
    kq, vq, keys, values = _keys_and_values()

    def mixed_up(tensors, scale_limit):  # the second tensor's rows written as the first's
        made, verdicts = _ops_launch(tensors, scale_limit)
        if len(made) == 2:
            first = made[0]
            made[1] = (first[0][: made[1][0].shape[0]], *made[1][1:])
        return made, verdicts

    launches = _kernels_standing_in(monkeypatch, mixed_up)
    got = encode_many([(kq, keys, None), (vq, values, None)])
    # The pair refused: each tensor's own kernel proven and launched.
    assert launches == [[96, 91], [96], [80], [96], [80]]
    assert ("together", (cuda_rht._config(keys, kq), cuda_rht._config(values, vq)), "60000.0") in (
        key for key, ok in cuda_rht._PROVEN.items() if not ok
    )
    for (codes, scales), q, x in zip(got, (kq, vq), (keys, values)):
        want_codes, want_scales = _by_the_ops(q, x)
        assert mx.array_equal(codes, want_codes).item()
        assert mx.array_equal(scales, want_scales).item()


def test_a_pair_kernels_source_encodes_each_tensor_with_its_own_function():
    configs = ((4, 128, "matched", "bfloat16"), (3, 128, "ls", "float32"))
    name, inputs, outputs, header, body = cuda_rht.encode_parts(configs, FLOAT16_SCALE_LIMIT)
    assert name == "kvstore_tq_rht_encode_4_128_matched_bfloat16_3_128_ls_float32_60000"
    assert inputs == [
        "x0",
        "signs0",
        "thresholds0",
        "centroids0",
        "x1",
        "signs1",
        "thresholds1",
        "centroids1",
    ]
    assert outputs == ["codes0", "scale0", "scale16_0", "codes1", "scale1", "scale16_1", "verdicts"]
    assert "const __nv_bfloat16* x" in header and "const float* x" in header
    for s in (0, 1):
        assert f"__device__ __forceinline__ void kvstore_tq_encode_row_{s}(" in header
        assert f"codes{s}, scale{s}, scale16_{s}, verdicts + start); return; }}" in body
    assert (
        "for (int k = 0; k < 16 - 1; ++k)" in header and "for (int k = 0; k < 8 - 1; ++k)" in header
    )


def _ops_decode_launch(tensors):
    """What one launch of the decode kernel over ``tensors`` returns, made by the ops (a
    stand-in for the kernel on this CPU)."""
    return [
        q._ops_decoded(rows, scales.reshape(-1, 1).astype(mx.float32)).astype(dtype)
        for rows, scales, q, dtype in tensors
    ]


def _decode_kernels_standing_in(monkeypatch, launch=_ops_decode_launch):
    """The decode kernels switched on, each launch made by ``launch``; returns the
    launches, as the tensors' row counts of each."""
    launches = []

    def launched(tensors):
        launches.append([int(rows.shape[0]) for rows, *_ in tensors])
        return launch(tensors)

    monkeypatch.setattr(cuda_rht, "enabled", lambda: True)
    monkeypatch.setattr(cuda_rht, "_decode", launched)
    monkeypatch.setattr(cuda_rht, "_PROVEN", {})
    return launches


def _encoded_layer():
    kq, vq, keys, values = _keys_and_values()
    (kc, ks), (vc, vs) = encode_many([(kq, keys, None), (vq, values, None)])
    want = [kq.decode(kc, ks, mx.bfloat16), vq.decode(vc, vs, mx.bfloat16)]  # the ops'
    return [(kq, kc, ks, mx.bfloat16, None), (vq, vc, vs, mx.bfloat16, None)], want


def test_a_layers_keys_and_values_are_decoded_in_one_launch(monkeypatch):
    items, want = _encoded_layer()
    launches = _decode_kernels_standing_in(monkeypatch)
    got = decode_many(items)
    # The pair's kernel proven on trial rows of 96 and 91, then one launch for 80 + 80.
    assert launches == [[96, 91], [80, 80]]
    for x, w in zip(got, want, strict=True):
        assert x.shape == (1, 2, 40, 128) and x.dtype == mx.bfloat16
        assert mx.array_equal(x, w).item()
    decode_many(items)
    assert launches[-1] == [80, 80] and len(launches) == 3  # proven once per process
    monkeypatch.setenv(cuda_rht.TOGETHER_ENV, "0")  # the A/B switch: a launch each
    decode_many(items)
    assert launches[3:] == [[96], [96], [80], [80]]


def test_a_decode_with_a_key_mean_adds_it_after_the_kernel(monkeypatch):
    items, _ = _encoded_layer()
    mu = mx.arange(2 * 128, dtype=mx.float32).reshape(2, 1, 128) / 256
    items[0] = (*items[0][:4], mu)
    kq, kc, ks = items[0][:3]
    want = kq.decode(kc, ks, mx.bfloat16, mu=mu)  # the ops'
    _decode_kernels_standing_in(monkeypatch)
    keys, _ = decode_many(items)
    assert keys.dtype == mx.bfloat16 and mx.array_equal(keys, want).item()


def test_a_pair_decode_kernel_that_mixes_its_tensors_up_is_not_used(monkeypatch):
    items, want = _encoded_layer()

    def mixed_up(tensors):  # the second tensor's rows written as the first's
        made = _ops_decode_launch(tensors)
        if len(made) == 2:
            made[1] = made[0][: made[1].shape[0]]
        return made

    launches = _decode_kernels_standing_in(monkeypatch, mixed_up)
    got = decode_many(items)
    # The pair refused: each tensor's own kernel proven and launched.
    assert launches == [[96, 91], [96], [80], [96], [80]]
    assert any(key[0] == "decode together" and not ok for key, ok in cuda_rht._PROVEN.items())
    for x, w in zip(got, want, strict=True):
        assert mx.array_equal(x, w).item()


def test_decode_many_refuses_codes_that_do_not_fit_their_quantizer():
    items, _ = _encoded_layer()
    kq, kc, ks = items[0][:3]
    with pytest.raises(EncodingError, match=r"codes must be \[\.\.\., 16\] uint32"):
        decode_many([(kq, kc[..., :8], ks, mx.bfloat16, None), items[1]])


def test_a_pair_decode_kernels_source_decodes_each_tensor_with_its_own_function():
    configs = ((4, 128, "float16", "bfloat16"), (3, 64, "float32", "float32"))
    name, inputs, outputs, header, body = cuda_rht.decode_parts(configs)
    assert name == "kvstore_tq_rht_decode_4_128_float16_bfloat16_3_64_float32_float32"
    assert inputs == [
        "codes0",
        "factors0",
        "table0",
        "signs0",
        "codes1",
        "factors1",
        "table1",
        "signs1",
    ]
    assert outputs == ["out0", "out1"]
    assert "const __half* factors" in header and "__nv_bfloat16* out" in header
    assert "const float* factors" in header and "float* out) {" in header
    for s in (0, 1):
        assert f"__device__ __forceinline__ void kvstore_tq_decode_row_{s}(" in header
        assert f"end += (unsigned long long)codes{s}_shape[0];" in body
        assert f"signs{s}, out{s}); return; }}" in body
