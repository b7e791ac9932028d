"""Level 0: the spec's test vector, relMSE/cosine/slope tables, determinism, edge cases."""

import functools

import mlx.core as mx
import numpy as np
import pytest

from kvstore.errors import EncodingError, KVStoreError
from kvstore.turboquant.codebook import codebook
from kvstore.turboquant.packing import packed_words
from kvstore.turboquant.quantizer import (
    TQ_BITS,
    TurboQuantizer,
    bits_per_value,
    cell_indices,
    encode_many,
    quantizer_for,
)

# -- the spec's D=128 test vector (seed 0, K signs) ------------------------------------------
TEST_VECTOR = {
    3: (
        [4, 7, 3, 3, 4, 4, 2, 5, 4, 2, 5, 3, 1, 1, 7, 6],
        [0x54AA46FC, 0xD96ADC97],
        {"l2": 3.7793, "matched": 3.86719, "ls": 3.80273},
        {"l2": 0.0330, "matched": 0.0333, "ls": 0.0330},
    ),
    4: (
        [8, 15, 7, 7, 9, 8, 5, 10, 8, 5, 9, 6, 3, 2, 14, 13],
        [0xA58977F8, 0xDE236958],
        {"l2": 3.7793, "matched": 3.73828, "ls": 3.7207},
        {"l2": 0.0092, "matched": 0.0090, "ls": 0.0089},
    ),
    2: (
        [2, 3, 1, 1, 2, 2, 1, 2, 2, 1, 2, 1, 0, 0, 3, 3],
        [0xF0669A5E, 0x6EDF02A9],
        {"l2": 3.7793, "matched": 4.21094, "ls": 3.92969},
        {"l2": 0.1307, "matched": 0.1340, "ls": 0.1295},
    ),
}


def spec_vector() -> mx.array:
    j = np.arange(128)
    x = np.sin(0.37 * (j + 1)) + 0.05 * j * (-1.0) ** j
    x[7] += 6
    assert np.linalg.norm(x) == pytest.approx(42.7497, abs=1e-4)
    return mx.array(x.astype(np.float32))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("mode", ["l2", "matched", "ls"])
def test_spec_test_vector(bits, mode):
    idx16, words, scales, rel = TEST_VECTOR[bits]
    x = spec_vector()
    q = TurboQuantizer(bits, 128, "k", seed=0, scale_mode=mode)
    codes, scale = q.encode(x)
    assert codes.shape == (packed_words(128, bits),) and scale.dtype == mx.float16
    assert q.quantize(x)[0][:16].tolist() == idx16
    assert codes[:2].tolist() == words
    # The spec prints the float16 scale to 5-6 significant digits.
    assert scale.item() == pytest.approx(scales[mode], abs=6e-5)
    xh = q.decode(codes, scale)
    assert (mx.sum((x - xh) ** 2) / mx.sum(x * x)).item() == pytest.approx(rel[mode], abs=5e-5)


# -- Level-0 statistics over 20,000 random unit vectors (RHT) ---------------------------------
# The spec's tables stop at 4 bits; the 5-bit column was measured here (issue 17) and
# sits, as the others do, just under the codebook's MSE per coordinate (0.002505).
RELMSE = {
    128: {2: 0.1160, 3: 0.0340, 4: 0.00932, 5: 0.00246},
    64: {2: 0.1148, 3: 0.0335, 4: 0.0092, 5: 0.00243},
    256: {2: 0.1169, 3: 0.0343, 4: 0.0094, 5: 0.00248},
}
MEAN_COS = {2: 0.940, 3: 0.983, 4: 0.9954, 5: 0.9988}
SLOPE = {
    "l2": {2: 0.887, 3: 0.965, 4: 0.990, 5: 0.998},
    "matched": {2: 0.944, 3: 0.982, 4: 0.994, 5: 0.999},
}


@functools.cache
def unit_vectors(dim: int) -> mx.array:
    x = mx.random.normal((20_000, dim), key=mx.random.key(dim))
    return x / mx.linalg.norm(x, axis=-1, keepdims=True)


@functools.cache
def statistics(dim: int, bits: int, mode: str) -> dict[str, float]:
    x = unit_vectors(dim)
    q = TurboQuantizer(bits, dim, "k", scale_mode=mode)
    xh = q.decode(*q.encode(x))
    dot = mx.sum(x * xh, axis=-1)
    return {
        "relmse": mx.mean(mx.sum((x - xh) ** 2, axis=-1)).item(),
        "cos": mx.mean(dot / mx.linalg.norm(xh, axis=-1)).item(),
        # E over isotropic queries q of <q, x^>/<q, x> regressed: <x, x^>/||x||^2.
        "slope": mx.mean(dot).item(),
    }


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("bits", TQ_BITS)
def test_relmse_table(dim, bits):
    assert statistics(dim, bits, "l2")["relmse"] == pytest.approx(RELMSE[dim][bits], rel=0.02)


@pytest.mark.parametrize("bits", TQ_BITS)
def test_mean_cosine_and_inner_product_slopes(bits):
    assert statistics(128, bits, "l2")["cos"] == pytest.approx(MEAN_COS[bits], abs=0.003)
    for mode in ("l2", "matched"):
        assert statistics(128, bits, mode)["slope"] == pytest.approx(SLOPE[mode][bits], abs=0.01)


@pytest.mark.parametrize("dim", [80, 96])
def test_dense_rotation_quality_matches_rht(dim):
    x = mx.random.normal((4000, dim), key=mx.random.key(1))
    q = TurboQuantizer(4, dim, "v", scale_mode="l2")
    assert q.rotation.method == "dense"
    xh = q.decode(*q.encode(x))
    relmse = mx.mean(mx.sum((x - xh) ** 2, -1) / mx.sum(x * x, -1)).item()
    assert relmse == pytest.approx(0.0093, rel=0.05)


@pytest.mark.parametrize(
    "bits,group,expected,rel",
    [(4, 64, 0.0083, 0.03), (4, 128, 0.0100, 0.03), (4, 32, 0.0066, 0.03), (8, 64, 3e-5, 0.1)],
)
def test_affine_anchors_on_gaussian_data(bits, group, expected, rel):
    x = mx.random.normal((20_000, 128), key=mx.random.key(3))
    xh = mx.dequantize(*mx.quantize(x, group_size=group, bits=bits), group_size=group, bits=bits)
    relmse = mx.mean(mx.sum((x - xh) ** 2, -1) / mx.sum(x * x, -1)).item()
    assert relmse == pytest.approx(expected, rel=rel)


# -- determinism, dtypes, edge cases ---------------------------------------------------------
@pytest.mark.parametrize("dim", [64, 80])
def test_encoding_is_deterministic(dim):
    x = mx.random.normal((2, 3, 17, dim)).astype(mx.bfloat16)
    a = TurboQuantizer(3, dim, "v", seed=11).encode(x)
    b = TurboQuantizer(3, dim, "v", seed=11).encode(x)
    c = TurboQuantizer(3, dim, "v", seed=12).encode(x)
    assert all(np.array(u).tobytes() == np.array(v).tobytes() for u, v in zip(a, b))
    assert not mx.array_equal(a[0], c[0]).item()


def test_encode_is_row_wise():
    # A row's codes do not depend on the rows encoded with it (the cache relies on it).
    x = mx.random.normal((1, 2, 40, 128))
    q = quantizer_for(4, 128, "k")
    whole = q.encode(x)
    parts = [q.encode(x[..., i : i + 7, :]) for i in range(0, 40, 7)]
    assert mx.array_equal(whole[0], mx.concatenate([p[0] for p in parts], axis=2)).item()
    assert mx.array_equal(whole[1], mx.concatenate([p[1] for p in parts], axis=2)).item()


def test_cell_indices_ties_go_to_the_lower_cell():
    for bits in TQ_BITS:
        t = mx.array(codebook(bits).thresholds.astype(np.float32))
        assert cell_indices(t, bits).tolist() == list(range(len(t)))
        above = cell_indices(t + 1e-6, bits).tolist()
        assert above == list(range(1, len(t) + 1))


@pytest.mark.parametrize("bits", TQ_BITS)
def test_cell_indices_match_a_float64_search_of_the_table(bits):
    # An independent reader of the table: #{k : t_k < z} by binary search in float64.
    z = np.random.default_rng(bits).standard_normal(50_000).astype(np.float32) * 1.5
    thresholds = codebook(bits).thresholds.astype(np.float32).astype(np.float64)
    expected = np.searchsorted(thresholds, z.astype(np.float64), side="left")
    assert np.array_equal(np.array(cell_indices(mx.array(z), bits)), expected)


@pytest.mark.parametrize("bits", TQ_BITS)
def test_cell_indices_at_the_edges_match_a_float64_search(bits):
    # The mirrored count (3 and 4 bits) compares |z|'s bits and sends z <= 0 the other
    # way: every threshold, its neighbours on both sides, +-0, denormals, with a scale.
    t = codebook(bits).thresholds.astype(np.float32)
    edges = [t, -t, np.nextafter(t, np.float32(9)), np.nextafter(t, np.float32(-9))]
    tiny = [0.0, -0.0, 1e-45, -1e-45, 1e-38, -1e-38, 30.0, -30.0]
    z = np.concatenate([*edges, np.array(tiny, np.float32)]).astype(np.float32)
    thresholds = t.astype(np.float64)
    for scale in (1.0, 0.37):
        scaled = (z * np.float32(scale)).astype(np.float32)  # as the kernel rounds it
        expected = np.searchsorted(thresholds, scaled.astype(np.float64), side="left")
        got = np.array(cell_indices(mx.array(z), bits, scale))
        assert np.array_equal(got, expected), (bits, scale)


def test_zero_vector_has_zero_scale_and_decodes_to_zero():
    for mode in ("l2", "matched", "ls"):
        q = TurboQuantizer(4, 64, "k", scale_mode=mode)
        codes, scale = q.encode(mx.zeros((3, 64)))
        assert scale.tolist() == [0.0, 0.0, 0.0]
        assert mx.array_equal(q.decode(codes, scale), mx.zeros((3, 64))).item()


def test_large_scales_switch_to_float32():
    x = mx.random.normal((4, 128)) * 1e6
    q = TurboQuantizer(4, 128, "k")
    codes, scale = q.encode(x)
    assert scale.dtype == mx.float32
    xh = q.decode(codes, scale)
    assert (mx.sum((x - xh) ** 2) / mx.sum(x * x)).item() < 0.02
    assert q.encode(x / 1e6)[1].dtype == mx.float16


def test_float32_scale_dtype_keeps_the_codes_and_unrounded_scales():
    x = mx.random.normal((4, 128), key=mx.random.key(3))
    wide = TurboQuantizer(3, 128, "v", scale_dtype="float32")
    codes, scale = wide.encode(x)
    narrow_codes, narrow = TurboQuantizer(3, 128, "v").encode(x)
    assert scale.dtype == mx.float32 and mx.array_equal(codes, narrow_codes).item()
    assert mx.array_equal(scale.astype(mx.float16), narrow).item()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises(bad):
    x = mx.random.normal((2, 5, 64))
    x[1, 3, 7] = bad
    with pytest.raises(EncodingError, match=r"\[turboquant.encode\] k vectors must be finite") as e:
        TurboQuantizer(2, 64, "k").encode(x)
    assert isinstance(e.value, ValueError) and isinstance(e.value, KVStoreError)
    assert e.value.shape == (2, 5, 64)


def test_encode_many_is_each_encode_in_order():
    # Keys (centred, 4 bits, D=128, over several blocks) beside values (2 bits, D=64)
    # and a float32-scale quantizer: each result is that tensor's own encode, bit for bit.
    keys = mx.random.normal((1, 2, 3000, 128), key=mx.random.key(1)).astype(mx.bfloat16)
    mu = mx.random.normal((2, 1, 128), key=mx.random.key(2))
    values = mx.random.normal((1, 3, 9, 64), key=mx.random.key(3)) * 7
    wide = TurboQuantizer(3, 64, "v", scale_dtype="float32")
    items = [(quantizer_for(4, 128, "k"), keys, mu), (quantizer_for(2, 64, "v"), values, None)]
    items.append((wide, values, None))
    together = encode_many(items)
    alone = [q.encode(x, mu=m) for q, x, m in items]
    assert len(together) == 3
    for (codes, scales), (codes1, scales1) in zip(together, alone, strict=True):
        assert codes.dtype == codes1.dtype and scales.dtype == scales1.dtype
        assert np.array(codes).tobytes() == np.array(codes1).tobytes()
        assert np.array(scales).tobytes() == np.array(scales1).tobytes()
    assert together[1][1].dtype == mx.float16 and together[2][1].dtype == mx.float32


@pytest.mark.parametrize(("bits", "kind"), [(4, "k"), (3, "v"), (2, "k")])
def test_compiled_block_ops_give_the_plain_ops_bytes(bits, kind):
    # On the CPU a power-of-two block runs its ops compiled (fused kernels); the bytes
    # must be the plain ops' (no contraction or reordering changes a scale or a cell).
    from kvstore.turboquant import quantizer as module

    q = quantizer_for(bits, 128, kind)
    for rows in (8, 512):
        assert module._compiling(rows) and not module._compiling(rows - 1)
        x = mx.random.normal((rows, 128), key=mx.random.key(rows)).astype(mx.bfloat16)
        compiled, plain = q._compiled_ops_encode(x), q._ops_encoded(x)
        for a, b in zip(compiled, plain, strict=True):
            assert np.array(a).tobytes() == np.array(b).tobytes()
        codes, factors = plain[0], plain[2][:, None].astype(mx.float32)
        got = q._compiled_ops_decode(codes, factors)
        assert np.array(got).tobytes() == np.array(q._ops_decoded(codes, factors)).tobytes()


def test_the_worst_verdict_of_any_block_decides_the_whole_tensor():
    # Rows over several blocks: one wide row in the last makes every scale of the tensor
    # float32 (bit for bit a float32-scale quantizer's), and a NaN beside it raises.
    x = mx.random.normal((1, 2, 3000, 128), key=mx.random.key(5))
    from kvstore.turboquant import quantizer as module

    x[0, 1, 2990] = x[0, 1, 2990] * 1e6
    assert len(module._row_blocks(6000, 128)) > 1
    codes, scales = quantizer_for(4, 128, "k").encode(x)
    wide_codes, wide_scales = TurboQuantizer(4, 128, "k", scale_dtype="float32").encode(x)
    assert scales.dtype == mx.float32
    assert np.array(codes).tobytes() == np.array(wide_codes).tobytes()
    assert np.array(scales).tobytes() == np.array(wide_scales).tobytes()
    x[0, 0, 5, 0] = float("nan")
    with pytest.raises(EncodingError, match=r"k vectors must be finite"):
        quantizer_for(4, 128, "k").encode(x)


def test_encode_many_names_the_tensor_at_fault():
    good = mx.random.normal((1, 2, 40, 64))
    bad = mx.random.normal((1, 2, 40, 64))
    bad[0, 1, 3, 5] = float("nan")
    items = [(quantizer_for(3, 64, "k"), good, None), (quantizer_for(3, 64, "v"), bad, None)]
    with pytest.raises(EncodingError, match=r"\[turboquant.encode\] v vectors must be finite"):
        encode_many(items)


def test_shape_errors():
    q = TurboQuantizer(3, 64, "v")
    with pytest.raises(EncodingError, match="vectors must have D=64") as e:
        q.encode(mx.zeros((2, 32)))
    assert (e.value.found, e.value.expected) == (32, 64)
    with pytest.raises(EncodingError, match=r"codes must be \[..., 6\] uint32"):
        q.decode(mx.zeros((2, 5), mx.uint32), mx.zeros((2,)))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(bits=6, dim=64), "bits must be one of 2, 3, 4, 5; received 6"),
        (dict(bits=1, dim=64), "bits must be one of 2, 3, 4, 5; received 1"),
        (dict(bits=4, dim=64, scale_mode="rms"), "scale_mode must be one of l2, matched, ls"),
        (dict(bits=4, dim=64, scale_dtype="bfloat16"), "scale_dtype must be 'float16' or"),
    ],
)
def test_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TurboQuantizer(**kwargs)


def test_default_scale_modes_and_centering():
    assert TurboQuantizer(4, 64, "k").scale_mode == "matched"
    assert TurboQuantizer(4, 64, "v").scale_mode == "ls"
    # Biased keys: centering turns the error back into the table value.
    rng = np.random.default_rng(0)
    mu = mx.array((20 * rng.standard_normal(64)).astype(np.float32))
    k = mx.random.normal((2000, 64)) + mu
    q = TurboQuantizer(3, 64, "k")
    plain = q.decode(*q.encode(k))
    centred = q.decode(*q.encode(k, mu=mu), mu=mu)
    spread = mx.sum((k - mu) ** 2).item()
    assert mx.sum((k - plain) ** 2).item() / spread > 5  # informative error blown up
    assert mx.sum((k - centred) ** 2).item() / spread == pytest.approx(0.034, rel=0.1)


def test_bits_per_value_is_the_p7_formula():
    assert bits_per_value(4, 128) == 4 + 16 / 128
    assert bits_per_value(3, 128) == 3.125 and bits_per_value(2, 128) == 2.125
    assert bits_per_value(5, 128) == 5.125 and bits_per_value(5, 64) == 5.25
    assert bits_per_value(4, 64, scale_bytes=4) == 4.5


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="needs the Metal GPU")
@pytest.mark.parametrize("bits", TQ_BITS)
def test_cpu_and_gpu_decode_agree_within_one_fp16_ulp(bits):
    q = TurboQuantizer(bits, 128, "v")
    codes, scales = q.encode(mx.random.normal((64, 128)))
    with mx.stream(mx.cpu):
        cpu = q.decode(codes, scales, mx.float16)
    with mx.stream(mx.gpu):
        gpu = q.decode(codes, scales, mx.float16)
    ulp = mx.abs(cpu.astype(mx.float32)) * 2.0**-10 + 2.0**-24
    assert mx.all(mx.abs(cpu.astype(mx.float32) - gpu.astype(mx.float32)) <= ulp).item()
