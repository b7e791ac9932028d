"""The store state machine (``test_state_machine``) with real caches of a tiny model.

Same rules and the same dict-of-token-tuples model -- save, lookup,
delete, evict, reopen, byte budgets -- but a save stores the caches of a real
model (``store.save``) and every lookup is followed by ``store.restore``,
which must give caches bit-identical to the model's own computation of the
matched prefix. Caches are computed token by token, so a prefix's rows are
the same whichever prompt computed them.
"""

from __future__ import annotations

import functools

from hypothesis import settings

from kvstore.abc.store import Match, SaveResult
from kvstore.bridge.namespace import namespace_for_model
from kvstore.codecs import encode_record
from kvstore.store.kv.save import BlockEncoder

from .kv_helpers import assert_same_caches, model_for, token_by_token
from .test_state_machine import NS, B, StoreMachine, _start


@functools.cache
def computed(q: tuple[int, ...]) -> list:
    return token_by_token(model_for("tiny"), q)


@functools.cache
def record_bytes(rows: int) -> int:
    """A block's record size depends on its rows only (small positions pack alike)."""
    caches = computed((0,) * (B + rows))
    return len(encode_record(BlockEncoder(caches, "lossless", {}).layers(B, B + rows)))


class CacheStoreMachine(StoreMachine):
    budget_unit = 4 * record_bytes(B)

    def record_bytes(self, block: tuple[int, ...]) -> int:
        return record_bytes(len(block) - _start(block))

    def put(self, q: tuple[int, ...]) -> SaveResult:
        return self.store.save(NS, list(q), computed(q))

    def check(self, match: Match, q: tuple[int, ...]) -> None:
        model = model_for("tiny")
        restored = self.store.restore(match, model.make_cache())
        assert restored[0].offset == match.tokens, (q, match)
        assert_same_caches(restored, computed(q[: match.tokens]))

    def store_options(self) -> dict:
        return {}  # the default verify: kvstore's record format


class LMDBCacheStoreMachine(CacheStoreMachine):
    backend = "lmdb"


def test_the_namespace_of_the_machine_is_a_model_namespace():
    """The machine uses a fixed namespace; a model's own one is as valid a key."""
    assert namespace_for_model(model_for("tiny")) != NS


FEW = settings(max_examples=max(15, settings.default.max_examples // 8), stateful_step_count=25)
TestMemoryCacheStore = CacheStoreMachine.TestCase
TestMemoryCacheStore.settings = FEW
TestLMDBCacheStore = LMDBCacheStoreMachine.TestCase
TestLMDBCacheStore.settings = FEW
