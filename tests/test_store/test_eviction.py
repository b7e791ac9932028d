"""Budgets and LRU-leaf eviction on every backend; recency batching."""

from __future__ import annotations

import pytest

from kvstore.errors import StoreFullError
from kvstore.store import keys as K
from kvstore.store.blocks.index import decode_use
from kvstore.testing.store import check_match, encoder_for, make_record, prefix_rows

from .conftest import NS

RECORD = len(make_record(prefix_rows([0] * 4)))  # bytes of one full block's record


def save(store, tokens, namespace=NS):
    return store.put_blocks(namespace, tokens, encoder_for(tokens))


def prompt(first, blocks):
    return [first] + list(range(1, 4 * blocks))


def test_a_namespace_over_budget_evicts_least_recently_used_leaves(make_store, clock):
    store = make_store(namespace_max_bytes=6 * RECORD, low_water=1.0)
    a, b, c = prompt(1, 2), prompt(2, 2), prompt(3, 2)
    for p in (a, b, c):
        clock.tick()
        save(store, p)
    clock.tick()
    assert store.lookup(NS, a).tokens == 7  # a is now the most recent
    clock.tick()
    result = save(store, prompt(4, 2))
    # b's two blocks go, leaf first (its parent only once it has become a leaf).
    assert result.evicted == 2 and result.evicted_bytes == 2 * RECORD
    assert not store.lookup(NS, b).hit
    for p in (a, c, prompt(4, 2)):
        check_match(store, store.lookup(NS, p), p)
    stats = store.stats()
    assert stats.namespaces[NS].bytes == 6 * RECORD and stats.evictions == 2
    assert store.verify().clean


def test_chains_are_cut_from_the_end(make_store, clock):
    store = make_store(namespace_max_bytes=5 * RECORD, low_water=1.0)
    long = prompt(1, 5)
    save(store, long)
    clock.tick()
    save(store, prompt(2, 1))  # needs one block: the long chain's leaf goes
    match = store.lookup(NS, long)
    assert match.tokens == 16 and len(match.blocks) == 4
    check_match(store, match, long)
    assert store.verify().clean  # no orphans: what is left is contiguous


def test_the_low_water_mark_frees_more_than_needed(make_store, clock):
    store = make_store(namespace_max_bytes=10 * RECORD, low_water=0.5)
    for first in range(1, 11):
        clock.tick()
        save(store, prompt(first, 1))
    clock.tick()
    result = save(store, prompt(11, 1))
    assert result.evicted == 6  # down to 5 blocks including the new one
    assert store.stats().blocks == 5


def test_the_store_budget_spans_namespaces(make_store, clock):
    store = make_store(max_bytes=4 * RECORD, low_water=1.0)
    save(store, prompt(1, 2), namespace="aaaa")
    clock.tick()
    save(store, prompt(1, 2), namespace="bbbb")
    clock.tick()
    save(store, prompt(2, 2), namespace="bbbb")
    assert set(store.stats().namespaces) == {"bbbb"}
    assert store.verify().clean


def test_a_save_larger_than_the_budget_fails_and_changes_nothing(make_store):
    store = make_store(namespace_max_bytes=3 * RECORD)
    save(store, prompt(1, 2))
    before = store.stats()
    with pytest.raises(StoreFullError, match="do not fit the byte budget of namespace") as info:
        save(store, prompt(2, 4))
    assert info.value.budget == 3 * RECORD
    after = store.stats()
    assert (after.blocks, after.bytes) == (before.blocks, before.bytes)
    check_match(store, store.lookup(NS, prompt(1, 2)), prompt(1, 2))


def test_the_blocks_of_the_prompt_being_saved_are_never_evicted(make_store, clock):
    store = make_store(namespace_max_bytes=3 * RECORD, low_water=1.0)
    base = prompt(1, 2)
    save(store, base)
    clock.tick()
    save(store, prompt(2, 1))
    clock.tick()
    longer = base + [9, 9, 9, 9]
    save(store, longer)  # its first two blocks are the oldest, but pinned
    check_match(store, store.lookup(NS, longer), longer)


def test_explicit_evict_and_persisted_budgets(make_store, store_url, clock):
    store = make_store()
    for first in range(1, 5):
        clock.tick()
        save(store, prompt(first, 2))
    assert store.evict(max_bytes=4 * RECORD) == 4 * RECORD
    assert store.stats().blocks == 4
    store.set_budget(2 * RECORD, namespace=NS)
    assert store.settings.budget_for(NS) == 2 * RECORD
    # Down to low_water (0.9) of the budget: 1.8 blocks' worth, so one block stays.
    assert store.evict(namespace=NS) == 3 * RECORD
    assert store.stats().namespaces[NS].max_bytes == 2 * RECORD
    if store_url.startswith("lmdb"):
        store.close()
        assert make_store().settings.budget_for(NS) == 2 * RECORD


def test_lookups_batch_their_recency_updates(store, raw, clock):
    tokens = prompt(1, 2)
    clock.now = 5.0
    save(store, tokens)
    digest = K.chain_digests(K.parse_namespace(NS), K.as_tokens(tokens), 4)[0]
    use_key = K.use_key(K.parse_namespace(NS), digest)

    def last_use():
        with raw.reader() as view:
            return decode_use(view.get(use_key))[0]

    clock.now = 9.0
    store.lookup(NS, tokens)
    assert last_use() == 5.0  # buffered, not written by the lookup
    store.flush()
    assert last_use() == 9.0
    clock.now = 7.0
    store.lookup(NS, tokens)
    store.flush()
    assert last_use() == 9.0  # recency never goes back
