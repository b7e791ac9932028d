"""The TurboQuant cache families: storage, incremental decode, ring consistency,
state, and logits through mlx-lm models."""

import copy

import mlx.core as mx
import pytest

from kvstore.abc.cache import (
    can_trim,
    is_sliding_window_cache,
    is_turboquant_cache,
    signature_string,
    uses_dense_attention,
    uses_quantized_attention,
)
from kvstore.caches import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    RotatingTurboQuantKVCache,
    TurboQuantKVCache,
)
from kvstore.errors import CapabilityError, EncodingError
from kvstore.testing.mlx_lm_models import build_mlx_lm_model
from kvstore.turboquant.packing import packed_words

# mlx-lm (a dev dependency) is the oracle here as in the parity suite, whose
# teacher-forced run (64-token prefill, 16 single steps) and prompts we reuse.
from tests.test_caches.test_parity_mlx_lm import prompt, run

FAMILIES = {
    "tq-4-4": lambda: TurboQuantKVCache(4, 4),
    "tq-3-2": lambda: TurboQuantKVCache(3, 2, seed=5),
    "tq-2-4-centred": lambda: TurboQuantKVCache(2, 4, center=True),
    "rot-tq-4-3": lambda: RotatingTurboQuantKVCache(24, keep=4, kbits=4, vbits=3),
    "rot-tq-3-3-centred": lambda: RotatingTurboQuantKVCache(16, kbits=3, vbits=3, center=True),
    "tq-5-4": lambda: TurboQuantKVCache(5, 4),  # 5 bits: not in the spec (issue 17)
    "rot-tq-4-5": lambda: RotatingTurboQuantKVCache(24, keep=4, kbits=4, vbits=5),
}


def rows(n, d=64, h=2, dtype=mx.float16, seed=None):
    key = None if seed is None else mx.random.key(seed)
    return mx.random.normal((1, h, n, d), key=key).astype(dtype)


def by_hand(cache, stored):
    """Decode a cache's stored ``((codes, scales), (codes, scales))`` with the quantizers."""
    (kc, ks), (vc, vs) = stored
    kq, vq = cache.quantizers(cache.head_dim)
    mu = None if cache.mu is None else cache.mu[:, None, :]
    return kq.decode(kc, ks, cache.dtype, mu=mu), vq.decode(vc, vs, cache.dtype)


def fetched_rows(cache):
    """What the last fetch returned, recomputed from the row trees (ring order)."""
    k, v = cache.keys_and_values()
    return k[2], v[2]


def stored_rows(cache):
    (kc, ks, _), (vc, vs, _) = cache.keys_and_values()
    return (kc, ks[..., 0]), (vc, vs[..., 0])


def assert_equal(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert mx.array_equal(a, b).item(), f"max |diff| = {mx.abs(a - b).max().item()}"


# -- identity and routing ------------------------------------------------------------------
def test_signatures_and_predicates():
    growing, ring = TurboQuantKVCache(4, 3), RotatingTurboQuantKVCache(32, kbits=2, vbits=4)
    assert signature_string(growing) == "kv:turboquant:4:3"
    assert signature_string(ring) == "kv:rotating-turboquant:2:4"
    for cache in (growing, ring):
        assert is_turboquant_cache(cache) and uses_dense_attention(cache)
        assert not uses_quantized_attention(cache)
        # mlx-lm routes on hasattr(cache, "bits"): these must take the plain SDPA path.
        assert not hasattr(cache, "bits") and not hasattr(cache, "group_size")
    assert is_sliding_window_cache(ring) and not is_sliding_window_cache(growing)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: TurboQuantKVCache(6, 4), "kbits must be one of 2, 3, 4, 5; received 6"),
        (lambda: TurboQuantKVCache(4, 1), "vbits must be one of 2, 3, 4, 5; received 1"),
        (lambda: RotatingTurboQuantKVCache(8, kbits=8), "kbits must be one of 2, 3, 4, 5"),
        (lambda: TurboQuantKVCache(4, 4, key_scale_mode="max"), "key_scale_mode must be one of"),
        (lambda: TurboQuantKVCache(4, 4, seed=-1), "seed must be a uint64 int"),
        (lambda: RotatingTurboQuantKVCache(0), "max_size must be a positive int"),
    ],
)
def test_bad_parameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# -- storage -------------------------------------------------------------------------------
@pytest.mark.parametrize("kbits,vbits", [(4, 4), (4, 3), (3, 3), (2, 2), (5, 4), (5, 5)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_stored_arrays_and_bytes_per_token_formula(kbits, vbits, head_dim):
    cache = TurboQuantKVCache(kbits, vbits)
    assert cache.bytes_per_token() == 0 and cache.nbytes == 0
    cache.update_and_fetch(rows(10, head_dim, h=3), rows(10, head_dim, h=3))
    (kc, ks), (vc, vs) = cache.encoded_rows()
    assert kc.dtype == vc.dtype == mx.uint32 and ks.dtype == vs.dtype == mx.float16
    assert kc.shape == (1, 3, 256, packed_words(head_dim, kbits)) and ks.shape == (1, 3, 256)
    assert vc.shape[-1] == packed_words(head_dim, vbits)
    # P7: b + 16/D bits per value, per head, for keys and values.
    formula = 3 * sum((b + 16 / head_dim) * head_dim / 8 for b in (kbits, vbits))
    assert cache.bytes_per_token() == formula
    assert cache.nbytes == 256 * formula  # capacity, as mlx-lm reports nbytes


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fetch_is_the_stored_codes_decoded_by_hand(family):
    cache = FAMILIES[family]()
    for n in (40, 1, 1, 7, 1, 30, 1, 1, 3):  # prefill, steps, chunks; rings wrap
        k, v = cache.update_and_fetch(rows(n), rows(n))
        hand_k, hand_v = by_hand(cache, stored_rows(cache))
        assert_equal(k, hand_k)
        assert_equal(v, hand_v)
    assert k.dtype == mx.float16


@pytest.mark.parametrize("window,keep", [(16, 0), (24, 4)])
def test_ring_keeps_the_codes_of_the_window_after_wraps(window, keep):
    """Codes are row-wise, so in temporal order the ring must hold exactly the
    codes of the sink tokens and of the last tokens, however it got there."""
    cache = RotatingTurboQuantKVCache(window, keep=keep, kbits=3, vbits=4)
    seen = []
    for i, n in enumerate((5, 1, 30, 1, 1, 1, 9, 1, 2, 1)):
        x = rows(n, seed=i)
        seen.append(x)
        cache.update_and_fetch(x, 2 * x)
    tokens = mx.concatenate(seen, axis=2)
    k, v = cache.temporal_keys_and_values()
    kept = k[0].shape[2]
    assert kept == min(window, tokens.shape[2])
    want = mx.concatenate(
        [tokens[..., :keep, :], tokens[..., tokens.shape[2] - kept + keep :, :]], 2
    )
    kq, vq = cache.quantizers(64)
    assert_equal(k[0], kq.encode(want)[0])
    assert_equal(v[0], vq.encode(2 * want)[0])
    assert_equal(k[2], kq.decode(*kq.encode(want), mx.float16))


def test_scales_widen_to_float32_when_a_chunk_needs_it():
    cache = TurboQuantKVCache(4, 4)
    x = rows(5, dtype=mx.float32)
    cache.update_and_fetch(x, x)
    before = cache.encoded_rows()[0][1][..., :5]
    assert before.dtype == mx.float16
    big = rows(2, dtype=mx.float32) * 1e7
    k, _ = cache.update_and_fetch(big, x[..., :2, :])
    (kc, ks), (vc, vs) = cache.encoded_rows()
    assert ks.dtype == mx.float32 and vs.dtype == mx.float16
    assert mx.array_equal(ks[..., :5], before.astype(mx.float32)).item()
    assert_equal(k, by_hand(cache, stored_rows(cache))[0])
    assert (mx.sum((k[..., 5:, :] - big) ** 2) / mx.sum(big * big)).item() < 0.02


def test_non_finite_rows_raise_and_leave_the_cache_unchanged():
    cache = TurboQuantKVCache(4, 4)
    cache.update_and_fetch(rows(3), rows(3))
    bad = rows(1)
    bad[0, 1, 0, 5] = float("nan")
    with pytest.raises(EncodingError, match="vectors must be finite"):
        cache.update_and_fetch(rows(1), bad)
    assert cache.offset == 3


# -- mlx-lm cache protocol -----------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_state_round_trip_continues_identically(family):
    cache = FAMILIES[family]()
    for n in (40, 1, 1, 30, 1):
        cache.update_and_fetch(rows(n), rows(n))
    clone = type(cache).from_state(cache.state)
    assert clone.signature() == cache.signature() and clone.offset == cache.offset
    assert clone.nbytes == cache.nbytes and clone.bytes_per_token() == cache.bytes_per_token()
    for a, b in zip(fetched_rows(cache), fetched_rows(clone)):
        assert_equal(a, b)
    for n in (1, 5, 1):
        y = rows(n)
        for a, b in zip(cache.update_and_fetch(y, y), clone.update_and_fetch(y, y)):
            assert_equal(a, b)


def test_state_of_an_empty_cache_round_trips():
    empty = TurboQuantKVCache(3, 2, seed=9, value_scale_mode="l2", center=True)
    clone = TurboQuantKVCache.from_state(empty.state)
    assert clone.empty() and clone.signature() == "kv:turboquant:3:2" and clone.seed == 9
    assert clone.center and clone.value_scale_mode == "l2"
    clone.update_and_fetch(rows(2), rows(2))
    assert clone.offset == 2 and clone.mu is not None


def test_state_carries_scales_as_b_h_t_and_the_options():
    cache = TurboQuantKVCache(4, 4, center=True)
    cache.update_and_fetch(rows(6) + 3, rows(6))
    (kc, ks), _, offset, kbits, vbits, seed, kmode, vmode, center, dtype, dim, mu, rounds = (
        cache.state
    )
    assert ks.shape == (1, 2, 256) and offset == 6 and (kbits, vbits, seed) == (4, 4, 0)
    assert (kmode, vmode, center, dtype, dim) == ("matched", "ls", True, "float16", 64)
    assert mu.shape == (2, 64) and mu.dtype == mx.float32 and rounds == 1


@pytest.mark.parametrize("family", ["tq-3-2", "rot-tq-4-3"])
def test_trim_then_continue_matches_never_having_had_the_tokens(family):
    x = rows(20)
    trimmed, fresh = FAMILIES[family](), FAMILIES[family]()
    trimmed.update_and_fetch(x, x)
    assert can_trim(trimmed) and trimmed.trim(5) == 5
    fresh.update_and_fetch(x[..., :15, :], x[..., :15, :])
    y = rows(1)
    for a, b in zip(trimmed.update_and_fetch(y, y), fresh.update_and_fetch(y, y)):
        assert_equal(a, b)


def test_ring_refuses_trim_after_wrap():
    cache = RotatingTurboQuantKVCache(8, kbits=2, vbits=2)
    cache.update_and_fetch(rows(9), rows(9))
    assert not can_trim(cache)
    with pytest.raises(CapabilityError, match="after the window wrapped"):
        cache.trim(1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_deepcopy_is_independent(family):
    cache = FAMILIES[family]()
    cache.update_and_fetch(rows(10), rows(10))
    clone = copy.deepcopy(cache)
    before = [mx.array(a) for a in fetched_rows(clone)]
    cache.update_and_fetch(rows(4), rows(4))
    assert clone.offset == 10
    for a, b in zip(before, fetched_rows(clone)):
        assert_equal(a, b)


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 112, 128, 256])
def test_head_dims(head_dim):
    cache = TurboQuantKVCache(3, 4)
    for n in (7, 1, 70, 1):
        k, v = cache.update_and_fetch(rows(n, head_dim), rows(n, head_dim))
    assert k.shape == (1, 2, 79, head_dim)
    assert_equal(k, by_hand(cache, stored_rows(cache))[0])


def test_centring_mean_comes_from_the_first_prefill():
    cache = TurboQuantKVCache(3, 3, center=True)
    x = rows(600, dtype=mx.float32) + mx.arange(64, dtype=mx.float32)
    cache.update_and_fetch(x, x)
    assert mx.allclose(cache.mu, x[0, :, :512, :].mean(axis=1), atol=1e-5).item()
    mu = cache.mu
    cache.update_and_fetch(rows(3, dtype=mx.float32), rows(3, dtype=mx.float32))
    assert cache.mu is mu  # estimated once


# -- through mlx-lm models -------------------------------------------------------------------
class ReplayKVCache(KVCache):
    """A plain cache that ignores the model's rows and serves given ones, chunk by chunk."""

    def __init__(self, keys, values):
        super().__init__()
        self.replay = keys, values

    def _encode_pair(self, keys, values):
        s = slice(self.offset, self.offset + keys.shape[2])
        return self.replay[0][..., s, :], self.replay[1][..., s, :]


class ReplayRing(RotatingKVCache):
    def __init__(self, max_size, keep, keys, values):
        super().__init__(max_size, keep)
        self.replay = keys, values

    _encode_pair = ReplayKVCache._encode_pair


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logits_equal_a_model_fed_the_codes_decoded_by_hand(arch):
    model = build_mlx_lm_model(arch)
    p = prompt()
    caches = [TurboQuantKVCache(3, 4) for _ in model.layers]
    got = run(model, caches, p)
    # Decode every stored code at once, by hand, and make a plain-cache run see those rows.
    replay = [ReplayKVCache(*by_hand(c, c.encoded_rows())) for c in caches]
    assert_equal(got, run(model, replay, p))


def recording(cache):
    """Make ``cache`` keep the (codes, scales) of every chunk it encodes, in arrival order."""
    cache.arrivals = []
    encode_pair = cache._encode_pair

    def capture(keys, values):
        new_keys, new_values = encode_pair(keys, values)
        cache.arrivals.append((new_keys[:2], new_values[:2]))
        return new_keys, new_values

    cache._encode_pair = capture
    return cache


def arrivals_by_hand(cache):
    """Every row ``cache`` ever encoded, decoded by hand from its captured codes."""
    stored = [
        tuple(mx.concatenate([a[i][j] for a in cache.arrivals], axis=2) for j in range(2))
        for i in range(2)
    ]
    return by_hand(cache, [(codes, scales[..., 0]) for codes, scales in stored])


def test_gemma3_ring_layers_equal_codes_decoded_by_hand():
    from mlx_lm.models import cache as lm_cache

    model = build_mlx_lm_model("gemma3_text")
    windows = [
        c.max_size if type(c) is lm_cache.RotatingKVCache else None for c in model.make_cache()
    ]
    assert windows[0] is not None and None in windows  # both families are exercised
    caches = [
        recording(TurboQuantKVCache(4, 3) if w is None else RotatingTurboQuantKVCache(w, 0, 4, 3))
        for w in windows
    ]
    p = prompt(2)
    got = run(model, caches, p)  # 64-token prefill past a window of 16, then 16 steps
    replay = [
        ReplayKVCache(*arrivals_by_hand(c)) if w is None else ReplayRing(w, 0, *arrivals_by_hand(c))
        for c, w in zip(caches, windows)
    ]
    assert_equal(got, run(model, replay, p))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logits_close_to_plain(arch):
    model = build_mlx_lm_model(arch)
    n = len(model.layers)
    p = prompt(3)
    plain = run(model, [KVCache() for _ in range(n)], p)

    def err(make):
        return mx.abs(run(model, [make() for _ in range(n)], p) - plain).max().item()

    affine4 = err(lambda: QuantizedKVCache(64, 4))
    tq = {b: err(lambda b=b: TurboQuantKVCache(b, b)) for b in (4, 3, 2)}
    assert 0 < tq[4] <= 1.5 * affine4, (tq, affine4)
    assert tq[4] < tq[3] < tq[2], tq


def test_rotating_tq_within_tq_vs_plain_tolerance():
    """Windowed semantics come from the model's mask without a ring, so the ring
    variant must be as close to a plain ring as the growing one is to plain."""
    model = build_mlx_lm_model("llama")
    n = len(model.layers)
    p = prompt(4)
    plain = run(model, [KVCache() for _ in range(n)], p)
    tq = run(model, [TurboQuantKVCache(4, 4) for _ in range(n)], p)
    rot_plain = run(model, [RotatingKVCache(24, keep=4) for _ in range(n)], p)
    rot_tq = run(model, [RotatingTurboQuantKVCache(24, 4, 4, 4) for _ in range(n)], p)
    tolerance = mx.abs(tq - plain).max().item()
    assert 0 < mx.abs(rot_tq - rot_plain).max().item() <= 2 * tolerance


def test_stock_mlx_lm_generate_runs_them_through_plain_sdpa():
    from mlx_lm.generate import generate_step

    model = build_mlx_lm_model("llama")
    caches = [TurboQuantKVCache(4, 3) for _ in model.layers]
    tokens = [int(t) for t, _ in generate_step(prompt(5), model, prompt_cache=caches, max_tokens=6)]
    assert len(tokens) == 6 and all(0 <= t < 256 for t in tokens)
    # The prompt, then the generated tokens fed back (mlx-lm computes one step ahead).
    offsets = {c.offset for c in caches}
    assert len(offsets) == 1 and offsets <= {85, 86}
