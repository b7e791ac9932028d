"""The MLX microscaling families (``kv:mxfp8``, ``kv:mxfp4``, ``kv:nvfp4`` and windowed
twins): what they declare, what they store, and where the rest of kvstore takes them."""

import mlx.core as mx
import pytest

from kvstore.abc.cache import (
    family_of,
    is_sliding_window_cache,
    quantized_attention_params,
    uses_dense_attention,
    uses_quantized_attention,
)
from kvstore.caches import (
    MXFP4KVCache,
    MXFP8KVCache,
    NVFP4KVCache,
    RotatingMXFP4KVCache,
    RotatingMXFP8KVCache,
    RotatingNVFP4KVCache,
)
from kvstore.codecs import restore, snapshot, snapshot_held, transcode_measured
from kvstore.errors import CapabilityError
from kvstore.store.kv.policy import stored_signature
from kvstore.store.maintenance.migrate.targets import target_for
from kvstore.store.settings import parse_storage_policy
from kvstore.testing.codec import assert_snapshots_equal, check_continue

#: mode -> (growing class, windowed class, bits, group)
MODES = {
    "mxfp8": (MXFP8KVCache, RotatingMXFP8KVCache, 8, 32),
    "mxfp4": (MXFP4KVCache, RotatingMXFP4KVCache, 4, 32),
    "nvfp4": (NVFP4KVCache, RotatingNVFP4KVCache, 4, 16),
}


def rows(n, d=64, h=2, dtype=mx.bfloat16, seed=0):
    return mx.random.normal((1, h, n, d), key=mx.random.key(seed)).astype(dtype)


@pytest.mark.parametrize("mode", list(MODES))
def test_what_each_family_declares(mode):
    grow_cls, ring_cls, bits, group = MODES[mode]
    grow, ring = grow_cls(), ring_cls(32, keep=2)
    assert (grow.signature(), ring.signature()) == (f"kv:{mode}", f"kv:rotating-{mode}")
    assert family_of(ring).window_of == f"kv:{mode}"
    assert is_sliding_window_cache(ring) and not is_sliding_window_cache(grow)
    for cache in (grow, ring):
        q = quantized_attention_params(cache)
        assert (q.mode, q.bits, q.group_size) == (mode, bits, group)
        assert uses_quantized_attention(cache) and not uses_dense_attention(cache)
        # No bits/group_size attributes: mlx-lm would route on them into affine attention.
        assert not hasattr(cache, "bits") and not hasattr(cache, "group_size")
    assert family_of(grow).lossy and family_of(grow).storage_policy
    assert not family_of(ring).storage_policy


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rows_are_what_mx_quantize_gives_and_bytes_per_token_counts_them(mode, head_dim):
    grow_cls, _, bits, group = MODES[mode]
    cache, x = grow_cls(), rows(5, head_dim)
    keys, _ = cache.update_and_fetch(x, x)
    want = mx.quantize(x, mode=mode)
    assert len(keys) == 2  # packed words and scales; no biases
    assert all(mx.array_equal(k[:, :, :5], w).item() for k, w in zip(keys, want, strict=True))
    assert keys[1].dtype == mx.uint8 and cache.dtype_name == "bfloat16"
    heads = 2
    per_side = heads * (head_dim * bits // 8 + head_dim // group)
    assert cache.bytes_per_token() == 2 * per_side


@pytest.mark.parametrize("mode", list(MODES))
def test_a_group_that_does_not_divide_head_dim_is_a_capability_error(mode):
    grow_cls, _, _, group = MODES[mode]
    with pytest.raises(CapabilityError, match=f"group_size {group} does not divide head_dim 40"):
        grow_cls().update_and_fetch(rows(3, 40), rows(3, 40))


@pytest.mark.parametrize("mode", list(MODES))
def test_a_restore_is_bit_exact_and_keeps_the_models_dtype(mode):
    grow_cls, ring_cls, _, _ = MODES[mode]
    for cache in (grow_cls(), ring_cls(16, keep=2)):  # the ring wraps and rotates
        for n in (20, 1, 1):
            cache.update_and_fetch(rows(n, dtype=mx.float16, seed=n), rows(n, dtype=mx.float16))
        held = snapshot_held(cache)
        assert {s.meta["dtype"] for s in held} == {"float16"}
        again = restore(held)
        assert again.dtype_name == "float16" and again.offset == cache.offset
        assert_snapshots_equal(snapshot_held(again), held)
        check_continue(cache, again, [1, 3, 1], dtype=mx.float16)


@pytest.mark.parametrize("mode", list(MODES))
def test_storage_policy_and_migration_target(mode):
    assert parse_storage_policy(f"kv:{mode}") == f"kv:{mode}"
    with pytest.raises(Exception, match="storage_policy"):
        parse_storage_policy(f"kv:rotating-{mode}")  # a policy names the growing family
    assert stored_signature("kv:plain", f"kv:{mode}") == f"kv:{mode}"
    assert stored_signature("kv:rotating-plain", f"kv:{mode}") == f"kv:rotating-{mode}"
    assert stored_signature("kv:quant:8:64", f"kv:{mode}") == "kv:quant:8:64"  # kept as it is
    assert target_for("kv:rotating-plain", f"kv:{mode}") == f"kv:rotating-{mode}"
    assert target_for("kv:plain", f"kv:rotating-{mode}") == f"kv:{mode}"


def test_transcoding_plain_rows_loses_what_the_bits_say():
    from kvstore.caches import KVCache

    plain = KVCache()
    plain.update_and_fetch(rows(64), rows(64, seed=1))
    errors = {
        mode: transcode_measured(snapshot(plain), f"kv:{mode}").relative_mse["keys"]
        for mode in MODES
    }
    assert 0 < errors["mxfp8"] < errors["nvfp4"] < errors["mxfp4"] < 0.05
