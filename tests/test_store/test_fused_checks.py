"""A CPU restore that hashes each record as it copies it out (kvstore.codecs.fused_fill,
record.reader_hashes): the same caches as the checks beside the copies, and a record
whose payload no longer matches its checksum is still never served."""

from __future__ import annotations

import pytest

from kvstore.codecs import fill, fused_fill, record
from kvstore.store import open_store

from .kv_helpers import BLOCK, assert_same_caches, model_for, prompt, token_by_token


@pytest.fixture(scope="module")
def tiny():
    model = model_for("tiny")
    tokens = prompt(9, 4 * BLOCK + 5)
    return model, tokens, token_by_token(model, tokens)


@pytest.fixture
def fused(monkeypatch):
    """Restores as small as the tiny model's take the fused fill; counts what it filled
    and each digest it gave, and each payload a check hashed itself."""
    monkeypatch.setattr(fill, "DIRECT_MIN_BYTES", 0)
    seen = {"fills": 0, "digests": 0, "hashed by checks": 0}
    fill_hashing = fused_fill.fill_hashing

    def counted(specs, pieces, payloads, done):
        def counted_done(i, digest):
            seen["digests"] += 1
            done(i, digest)

        filled = fill_hashing(specs, pieces, payloads, counted_done)
        seen["fills"] += filled is not None
        return filled

    payload_digest = record._payload_digest

    def hashed(view):
        seen["hashed by checks"] += 1
        return payload_digest(view)

    from kvstore.codecs import plans

    monkeypatch.setattr(plans, "fill_hashing", counted)
    monkeypatch.setattr(record, "_payload_digest", hashed)
    return seen


def test_a_restore_hashing_as_it_copies_restores_what_the_checks_beside_do(tmp_path, tiny, fused):
    model, tokens, caches = tiny
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK) as store:
        store.save("ns", tokens, caches)
        match = store.lookup("ns", tokens)
        restored = store.restore(match, model.make_cache())
        assert_same_caches(restored, token_by_token(model, tokens[:-1]))
        assert fused["fills"] == 1
        assert fused["digests"] == len(match.blocks)


def test_switched_off_the_checks_hash_every_record(tmp_path, tiny, fused, monkeypatch):
    monkeypatch.setattr(record, "FUSED_CHECKS", False)
    model, tokens, caches = tiny
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK) as store:
        store.save("ns", tokens, caches)
        match = store.lookup("ns", tokens)
        restored = store.restore(match, model.make_cache())
        assert_same_caches(restored, token_by_token(model, tokens[:-1]))
        assert fused["digests"] == 0
        assert fused["hashed by checks"] == len(match.blocks)


@pytest.mark.parametrize("block", [0, 2])
def test_a_flipped_payload_byte_found_by_the_fused_hash_is_never_served(
    tmp_path, tiny, fused, block
):
    """The check compares the digest the fill computed with the header's: the damaged
    record and every one after it are dropped (counted, quarantined), and the restore
    serves the intact blocks before it -- the caches of that shorter prompt exactly. (The
    fused fill ran: its digests are what the checks compared.)"""
    model, tokens, caches = tiny
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK) as store:
        keys = list(store.save("ns", tokens, caches).written)
        env = store.backend.environment
        with env.begin(write=True) as txn:
            value = bytearray(txn.get(keys[block]))
            header = record.read_header(value)
            value[header.payload_offset + header.payload_nbytes // 2] ^= 0x40
            txn.put(keys[block], bytes(value))
        match = store.lookup("ns", tokens)
        restored = store.restore(match, model.make_cache())
        assert fused["fills"] >= 1
        if block == 0:
            assert restored[0].offset == 0  # nothing intact to serve
        else:
            assert_same_caches(restored, token_by_token(model, tokens[: block * BLOCK]))
        assert store.stats().corruptions == 1
        # Dropped: a second restore serves the same and finds nothing new to count.
        again = store.restore(store.lookup("ns", tokens), model.make_cache())
        assert again[0].offset == block * BLOCK
        assert store.stats().corruptions == 1
