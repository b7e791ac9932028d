"""host_alike: a lossless restore on the host planned from the records' headers alone
(issue 13), against the codec's own restore of the same snapshots."""

from __future__ import annotations

import mlx.core as mx
import pytest
import xxhash

from kvstore.caches import KVCache, QuantizedKVCache
from kvstore.codecs import codec_for, encode_record, fill, host_alike, read_header
from kvstore.codecs.copied_sums import Claims
from kvstore.codecs.record import placed_payload, record_payload
from kvstore.testing.codec import assert_arrays_equal, fill_cache, leaves

BLOCK = 16


def _records(cache, layers, tokens):
    """The cache's rows saved as records of BLOCK rows (the last one shorter), each
    record the same rows of ``layers`` layers (each layer its own copy of them)."""
    codec = codec_for(cache)
    out = []
    for start in range(0, tokens, BLOCK):
        snap = codec.snapshot(cache, start, min(start + BLOCK, tokens))
        out.append(encode_record([snap] * layers))
    return out


def _restored(records, rows, claims=None):
    headers = [read_header(r) for r in records]
    payloads = [record_payload(r, h) for r, h in zip(records, headers)]
    plain = headers[0].layers[0].signature == "kv:plain"
    return host_alike.restored_alike(
        codec_for(KVCache() if plain else QuantizedKVCache(64, 4)),
        [h.layers for h in headers],
        payloads,
        rows,
        claims,
    )


def _assert_same(got, want):
    assert got.offset == want.offset
    for a, b in zip(leaves((got.keys, got.values)), leaves((want.keys, want.values)), strict=True):
        assert_arrays_equal(a[:, :, : want.offset], b[:, :, : want.offset])


@pytest.mark.parametrize(
    ("make", "runs"),
    [
        (KVCache, [6]),  # 3 layers' keys and values alike: one strided copy
        # Each side's q alone, then its scales and biases (alike): two copies.
        (lambda: QuantizedKVCache(64, 4), [1, 2] * 6),
    ],
)
def test_caches_planned_from_headers_are_the_codecs_own_restore(make, runs, monkeypatch):
    # Written through MLX's loader by strided copies, record by record, however small
    # (units skip fill.DIRECT_MIN_BYTES's host buffer).
    monkeypatch.setattr(fill, "DIRECT_MIN_BYTES", 1 << 40)
    found = []
    real = host_alike._runs
    monkeypatch.setattr(host_alike, "_runs", lambda *a: found.append(real(*a)) or found[-1])
    cache = make()
    fill_cache(cache, [37, 13], heads=2, head_dim=64)  # 50 rows: 3 blocks and 2 rows
    records = _records(cache, 3, 50)
    got = _restored(records, [16, 16, 16, 2])
    assert len(got) == 3
    # A few strided copies a record, arrays alike at one step; two layouts: whole
    # blocks, and the tail.
    assert [[many for _, many, _, _ in layout] for layout in found] == [runs, runs]
    for layer in got:
        _assert_same(layer, cache)


def test_layers_laid_out_alike_share_one_plan_and_each_gets_its_own_cache(monkeypatch):
    # A growing codec's plan makes a new cache each time it assembles one (reusable):
    # one plan for the layers of one layout and meta, a plan each for the others.
    caches = [KVCache() for _ in range(4)]
    for seed, cache in enumerate(caches[:3]):
        fill_cache(cache, [40], seed=seed, heads=2, head_dim=64)
    fill_cache(caches[3], [40], seed=3, heads=4, head_dim=64)  # another layout
    codec = codec_for(caches[0])
    records = [
        encode_record([codec.snapshot(c, start, min(start + BLOCK, 40)) for c in caches])
        for start in range(0, 40, BLOCK)
    ]
    made = []
    real = type(codec).plan_restore
    monkeypatch.setattr(
        type(codec), "plan_restore", lambda self, s: made.append(real(self, s)) or made[-1]
    )
    got = _restored(records, [16, 16, 8])
    assert len(made) == 2 and all(plan.reusable for plan in made)
    assert len({id(layer) for layer in got}) == 4
    for layer, want in zip(got, caches, strict=True):
        _assert_same(layer, want)


def test_a_match_cut_inside_its_last_block_restores_exactly_those_rows(monkeypatch):
    monkeypatch.setattr(fill, "DIRECT_MIN_BYTES", 0)
    cache = KVCache()
    fill_cache(cache, [48], heads=2, head_dim=64)
    records = _records(cache, 2, 48)
    got = _restored(records, [16, 16, 5])
    cache.trim(48 - 37)
    for layer in got:
        _assert_same(layer, cache)


def test_records_that_are_not_laid_out_alike_are_left_to_the_general_way():
    float32, float16 = KVCache(), KVCache()
    fill_cache(float32, [32], heads=2, head_dim=64, dtype=mx.float32)
    fill_cache(float16, [32], heads=2, head_dim=64, dtype=mx.float16)
    first, _ = _records(float32, 2, 32)
    _, second = _records(float16, 2, 32)
    assert _restored([first, second], [16, 16]) is None  # dtypes differ
    one, two = _records(float32, 2, 32)
    assert _restored([two, one], [16, 16]) is None  # not one after another


def test_claimed_records_are_hashed_by_their_copies_exactly_as_the_checks_hash(monkeypatch):
    monkeypatch.setattr(fill, "DIRECT_MIN_BYTES", 0)
    cache = KVCache()
    fill_cache(cache, [64], heads=8, head_dim=128)
    records = _records(cache, 4, 64)
    views = [memoryview(r) for r in records]
    claims, handed = Claims(lambda views: True), {}
    monkeypatch.setattr(claims, "resolve", lambda record, digest: handed.update({record: digest}))
    with claims.taken(views):
        got = _restored(records, [16] * 4, claims)
    assert handed == {
        i: xxhash.xxh3_64_intdigest(placed_payload(view)) for i, view in enumerate(views)
    }
    for layer in got:
        _assert_same(layer, cache)


def test_when_the_record_copies_fail_each_array_is_written_from_its_pieces(monkeypatch):
    failed = []

    def broken(self, k, targets):
        failed.append(k)
        raise OSError("a page went away")

    monkeypatch.setattr(host_alike._AlikeWrites, "write", broken)
    cache = KVCache()
    fill_cache(cache, [40], heads=2, head_dim=64)
    got = _restored(_records(cache, 2, 40), [16, 16, 8])
    assert failed
    for layer in got:
        _assert_same(layer, cache)
