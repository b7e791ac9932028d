"""Integrity: corrupt records are counted misses, removed, never served; verify() finds the rest."""

from __future__ import annotations

import random

import numpy as np

from kvstore.abc.store import BlockSpan, MissReason
from kvstore.errors import FormatVersionError
from kvstore.store import keys as K
from kvstore.testing.store import encoder_for, prefix_rows, record_rows, verify_record

from .conftest import NS


def save(store, tokens):
    return store.put_blocks(NS, tokens, encoder_for(tokens))


def flip_bit(raw, key, bit):
    with raw.reader() as view:
        value = bytearray(view.get(key))
    value[bit // 8 % len(value)] ^= 1 << (bit % 8)
    raw.put_many([(key, bytes(value))])


def restored_rows(store, tokens):
    """The rows a restore would get for ``tokens`` (possibly fewer than matched)."""
    match = store.lookup(NS, tokens)
    with store.read(match.blocks) as views:
        parts = [record_rows(v)[: ref.rows] for v, ref in zip(views, match.blocks, strict=False)]
    return np.concatenate(parts) if parts else np.zeros((0, 16), np.uint8)


def test_a_corrupt_record_is_a_counted_miss_then_removed(store, raw):
    tokens = list(range(14))
    written = save(store, tokens).written
    flip_bit(raw, written[1], 200)
    match = store.lookup(NS, tokens)
    with store.read(match.blocks) as views:
        assert len(views) == 1  # the leading run before the bad block
    stats = store.stats()
    assert stats.misses == {MissReason.CORRUPT: 1} and stats.corruptions == 1
    assert store.lookup(NS, tokens).tokens == 4  # quarantined at once, in this process
    store.flush()  # the removal happens off the read path
    assert store.stats().blocks == 1  # the bad block and everything after it
    assert store.verify().clean
    assert len(save(store, tokens).written) == 3  # and it can be stored again


def test_random_bit_flips_never_serve_wrong_rows(store, raw):
    rng = random.Random(5)
    prompts = [[rng.randrange(4) for _ in range(rng.randrange(2, 30))] for _ in range(25)]
    for p in prompts:
        save(store, p)
    with raw.reader() as view:
        records = [k for k, _ in view.scan(K.SCHEMA) if K.split_record_key(k)]
    for key in rng.sample(records, len(records) // 3):
        flip_bit(raw, key, rng.randrange(1 << 20))
    for p in prompts + [p[: len(p) // 2] + [9] for p in prompts]:
        got = restored_rows(store, p)
        assert np.array_equal(got, prefix_rows(p)[: len(got)])
    assert store.stats().corruptions > 0
    store.flush()
    report = store.verify()
    assert report.clean, report


def test_verify_finds_and_repairs_damage(store, raw):
    p1, p2 = [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9, 5]
    for p in (p1, p2, [7, 7, 7]):
        save(store, p)
    ns = K.parse_namespace(NS)
    b0, b1 = K.chain_digests(ns, K.as_tokens(p1), 4)
    tail2 = save(store, p2 + [6]).written[0]  # a tail [5, 6] superseding [5]
    flip_bit(raw, tail2, 3)  # a corrupt record
    b1_index = K.child_key(ns, b0, K.as_tokens([5, 6, 7, 8]), b1, True)
    raw.delete_many([K.record_key(ns, b1), b1_index])  # tail [9] is left an orphan
    raw.put_many([(K.totals_key(ns), b"\x00" * 16), (K.SCHEMA + ns + b"/.x", b"?")])
    report = store.verify()
    assert not report.clean
    assert report.corrupt == (tail2,)
    assert len(report.orphans) == 1 and report.totals_mismatch
    assert K.SCHEMA + ns + b"/.x" in report.dangling
    assert store.verify(repair=True).repaired
    after = store.verify()
    assert after.clean, after
    assert store.stats().blocks == after.blocks == 3  # b0, [9, 9, 9, 9] and [7, 7, 7]
    assert store.lookup(NS, p2 + [6]).tokens == 8


def test_records_from_a_newer_writer_are_skipped_not_removed(make_store):
    def newer(record):
        raise FormatVersionError("[verify] record format 9 is newer than this reader")

    store = make_store(verify=newer)
    save(store, [1, 2, 3, 4, 5])
    match = store.lookup(NS, [1, 2, 3, 4, 5])
    with store.read(match.blocks) as views:
        assert views == []
    assert store.stats().misses == {MissReason.VERSION: 1}
    store.flush()
    report = store.verify()
    assert report.clean and len(report.newer_format) == 2 and store.stats().blocks == 2


def test_a_vanished_block_is_a_miss(store):
    save(store, [1, 2, 3, 4, 5, 6])
    match = store.lookup(NS, [1, 2, 3, 4, 5, 6])
    store.delete(NS, [1, 2, 3, 4, 5])
    with store.read(match.blocks) as views:
        assert len(views) == 1
    assert store.stats().misses == {MissReason.VANISHED: 1}


def test_the_test_verifier_catches_single_bits():
    record = encoder_for([1, 2, 3])([BlockSpan(0, 0, 3, b"k")])[0]
    verify_record(memoryview(record))
    for bit in range(0, 8 * len(record), 7):
        damaged = bytearray(record)
        damaged[bit // 8] ^= 1 << (bit % 8)
        try:
            verify_record(memoryview(bytes(damaged)))
        except ValueError:
            continue
        raise AssertionError(f"bit {bit} flipped unnoticed")
