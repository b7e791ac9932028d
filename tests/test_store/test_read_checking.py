"""read_checking: views handed out while their checksums are computed (issue 13), and a
restore that never serves what fails them."""

from __future__ import annotations

import pytest

from kvstore.abc.store import MissReason
from kvstore.bridge import generate_tokens
from kvstore.bridge.namespace import namespace_for_model
from kvstore.store import open_backend, open_store

from .kv_helpers import BLOCK, CHUNK, assert_same_caches, model_for, prefilled, prompt

TOKENS = prompt(12, 70)  # 4 full blocks and a tail of 6


def _saved(tmp_path):
    url = f"lmdb://{tmp_path / 'store'}"
    with open_store(url, block_size=BLOCK, touch_interval=0) as store:
        generate_tokens(model_for("tiny"), TOKENS, store=store, max_tokens=1, chunk_size=CHUNK)
    return url


def _match(store):
    return store.lookup(namespace_for_model(model_for("tiny")), [*TOKENS, 1])


def _flip_payload(url, key):
    """The record of ``key`` with its last payload byte flipped (its header intact)."""
    backend = open_backend(url)
    try:
        value = bytearray(backend.get_many([key])[0])
        value[-1] ^= 0x10
        backend.put_many([(key, bytes(value))])
    finally:
        backend.close()


def test_views_come_before_their_checks_and_intact_counts_the_good_ones(tmp_path):
    url = _saved(tmp_path)
    with open_store(url, readonly=True, touch_interval=0) as store:
        blocks = _match(store).blocks
    _flip_payload(url, blocks[2].key)
    with open_store(url, touch_interval=0) as store:
        with store.read_checking(blocks) as views:
            assert len(views) == len(blocks)  # every stored record, handed out unchecked
            assert views.intact() == 2  # the checks stop at the flipped one
            assert views.intact() == 2
        assert store.activity()["misses"][MissReason.CORRUPT] == 1
        with store.read(blocks) as views:  # quarantined: never served again
            assert len(views) == 2


@pytest.mark.parametrize("hashed_by", ["the checks", "the copies"])
def test_a_restore_never_serves_rows_filled_from_a_record_that_fails_its_checksum(
    tmp_path, hashed_by, request
):
    # The copies hash each record for the checks (hashed_as_copied): a flipped byte must
    # end the run there as when the checks hash it themselves.
    digests = request.getfixturevalue("hashed_as_copied") if hashed_by == "the copies" else []
    url = _saved(tmp_path)
    with open_store(url, readonly=True, touch_interval=0) as store:
        blocks = _match(store).blocks
    _flip_payload(url, blocks[2].key)
    model = model_for("tiny")
    with open_store(url, touch_interval=0) as store:
        restored = store.restore(_match(store), model.make_cache())
        assert store.activity()["misses"][MissReason.CORRUPT] == 1
    # By the copies: every record's digest, the flipped one's too; then the restore of
    # the two blocks before it, again.
    assert len(digests) == (len(blocks) + 2 if hashed_by == "the copies" else 0)
    assert restored[0].offset == blocks[2].start == 2 * BLOCK
    assert_same_caches(restored, prefilled(model, TOKENS[: 2 * BLOCK]))


def test_an_intact_store_reads_the_same_either_way(tmp_path):
    url = _saved(tmp_path)
    with open_store(url, readonly=True, touch_interval=0) as store:
        blocks = _match(store).blocks
        with store.read(blocks) as eager:
            want = [bytes(v) for v in eager]
        with store.read_checking(blocks) as views:
            got = [bytes(v) for v in views]
            assert views.intact() == len(blocks)
    assert got == want and len(want) == len(blocks)


def test_a_read_that_fails_with_its_records_claimed_ends_and_its_checks_hash_them(tmp_path):
    # A reader that claimed every record and then failed before hashing one: leaving
    # the read drops the claims, its checks hash the records themselves, and nothing
    # is counted corrupt.
    from kvstore.codecs.copied_sums import Claims

    url = _saved(tmp_path)
    with open_store(url, touch_interval=0) as store:
        blocks = _match(store).blocks
        claims = Claims(lambda views: True)
        with pytest.raises(RuntimeError, match="the copy failed"):
            with store.read_checking(blocks, claim=claims.taken) as views:
                assert [i in claims for i in range(len(views))] == [True] * len(blocks)
                raise RuntimeError("the copy failed")
        assert store.activity()["misses"].get(MissReason.CORRUPT, 0) == 0
        with store.read_checking(blocks, claim=claims.taken) as views:
            claims.drop()  # before intact(): the checks would wait for the claims
            assert views.intact() == len(blocks)


def test_a_store_whose_check_takes_no_digests_is_never_claimed_from(tmp_path):
    # A reader hashing records for a check that hashes them anyway would hash twice.
    from kvstore.codecs.copied_sums import Claims

    url = _saved(tmp_path)
    claims = Claims(lambda views: True)
    with open_store(url, touch_interval=0) as store:  # the record check: takes them
        blocks = _match(store).blocks
        with store.read_checking(blocks, claim=claims.taken) as views:
            assert claims.records and claims.claim_open() == set(range(len(blocks)))
            claims.drop()
            assert views.intact() == len(blocks)
    with open_store(url, touch_interval=0, verify=lambda view: None) as store:
        with store.read_checking(blocks, claim=claims.taken) as views:
            assert claims.records == () and claims.claim_open() == set()
            assert views.intact() == len(blocks)


def test_threads_restoring_one_prefix_at_once_share_claims_and_all_get_it_exactly(
    tmp_path, copied_digests
):
    # Readers on several threads open the same records (the same pages): a record is
    # claimed by one reader only, the others' checks take that reader's digest or hash
    # it themselves, and every restore is the prefill's caches; nothing waits forever.
    import threading

    url = _saved(tmp_path)
    model = model_for("tiny")
    want = prefilled(model, TOKENS)
    got, errors = [], []

    def restore_a_few(store):
        try:
            for _ in range(6):
                got.append(store.restore(_match(store), model.make_cache()))
        except BaseException as exc:  # noqa: BLE001 - reported on the main thread
            errors.append(exc)

    with open_store(url, touch_interval=0) as store:
        threads = [threading.Thread(target=restore_a_few, args=(store,)) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads), "a restore never ended"
        assert store.activity()["misses"].get(MissReason.CORRUPT, 0) == 0
    assert errors == [] and len(got) == 18
    assert copied_digests  # some records were hashed by their copies, for the checks
    for restored in got:
        assert restored[0].offset == len(TOKENS)
        assert_same_caches(restored, want)
