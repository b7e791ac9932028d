"""copied_sums: a reader hashes the records it copies, and the store's checks take its
digests, still comparing them with the headers' (issue 13)."""

from __future__ import annotations

import threading

import pytest
import xxhash

from kvstore.codecs import copied_sums
from kvstore.codecs.copied_sums import Claims, digest_of
from kvstore.codecs.record import verify_record
from kvstore.errors import CorruptEntryError

from .helpers import payload_of, small_record


def _every(views):
    return True


class _Hashing:
    """A check's own hash, counting its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, view):
        self.calls += 1
        return xxhash.xxh3_64_intdigest(view)


def test_a_check_of_a_claimed_record_takes_the_readers_digest_and_still_compares_it():
    record = memoryview(small_record())
    claims = Claims(_every)
    with claims.taken([record]):
        assert 0 in claims and list(claims.records) == [record]
        assert claims.claim_open() == {0}
        claims.resolve(0, 12345)  # not the payload's digest
        with pytest.raises(CorruptEntryError, match="computed 0x0000000000003039"):
            verify_record(record)
    verify_record(record)  # the claim went with its read: hashed by the check, intact


def test_a_check_waits_for_the_reader_and_hashes_nothing_itself():
    raw = small_record()
    record, want = memoryview(raw), xxhash.xxh3_64_intdigest(payload_of(raw))
    claims, hashing, got = Claims(_every), _Hashing(), []
    with claims.taken([record]):
        assert claims.claim_open() == {0}
        check = threading.Thread(target=lambda: got.append(digest_of(record, hashing)))
        check.start()
        claims.resolve(0, want)
        check.join()
    assert got == [want] and hashing.calls == 0


def test_a_dropped_claim_makes_the_check_hash_the_record_itself():
    record = memoryview(small_record())
    claims, hashing = Claims(_every), _Hashing()
    with claims.taken([record]):
        assert claims.claim_open() == {0}
        claims.drop()
        assert 0 not in claims and claims.claim_open() == set()
        assert digest_of(record, hashing) == xxhash.xxh3_64_intdigest(record)
    assert hashing.calls == 1


def test_a_record_another_reader_claimed_is_not_claimed_again_and_claims_end_with_reads():
    raw = small_record()
    first, second, hashing = Claims(_every), Claims(_every), _Hashing()
    with first.taken([memoryview(raw)]), second.taken([memoryview(raw)]):
        assert 0 in first and 0 not in second and second.claim_open() == set()
        assert first.claim_open() == {0}
        first.resolve(0, 7)
        assert digest_of(memoryview(raw), hashing) == 7  # the one claim, whoever checks
    assert 0 not in first and first.records == ()
    assert digest_of(memoryview(raw), hashing) == xxhash.xxh3_64_intdigest(raw)


def test_records_not_wanted_are_not_claimed():
    claims = Claims(lambda views: False)
    with claims.taken([memoryview(small_record())]):
        assert 0 not in claims and claims.records == ()


def test_a_record_a_check_began_hashing_is_not_claimed_and_its_reader_only_copies_it():
    raw = small_record()
    claims, hashing = Claims(_every), _Hashing()
    with claims.taken([memoryview(raw)]):
        assert digest_of(memoryview(raw), hashing) == xxhash.xxh3_64_intdigest(raw)
        assert hashing.calls == 1 and 0 in claims
        assert claims.claim_open() == set()


def test_a_large_record_is_claimed_as_it_is_opened_and_no_check_begins_it(monkeypatch):
    # A check that began a large record would hash it whole from memory beside the
    # copies: the reader claims it at once, and a check waits for its digest.
    raw, small = small_record(heads=2), small_record()
    assert len(small) < len(raw)
    monkeypatch.setattr(copied_sums, "RESERVED_MIN_BYTES", len(raw))
    big_view, small_view = memoryview(raw), memoryview(small)
    want = xxhash.xxh3_64_intdigest(payload_of(raw))
    claims, hashing, got = Claims(_every), _Hashing(), []
    with claims.taken([big_view, small_view]):
        check = threading.Thread(target=lambda: got.append(digest_of(big_view, hashing)))
        check.start()
        check.join(0.2)
        assert check.is_alive() and hashing.calls == 0  # waiting, not hashing
        # The small one a check may still begin while the reader parses.
        assert digest_of(small_view, hashing) == xxhash.xxh3_64_intdigest(small_view)
        assert claims.claim_open() == {0}
        claims.resolve(0, want)
        check.join()
    assert got == [want] and hashing.calls == 1


def test_a_large_record_its_reader_leaves_unresolved_is_hashed_by_its_check(monkeypatch):
    raw = small_record()
    monkeypatch.setattr(copied_sums, "RESERVED_MIN_BYTES", len(raw))
    record, claims, hashing, got = memoryview(raw), Claims(_every), _Hashing(), []
    with claims.taken([record]):
        check = threading.Thread(target=lambda: got.append(digest_of(record, hashing)))
        check.start()
    check.join()  # the read ended without a digest: the check hashed it itself
    assert got == [xxhash.xxh3_64_intdigest(raw)] and hashing.calls == 1
