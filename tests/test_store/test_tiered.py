"""Tiered stores: fast-to-slow lookups, promotion, write-through/back, a slow tier down.

The store semantics run on a tiered store in the shared suite (``store_url``
in conftest.py); this file checks what tiering adds.
"""

from __future__ import annotations

import pytest

from kvstore.abc.store import MissReason
from kvstore.errors import StoreConfigError, StoreUnavailableError
from kvstore.store import keys as K
from kvstore.store import open_store
from kvstore.store.blocks.index import decode_use
from kvstore.store.blocks.tiered import TieredPrefixStore, _owned
from kvstore.testing.redis_servers import RedisServer
from kvstore.testing.store import check_match, encoder_for, verify_record

from .conftest import NS, backend_url, require_redis_server

OPTIONS = {"block_size": 4, "verify": verify_record, "touch_interval": 0}


def save(store, tokens):
    return store.put_blocks(NS, tokens, encoder_for(tokens))


@pytest.fixture
def tier_urls(request, tmp_path):
    return [
        backend_url("memory", request, tmp_path),
        backend_url("lmdb", request, tmp_path),
        backend_url("redis", request, tmp_path),
    ]


def test_open_forms(tier_urls, tmp_path):
    with open_store("tiered", tiers=tier_urls, **OPTIONS) as store:
        assert isinstance(store, TieredPrefixStore) and store.write == "through"
        assert [t.url for t in store.tiers] == tier_urls
    encoded = ",".join(u.replace("?", "%3F").replace("&", "%26") for u in tier_urls)
    with open_store(f"tiered://?tiers={encoded}&write=back&promote=false", **OPTIONS) as store:
        assert (store.write, store.promote) == ("back", False)
        assert [t.url for t in store.tiers] == tier_urls
    mine = open_store("memory://", **OPTIONS)
    with open_store("tiered", tiers=[mine, tier_urls[1]], **OPTIONS) as store:
        assert store.tiers[0] is mine  # open stores are used as they are


@pytest.mark.parametrize(
    "options, message",
    [
        ({"tiers": ["memory://"]}, "at least two tiers"),
        ({}, "needs tiers, fastest first"),
        (
            {"tiers": ["memory://", "memory://"], "write": "sideways"},
            "write is 'through' or 'back'",
        ),
        ({"tiers": ["memory://", "memory://"], "map_size": 1}, "map_size are not options"),
    ],
)
def test_bad_tiered_options(options, message):
    with pytest.raises(StoreConfigError, match=message):
        open_store("tiered", **options)


def test_tiers_must_share_a_block_size():
    a, b = open_store("memory://", block_size=4), open_store("memory://", block_size=8)
    with pytest.raises(StoreConfigError, match="one block size"):
        TieredPrefixStore([a, b])


def test_a_hit_in_a_slower_tier_is_promoted(tier_urls):
    store = open_store("tiered", tiers=tier_urls, **OPTIONS)
    fast, local, shared = store.tiers
    tokens = list(range(18))
    save(shared, tokens)  # another host saved it: only the shared tier has it
    match = store.lookup(NS, tokens)
    assert match.tokens == 17
    check_match(store, match, tokens)
    store.flush()  # promotion runs in the background
    for tier in (fast, local):
        assert tier.stats().blocks == 5
        check_match(tier, tier.lookup(NS, tokens), tokens)
    asked = shared.activity()["lookups"]
    check_match(store, store.lookup(NS, tokens), tokens)
    assert shared.activity()["lookups"] == asked  # the fast tier answered alone
    assert store.background_error is None
    stats = store.stats()
    assert (stats.lookups, stats.hits, stats.misses) == (2, 2, {})
    store.close()


def test_promotion_takes_redis_payloads_without_a_copy():
    payload = b"x" * 100
    assert _owned(memoryview(payload)) is payload
    sliced = memoryview(payload)[10:]
    assert _owned(sliced) == payload[10:] and _owned(sliced) is not payload


def test_tiers_not_asked_still_learn_of_the_use(tier_urls, clock):
    store = open_store("tiered", tiers=tier_urls, clock=clock, **OPTIONS)
    tokens = list(range(9))
    clock.now = 1.0
    save(store, tokens)
    clock.now = 5.0
    assert store.lookup(NS, tokens).tokens == 8
    store.flush()
    ns = K.parse_namespace(NS)
    use = K.use_key(ns, K.chain_digests(ns, K.as_tokens(tokens), 4)[0])
    for tier in store.tiers:
        with tier.backend.reader() as view:
            assert decode_use(view.get(use))[0] == 5.0
    store.close()


def test_write_back_saves_the_fast_tier_now_and_the_rest_later(tier_urls):
    store = open_store("tiered", tiers=tier_urls, write="back", **OPTIONS)
    tokens = list(range(10))
    result = save(store, tokens)
    assert len(result.written) == 3 and store.tiers[0].stats().blocks == 3
    store.flush()
    for tier in store.tiers[1:]:
        check_match(tier, tier.lookup(NS, tokens), tokens)
    store.close()


def test_a_corrupt_fast_copy_is_served_from_a_slower_tier(tier_urls):
    store = open_store("tiered", tiers=tier_urls, **OPTIONS)
    tokens = list(range(13))
    written = save(store, tokens).written
    fast = store.tiers[0].backend
    damaged = bytearray(fast.get_many([written[1]])[0])
    damaged[20] ^= 4
    fast.put_many([(written[1], bytes(damaged))])
    check_match(store, store.lookup(NS, tokens), tokens)  # every block, right rows
    assert store.stats().misses == {}  # the caller saw no miss...
    assert store.tiers[0].stats().misses == {MissReason.CORRUPT: 1}  # ...the fast tier did
    store.close()


def test_a_shared_tier_that_is_down_does_not_stop_the_local_ones(tmp_path, request):
    require_redis_server()
    with RedisServer(tmp_path / "shared") as server:
        shared = f"{server.url}?key_prefix=x/&socket_timeout=0.5&connect_timeout=0.5"
        store = open_store(
            "tiered", tiers=[backend_url("memory", request, tmp_path), shared], **OPTIONS
        )
        server.kill()
        tokens = list(range(10))
        with pytest.raises(StoreUnavailableError):  # raised after the memory tier saved
            save(store, tokens)
        check_match(store, store.lookup(NS, tokens), tokens)  # served locally
        other = list(range(50, 60))
        assert not store.lookup(NS, other).hit  # the shared tier is a miss, not an error
        activity = store.activity()  # stats() would ask the shared tier for its contents
        assert activity["misses"] == {MissReason.UNAVAILABLE: 1, MissReason.COLD: 1}
        store.close()


def test_a_tiered_store_uses_its_tiers_through_the_store_contract(tmp_path):
    """No engine of its own: ``holds`` and ``set_budget`` go to each tier as store verbs."""
    from kvstore.errors import CapabilityError

    urls = ["memory://contract-fast", f"lmdb://{tmp_path / 'slow'}"]
    with open_store("tiered", tiers=urls, **OPTIONS) as store:
        with pytest.raises(CapabilityError, match="no single backend; open one of its tiers"):
            store.backend  # noqa: B018
        tokens = [1, 2, 3, 4, 5, 6]
        save(store, tokens)
        key = store.lookup(NS, [*tokens, 7]).blocks[0].key
        missing = K.record_key(K.parse_namespace(NS), b"\0" * 16)
        assert store.holds([key, missing]) == [True, False]
        store.tiers[0].delete(NS)  # gone from the fast tier: the slow one still holds it
        assert store.holds([key]) == [True]
        store.set_budget(1 << 20, namespace=NS)
        assert [t.settings.budget_for(NS) for t in store.tiers] == [1 << 20, 1 << 20]
