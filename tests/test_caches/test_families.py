"""Behaviour of every cache family: growth, trim, head dims, state, copies."""

import copy

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from kvstore.caches import KVCache, QuantizedKVCache, RotatingKVCache, RotatingQuantizedKVCache
from kvstore.caches.quantized import packed_width
from kvstore.errors import CapabilityError
from tests.markers import needs_tested_mlx_lm

FAMILIES = {
    "plain": lambda: KVCache(),
    "quant-4-64": lambda: QuantizedKVCache(64, 4),
    "quant-5-32": lambda: QuantizedKVCache(32, 5),
    "quant-6-64": lambda: QuantizedKVCache(64, 6),
    "quant-3-32": lambda: QuantizedKVCache(32, 3),
    "rotating": lambda: RotatingKVCache(64, keep=4),
    "rotating-quant-8-64": lambda: RotatingQuantizedKVCache(64, keep=4, bits=8),
    "rotating-quant-5-32": lambda: RotatingQuantizedKVCache(64, keep=2, bits=5, group_size=32),
}


def rows(n, d=64, h=2, dtype=mx.float16):
    return mx.random.normal((1, h, n, d)).astype(dtype)


def logical_nbytes(cache):
    return sum(a.nbytes for _, a in tree_flatten(cache.keys_and_values()))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_bytes_per_token_equals_logical_growth(family, dtype):
    cache = FAMILIES[family]()
    assert cache.bytes_per_token() == 0 and cache.empty()
    cache.update_and_fetch(rows(5, dtype=dtype), rows(5, dtype=dtype))
    before = logical_nbytes(cache)
    for _ in range(3):
        cache.update_and_fetch(rows(1, dtype=dtype), rows(1, dtype=dtype))
        after = logical_nbytes(cache)
        assert after - before == cache.bytes_per_token() > 0
        before = after


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_packed_width_is_ceil(bits, head_dim):
    cache = QuantizedKVCache(32, bits)
    k, _ = cache.update_and_fetch(rows(3, head_dim), rows(3, head_dim))
    assert k[0].shape[-1] == packed_width(head_dim, bits) == -(-head_dim * bits // 32)
    assert k[1].shape[-1] == head_dim // 32
    deq = mx.dequantize(*k, group_size=32, bits=bits)
    assert deq.shape == (1, 2, 3, head_dim)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_head_dims_run_or_raise_capability_error(family, head_dim):
    cache = FAMILIES[family]()
    group = getattr(cache, "group_size", None)
    if group is not None and head_dim % group:
        with pytest.raises(CapabilityError, match=f"head_dim {head_dim}") as info:
            cache.update_and_fetch(rows(3, head_dim), rows(3, head_dim))
        fits = [g for g in (32, 64, 128) if head_dim % g == 0]
        assert info.value.fitting_groups == fits
        if not fits:
            assert "no affine group fits" in str(info.value)
        return
    for n in (7, 1, 1, 70, 1):
        keys, values = cache.update_and_fetch(rows(n, head_dim), rows(n, head_dim))
    assert cache.offset == 80


def test_plain_trim_returns_count_and_reuses_rows():
    cache = KVCache()
    a, b = rows(10), rows(3)
    cache.update_and_fetch(a, a)
    assert cache.trim(4) == 4 and cache.offset == 6
    assert cache.trim(100) == 6 and cache.offset == 0
    cache.update_and_fetch(b, b)
    k, _ = cache.update_and_fetch(a[..., :2, :], a[..., :2, :])
    assert mx.array_equal(k, mx.concatenate([b, a[..., :2, :]], axis=2)).item()


@pytest.mark.parametrize("family", ["quant-4-64", "rotating", "rotating-quant-8-64"])
def test_trim_then_continue_matches_never_having_had_the_tokens(family):
    x = rows(20)
    trimmed, fresh = FAMILIES[family](), FAMILIES[family]()
    trimmed.update_and_fetch(x, x)
    assert trimmed.trim(5) == 5
    fresh.update_and_fetch(x[..., :15, :], x[..., :15, :])
    y = rows(1)
    a, b = trimmed.update_and_fetch(y, y), fresh.update_and_fetch(y, y)
    for u, v in zip(tree_flatten(a), tree_flatten(b)):
        assert mx.array_equal(u[1], v[1]).item()


@pytest.mark.parametrize("family", ["rotating", "rotating-quant-8-64"])
def test_rotating_refuses_trim_after_wrap(family):
    cache = FAMILIES[family]()  # max_size 64
    cache.update_and_fetch(rows(63), rows(63))
    assert cache.is_trimmable()
    cache.update_and_fetch(rows(1), rows(1))
    assert not cache.is_trimmable()
    with pytest.raises(CapabilityError, match="after the window wrapped"):
        cache.trim(1)
    assert cache.offset == 64


@pytest.mark.parametrize("family", list(FAMILIES))
def test_deepcopy_is_independent(family):
    cache = FAMILIES[family]()
    x = rows(10)
    cache.update_and_fetch(x, x)
    clone = copy.deepcopy(cache)
    before = [a for _, a in tree_flatten(clone.keys_and_values())]
    cache.trim(2) if cache.is_trimmable() else None
    cache.update_and_fetch(rows(4), rows(4))
    after = [a for _, a in tree_flatten(clone.keys_and_values())]
    assert clone.offset == 10
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, after))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_state_round_trip(family):
    cache = FAMILIES[family]()
    for n in (40, 1, 1, 30, 1):
        cache.update_and_fetch(rows(n), rows(n))
    clone = type(cache).from_state(cache.state)
    assert clone.signature() == cache.signature() and clone.offset == cache.offset
    y = rows(1)
    a, b = cache.update_and_fetch(y, y), clone.update_and_fetch(y, y)
    for u, v in zip(tree_flatten(a), tree_flatten(b)):
        assert mx.array_equal(u[1], v[1]).item()


def test_rotating_window_and_keep():
    cache = RotatingKVCache(8, keep=2)
    tokens = mx.arange(20, dtype=mx.float32).reshape(1, 1, 20, 1)
    for i in range(20):
        cache.update_and_fetch(tokens[..., i : i + 1, :], tokens[..., i : i + 1, :])
    assert cache.size() == 8 and cache.offset == 20
    k, _ = cache.temporal_keys_and_values()
    assert k.reshape(-1).tolist() == [0, 1, 14, 15, 16, 17, 18, 19]


def test_rotating_make_mask_is_window_aware():
    cache = RotatingKVCache(8)
    x = rows(12)
    cache.update_and_fetch(x, x)
    mask = cache.make_mask(4, window_size=8)
    assert mask.shape == (4, 11)  # offset clamps to max_size - 1
    assert mask[0].tolist() == [True] * 8 + [False] * 3
    assert mask[3].tolist() == [False] * 3 + [True] * 8


@pytest.mark.parametrize("bad", [dict(bits=7), dict(group_size=48)])
def test_quantized_rejects_bad_parameters(bad):
    with pytest.raises(ValueError, match="must be one of"):
        QuantizedKVCache(**bad)
    with pytest.raises(ValueError, match="must be one of"):
        RotatingQuantizedKVCache(16, **bad)


@needs_tested_mlx_lm
def test_our_caches_load_in_stock_mlx_lm(tmp_path):
    lm = pytest.importorskip("mlx_lm.models.cache")
    caches = [KVCache(), QuantizedKVCache(64, 4), RotatingKVCache(32, keep=4)]
    x = rows(40)
    for c in caches:
        c.update_and_fetch(x, x)
    path = str(tmp_path / "c.safetensors")
    lm.save_prompt_cache(path, caches)
    loaded = lm.load_prompt_cache(path)
    assert [type(c).__module__ for c in loaded] == ["mlx_lm.models.cache"] * 3
    for ours, theirs in zip(caches, loaded):
        assert ours.offset == theirs.offset
        for u, v in zip(tree_flatten(ours.state), tree_flatten(theirs.state)):
            assert mx.array_equal(u[1], v[1]).item()


def test_to_quantized_matches_mlx_lm_and_extends_to_rings():
    lm = pytest.importorskip("mlx_lm.models.cache")
    x = rows(40)
    ours, theirs = KVCache(), lm.KVCache()
    ours.update_and_fetch(x, x)
    theirs.update_and_fetch(x, x)
    q_ours, q_theirs = ours.to_quantized(64, 4), theirs.to_quantized(64, 4)
    y = rows(1)
    for u, v in zip(
        tree_flatten(q_ours.update_and_fetch(y, y)), tree_flatten(q_theirs.update_and_fetch(y, y))
    ):
        assert mx.array_equal(u[1], v[1]).item()

    ring = RotatingKVCache(16, keep=2)
    for n in (20, 1, 1):
        ring.update_and_fetch(rows(n), rows(n))
    q_ring = ring.to_quantized(64, 8)
    assert q_ring.signature() == "kv:rotating-quant:8:64"
    assert (q_ring.offset, q_ring.size()) == (ring.offset, ring.size())
    plain_k, _ = ring.temporal_keys_and_values()
    quant_k, _ = q_ring.temporal_keys_and_values()
    err = mx.abs(mx.dequantize(*quant_k, group_size=64, bits=8) - plain_k).max().item()
    assert 0 < err < 0.05
