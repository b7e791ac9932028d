"""Prefix semantics on every backend: token-exact lookup, save bookkeeping, reads, deletes."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvstore.abc.store import BlockRef, Match, MissReason, SaveResult
from kvstore.errors import CapabilityError, StoreConfigError, StoreError
from kvstore.store import keys as K
from kvstore.store import open_store
from kvstore.store.blocks.index import decode_use
from kvstore.testing.store import check_match, encoder_for, record_rows, verify_record

from .conftest import NS


def save(store, tokens, namespace=NS, **kw):
    return store.put_blocks(namespace, tokens, encoder_for(tokens), **kw)


def refuse(spans):
    raise AssertionError(f"encode called for {len(spans)} spans; everything was stored")


@pytest.mark.parametrize("length", [2, 3, 4, 5, 8, 9, 13])
def test_a_stored_prompt_matches_all_but_its_last_token(store, length):
    tokens = list(range(100, 100 + length))
    save(store, tokens)
    match = store.lookup(NS, tokens)
    assert match.tokens == length - 1 and match.prompt_tokens == length
    assert [b.start for b in match.blocks] == list(range(0, length - 1, 4))
    check_match(store, match, tokens)


def test_an_extended_prompt_reuses_the_whole_stored_prompt(store):
    tokens = list(range(10))
    save(store, tokens)
    match = store.lookup(NS, tokens + [77, 78, 79])
    assert match.tokens == 10
    assert match.blocks[-1] == BlockRef(match.blocks[-1].key, 2, 8, 2, 2)
    check_match(store, match, tokens)


@pytest.mark.parametrize("diverge_at", [1, 3, 4, 5, 6, 7, 8, 11])
def test_prompts_diverging_mid_block_reuse_exactly_their_common_prefix(store, diverge_at):
    stored = list(range(12))
    save(store, stored)
    prompt = stored[:diverge_at] + [500, 501, 502, 503, 504]
    match = store.lookup(NS, prompt)
    assert match.tokens == diverge_at
    check_match(store, match, prompt)


def test_the_best_sibling_wins(store):
    base = [1, 2, 3, 4]
    for tail in ([9, 9, 9, 9], [5, 6, 0, 0], [5, 6, 7, 0], [5, 1, 1]):
        save(store, base + tail)
    match = store.lookup(NS, base + [5, 6, 7, 8, 9])
    assert match.tokens == 7
    check_match(store, match, base + [5, 6, 7, 8, 9])


def test_many_siblings_sharing_a_long_head_are_all_considered(make_store):
    # Children whose first ORDER_TOKENS tokens agree sit in one run of order keys.
    store = make_store(block_size=128)
    head = list(range(K.ORDER_TOKENS + 5))
    for last in range(6):
        save(store, [7] * 128 + head + [last] * 10)
    prompt = [7] * 128 + head + [3] * 10 + [1]
    match = store.lookup(NS, prompt)
    assert match.tokens == len(prompt) - 1
    check_match(store, match, prompt)


def test_misses_and_their_reasons(store):
    save(store, [1, 2, 3, 4, 5])
    assert store.lookup(NS, [9, 9, 9, 9, 9]) == Match(NS, 0, 5, 4)
    assert not store.lookup(NS, [1]).hit  # one token: nothing can be left for the model
    assert not store.lookup(NS, []).hit
    assert not store.lookup("other-ns", [1, 2, 3]).hit
    stats = store.stats()
    assert stats.lookups == 4 and stats.hits == 0
    assert stats.misses == {MissReason.COLD: 2, MissReason.SHORT_PROMPT: 2}


def test_resaving_a_stored_prefix_only_hashes(store):
    tokens = list(range(11))
    first = save(store, tokens)
    assert len(first.written) == 3 and first.deduplicated == 0
    again = store.put_blocks(NS, tokens, refuse)
    assert again.written == () and again.deduplicated == 3
    shorter = store.put_blocks(NS, tokens[:9], refuse)  # its tail is the stored tail's prefix
    assert shorter.written == () and shorter.covered_by == first.written[-1]
    assert store.put_blocks(NS, tokens[:8], refuse).deduplicated == 2
    assert store.stats().blocks == 3


@pytest.mark.parametrize("length", [8, 11])  # full blocks only; a tail of its own
def test_a_resave_counts_and_touches_its_blocks(make_store, raw, clock, length):
    # Every block stored as its own record takes the save's short route (hashing, one
    # read): its result, counters and recency are the whole route's.
    store = make_store(touch_interval=0.01)
    tokens = list(range(length))
    clock.now = 1.0
    first = save(store, tokens)
    clock.now = 2.0
    again = store.put_blocks(NS, tokens, refuse)
    assert again == SaveResult(NS, length, deduplicated=len(first.written))
    stats = store.stats()
    assert stats.saves == 2 and stats.deduplicated_blocks == len(first.written)
    use_keys = [K.use_key(*K.split_record_key(key)) for key in first.written]
    for _ in range(1000):  # polls for the background write; no timing is asserted
        with raw.reader() as view:
            if all(decode_use(view.get(key))[0] == 2.0 for key in use_keys):
                break
        time.sleep(0.01)
    else:
        raise AssertionError("the re-save's recency was never written")
    assert store.verify().clean


def test_a_longer_tail_supersedes_the_shorter_one(store):
    save(store, list(range(9)))  # blocks [0-4) [4-8) + tail [8]
    result = save(store, list(range(11)))  # tail [8, 9, 10] extends tail [8]
    assert result.superseded == 1 and len(result.written) == 1
    result = save(store, list(range(12)))  # a full block extends tail [8, 9, 10]
    assert result.superseded == 1
    stats = store.stats()
    assert stats.blocks == 3 and store.verify().clean
    for n in (9, 10, 12):
        check_match(store, store.lookup(NS, list(range(n))), list(range(n)))


def test_save_result_counts_bytes(store):
    result = save(store, list(range(6)))
    with store.read(store.lookup(NS, list(range(6)) + [0]).blocks) as views:
        assert result.written_bytes == sum(v.nbytes for v in views)
    assert store.stats().bytes == result.written_bytes


def test_namespaces_are_isolated(store):
    save(store, [1, 2, 3, 4, 5, 6], namespace="aaaa")
    save(store, [1, 2, 3, 4, 9, 9], namespace="bbbb")
    assert store.lookup("aaaa", [1, 2, 3, 4, 5, 6, 0]).tokens == 6
    assert store.lookup("bbbb", [1, 2, 3, 4, 5, 6, 0]).tokens == 4
    assert set(store.stats().namespaces) == {"aaaa", "bbbb"}


def test_delete_forgets_every_prefix_extending_the_tokens(store):
    for prompt in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7, 7, 7, 7, 7], [1, 2, 3, 4, 8], [1, 2, 9]):
        save(store, prompt)
    assert store.delete(NS, [1, 2, 3, 4, 5]) == 3  # tail [5,6], block [5,7,7,7], its tail [7]
    assert store.lookup(NS, [1, 2, 3, 4, 5, 6, 0]).tokens == 4
    assert store.lookup(NS, [1, 2, 3, 4, 8, 0]).tokens == 5
    assert store.delete(NS, [1, 2, 3, 4]) == 2  # the full block and its remaining tail [8]
    assert store.lookup(NS, [1, 2, 9, 0]).tokens == 3
    assert store.delete(NS) == 1
    assert store.stats().blocks == 0 and store.verify().clean


def test_views_are_zero_copy_and_released_on_exit(store):
    tokens = list(range(6))
    save(store, tokens)
    match = store.lookup(NS, tokens)
    with store.read(match.blocks) as views:
        assert all(isinstance(v, memoryview) for v in views)
        rows = record_rows(views[0])
    with pytest.raises(ValueError, match="released"):
        bytes(views[0])
    assert rows.shape == (4, 16)


def test_match_helpers():
    refs = tuple(BlockRef(bytes([i]), i, 4 * i, 4, 4) for i in range(5))
    refs = refs[:-1] + (BlockRef(b"\x04", 4, 16, 2, 4),)
    m = Match(NS, 18, 30, 4, refs)
    assert [b.index for b in m.covering(5, 9)] == [1, 2]
    assert [b.index for b in m.covering(17, 99)] == [4]
    # RotatingKVCache(max_size=8, keep=2): tokens [0, 2) and the 6 newest [12, 18).
    assert [b.index for b in m.for_window(8, keep=2)] == [0, 3, 4]
    whole = m.untrimmed()
    assert whole.tokens == 16 and len(whole.blocks) == 4
    assert whole.untrimmed() == whole


def test_bad_inputs(store):
    with pytest.raises(CapabilityError, match=r"\[save\] Token ids"):
        store.put_blocks(NS, [1, -2], refuse)
    with pytest.raises(StoreConfigError, match="namespace"):
        store.lookup("Bad NS", [1, 2])
    with pytest.raises(StoreConfigError, match="one record per span"):
        store.put_blocks(NS, [1, 2, 3], lambda spans: [])
    with pytest.raises(StoreConfigError, match="bytes-like"):
        store.put_blocks(NS, [1, 2, 3], lambda spans: [object()])
    assert store.stats().blocks == 0


def test_records_may_be_any_contiguous_buffer(make_store):
    store = make_store(verify=None)  # opaque records: nothing to check
    arr = np.arange(64, dtype=np.float32)
    store.put_blocks(NS, [1, 2, 3, 4], lambda spans: [arr], family="kv:plain")
    with store.read(store.lookup(NS, [1, 2, 3, 4, 5]).blocks) as views:
        assert bytes(views[0]) == arr.tobytes()
    assert store.stats(by_family=True).by_family == {"kv:plain": arr.nbytes}


def test_closed_store(store):
    store.close()
    store.close()  # idempotent
    with pytest.raises(StoreError, match="closed"):
        store.lookup(NS, [1, 2, 3])


def test_blocks_and_stats_survive_reopening(tmp_path):
    url = f"lmdb://{tmp_path / 's'}"
    with open_store(url, block_size=4, verify=verify_record) as first:
        save(first, list(range(10)))
    with open_store(url, verify=verify_record) as again:
        assert again.stats().blocks == 3 and again.block_size == 4
        check_match(again, again.lookup(NS, list(range(10))), list(range(10)))


def test_concurrent_saves_of_the_same_prefix_are_idempotent(store):
    prompts = [list(range(n)) for n in (9, 13, 13, 17, 9)] + [[1, 2, 3, 4, 5, 6]] * 3
    errors = []

    def saver(order):
        try:
            for i in order:
                save(store, prompts[i])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=saver, args=(list(range(len(prompts)))[::step],))
        for step in (1, -1, 2, -2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.verify().clean
    # 0..16: four full blocks and a tail [16]; [1..6]: one block and a tail.
    assert store.stats().blocks == 7
    for p in prompts:
        check_match(store, store.lookup(NS, p), p)


def test_the_background_writer_persists_recency(make_store, raw, clock):
    store = make_store(touch_interval=0.01)
    tokens = list(range(6))
    clock.now = 1.0
    save(store, tokens)
    clock.now = 2.0
    store.lookup(NS, tokens)
    ns = K.parse_namespace(NS)
    use_key = K.use_key(ns, K.chain_digests(ns, K.as_tokens(tokens), 4)[0])
    for _ in range(1000):  # polls for the background write; no timing is asserted
        with raw.reader() as view:
            if decode_use(view.get(use_key))[0] == 2.0:
                break
        time.sleep(0.01)
    else:
        raise AssertionError("recency was never written in the background")


def test_bad_store_options():
    with pytest.raises(StoreConfigError, match="verify must be a callable"):
        open_store("memory://", verify="xxh3")
    with pytest.raises(StoreConfigError, match="low_water must be a number in"):
        open_store("memory://", low_water=2)
