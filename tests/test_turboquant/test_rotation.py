"""Level 0: SplitMix64 and sign test vectors; R is orthogonal and the spec's transform."""

import math

import mlx.core as mx
import numpy as np
import pytest

from kvstore.turboquant.rotation import (
    Rotation,
    dense_rotation_matrix,
    rotation_for,
    sign_vector,
    splitmix64,
)


def sylvester(n):
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def signs_text(v):
    return "".join("+" if s > 0 else "-" for s in v)


def test_splitmix64_from_state_zero():
    stream = splitmix64(0)
    assert [next(stream) for _ in range(2)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]


def test_sign_vectors_match_spec():
    assert signs_text(sign_vector(32, 0, "k")) == "++-+--+-+-++-+-+++-+--+--+-++-+-"
    assert signs_text(sign_vector(32, 0, "v")) == "+++-++-+-+---++-++-+-++--+++++--"
    # A longer vector extends the same stream; other seeds and rounds differ.
    assert np.array_equal(sign_vector(128, 0, "k")[:32], sign_vector(32, 0, "k"))
    assert not np.array_equal(sign_vector(64, 1, "k"), sign_vector(64, 0, "k"))
    assert not np.array_equal(sign_vector(64, 0, "k", 1), sign_vector(64, 0, "k", 0))
    assert sign_vector(64, 0, "k").dtype == np.int8


@pytest.mark.parametrize("dim", [32, 64, 128, 256])
def test_rht_is_the_spec_formula(dim):
    x = np.random.default_rng(dim).standard_normal((5, dim)).astype(np.float32)
    s = sign_vector(dim, 0, "k").astype(np.float64)
    expected = (sylvester(dim) @ (s * x).T).T / math.sqrt(dim)
    rot = rotation_for(dim, "k")
    assert rot.method == "rht" and rot.rounds == 1
    assert np.max(np.abs(np.array(rot.forward(mx.array(x))) - expected)) < 1e-5


def test_two_rounds_compose_independent_sign_vectors():
    x = mx.random.normal((4, 64))
    one = Rotation(64, signs=sign_vector(64, 0, "v", 0)[None])
    two = Rotation(64, signs=sign_vector(64, 0, "v", 1)[None])
    both = rotation_for(64, "v", 0, rounds=2)
    assert both.rounds == 2
    assert mx.allclose(both.forward(x), two.forward(one.forward(x)), atol=1e-6).item()


@pytest.mark.parametrize("dim,rounds", [(64, 1), (128, 2), (80, 1), (96, 1), (112, 1)])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_rotation_is_orthogonal(dim, rounds, kind):
    rot = rotation_for(dim, kind, 7, rounds)
    assert rot.method == ("rht" if dim in (64, 128) else "dense")
    x = mx.random.normal((50, dim))
    y = rot.forward(x)
    assert mx.allclose(mx.linalg.norm(y, axis=-1), mx.linalg.norm(x, axis=-1), rtol=1e-5).item()
    assert mx.abs(rot.inverse(y) - x).max().item() < 1e-5


def test_dense_rotation_reference_generation():
    m = dense_rotation_matrix(80, seed=3, kind="v")
    assert m.dtype == np.float32 and m.shape == (80, 80)
    rng = np.random.default_rng(3 ^ 1)
    q, r = np.linalg.qr(rng.standard_normal((80, 80)))
    assert np.array_equal(m, (q * np.sign(np.diag(r))).astype(np.float32))
    assert np.abs(m.astype(np.float64) @ m.T.astype(np.float64) - np.eye(80)).max() < 1e-5
    # R(x) = M x, and a reader uses the stored matrix as is.
    x = np.random.default_rng(0).standard_normal((3, 80)).astype(np.float32)
    stored = Rotation(80, matrix=m)
    assert np.allclose(np.array(stored.forward(mx.array(x))), x @ m.T, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(dim=64, kind="q"), "kind must be 'k' or 'v'"),
        (dict(dim=64, rounds=3), "rounds must be 1 or 2"),
        (dict(dim=0), "dim must be a positive int"),
    ],
)
def test_bad_rotation_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rotation_for(**kwargs)


def test_rotation_needs_exactly_one_representation():
    with pytest.raises(ValueError, match="exactly one of signs and matrix"):
        Rotation(64)
    with pytest.raises(ValueError, match="rht needs a power-of-two dim"):
        Rotation(80, signs=np.ones((1, 80), np.int8))
    with pytest.raises(ValueError, match=r"dense needs a \[80, 80\] matrix"):
        Rotation(80, matrix=np.eye(64, dtype=np.float32))
