"""A hypothesis state machine: save/lookup/delete/evict/reopen against a dict-of-token-tuples model.

The model is the specification written with plain tuples: it maps each
stored block to the token prefix it ends (``tokens[:stop]``) and applies the
documented rules directly -- chain walk, best child, one token left for the
model, tail dedup and supersession, least-recently-used leaf eviction with
the low-water mark, delete by prefix. After every step the store must hold
exactly the model's blocks, and every restore must give exactly the rows of
the prompt.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvstore.abc.store import Match, SaveResult
from kvstore.errors import StoreFullError
from kvstore.store import keys as K
from kvstore.store import open_store
from kvstore.testing.store import check_match, encoder_for, make_record, prefix_rows, verify_record

from .conftest import engine_of

B = 3
NS = "machine"
LOW_WATER = 0.75
tokens = st.lists(st.integers(0, 2), max_size=13)


def nbytes(block: tuple[int, ...]) -> int:
    """Bytes of a block's record: its rows (one per token after its start) plus the header."""
    return len(make_record(prefix_rows(block)[_start(block) :]))


def _start(block: tuple[int, ...]) -> int:
    return (len(block) - 1) // B * B


class Model:
    """Stored blocks as ``prefix tuple -> last use``; the spec of the store, executable.

    ``nbytes(block)``: the size of a block's record (synthetic records by default).
    """

    def __init__(self, nbytes: Callable[[tuple[int, ...]], int] = nbytes) -> None:
        self.blocks: dict[tuple[int, ...], float] = {}
        self.ns = K.parse_namespace(NS)
        self.nbytes = nbytes

    # What a block is.
    @staticmethod
    def parent(b: tuple[int, ...]) -> tuple[int, ...]:
        return b[: _start(b)]

    def key(self, b: tuple[int, ...]) -> bytes:
        start = _start(b)
        parents = K.chain_digests(self.ns, K.as_tokens(b[:start]), B)
        digest = K.block_digest(parents[-1] if parents else K.ROOT, self.ns, K.as_tokens(b[start:]))
        return K.record_key(self.ns, digest)

    def children(self, p: tuple[int, ...]) -> list[tuple[int, ...]]:
        return [b for b in self.blocks if len(b) > len(p) and self.parent(b) == p]

    def total(self) -> int:
        return sum(self.nbytes(b) for b in self.blocks)

    # The rules.
    def lookup(self, q: tuple[int, ...]) -> tuple[int, list[tuple[int, ...]]]:
        """(tokens reusable, the extension blocks that would be equally good)."""
        if len(q) < 2:
            return 0, []
        k = 0
        while (k + 1) * B <= len(q) and q[: (k + 1) * B] in self.blocks:
            k += 1
        matched, best, ties = k * B, 0, []
        for c in self.children(q[:matched]):
            lcp = 0
            while matched + lcp < min(len(c), len(q)) and c[matched + lcp] == q[matched + lcp]:
                lcp += 1
            if lcp > best:
                best, ties = lcp, [c]
            elif lcp == best and lcp:
                ties.append(c)
        return min(matched + best, len(q) - 1), ties

    def evict_to(self, target: int, pinned: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
        gone, total = [], self.total()
        while total > target:
            leaves = [b for b in self.blocks if b not in pinned and not self.children(b)]
            if not leaves:
                break
            victim = min(leaves, key=lambda b: (self.blocks[b], -(_start(b) // B), self.key(b)))
            del self.blocks[victim]
            gone.append(victim)
            total -= self.nbytes(victim)
        return gone


class StoreMachine(RuleBasedStateMachine):
    """The store against :class:`Model`, with synthetic records.

    A subclass with other records overrides :meth:`record_bytes`,
    :meth:`put`, :meth:`check` and :meth:`store_options`, and ``budget_unit``
    (budgets drawn are none, one or two units: a few blocks' worth).
    """

    backend = "memory"
    server_url = ""  # the Redis machine's server (set by a fixture)
    prompts = Bundle("prompts")
    budget_unit = 200

    def __init__(self) -> None:
        super().__init__()
        self.model = Model(self.record_bytes)
        self.now = 0.0
        self.dir = tempfile.mkdtemp(prefix="kvstore-machine-")
        if self.backend == "redis":  # a fresh key prefix on the session's server
            self.url = f"{self.server_url}?key_prefix={os.path.basename(self.dir)}/&chunk_size=48"
        else:
            self.url = f"lmdb://{self.dir}/s" if self.backend == "lmdb" else "memory://"
        self.store = None

    # -- what the records are (synthetic here) -------------------------------------
    def record_bytes(self, block: tuple[int, ...]) -> int:
        return nbytes(block)

    def put(self, q: tuple[int, ...]) -> SaveResult:
        return self.store.put_blocks(NS, list(q), encoder_for(list(q)))

    def check(self, match: Match, q: tuple[int, ...]) -> None:
        """Reading ``match`` gives exactly the rows of ``q``'s first ``match.tokens`` tokens."""
        check_match(self.store, match, list(q), row_bytes=16)

    def store_options(self) -> dict[str, Any]:
        return {"verify": verify_record}

    # -- the machine ------------------------------------------------------------------
    def open(self):
        if self.backend == "memory":  # a private memory store, for this run only
            assert self.store is None
        options = {"map_size": 1 << 20, "sync": False} if self.backend == "lmdb" else {}
        return open_store(
            self.url,
            block_size=B,
            namespace_max_bytes=self.budget,
            clock=lambda: self.now,
            touch_interval=0,
            low_water=LOW_WATER,
            **options,
            **self.store_options(),
        )

    @initialize(budget=st.sampled_from([None, None, 1, 2]))
    def start(self, budget):
        self.budget = None if budget is None else budget * self.budget_unit
        self.store = self.open()

    def tick(self) -> None:
        self.now += 1.0

    @rule(target=prompts, tokens=tokens)
    def save_new(self, tokens):
        return self.save(tuple(tokens))

    @rule(target=prompts, base=prompts, cut=st.integers(0, 13), more=tokens)
    def save_extended(self, base, cut, more):
        return self.save(base[:cut] + tuple(more))

    def save(self, q):
        self.tick()
        m = self.model
        spans = [q[:j] for j in range(B, len(q) + 1, B)] + ([q] if len(q) % B else [])
        existing = [s for s in spans if s in m.blocks]
        try:
            result = self.put(q)
        except StoreFullError:
            result = None
        cover = None
        if len(q) % B and q not in m.blocks:  # a tail a stored sibling may already hold
            covering = {m.key(c): c for c in m.children(m.parent(q)) if c[: len(q)] == q}
            if covering:
                assert result is None or result.covered_by in covering
                cover = covering[result.covered_by] if result else next(iter(covering.values()))
                existing.append(cover)
        new = [s for s in spans if s not in m.blocks and not (s == q and cover is not None)]
        superseded = [
            t
            for s in new
            for t in m.children(m.parent(s))
            if len(t) % B and len(t) < len(s) and s[: len(t)] == t
        ]
        delta = sum(map(m.nbytes, new)) - sum(map(m.nbytes, superseded))
        before = dict(m.blocks)
        if self.budget is not None and delta > 0 and m.total() + delta > self.budget:
            m.evict_to(math.floor(self.budget * LOW_WATER) - delta, {*existing, *superseded})
            if m.total() + delta > self.budget:
                m.blocks = before
                assert result is None, "the store saved what the model says cannot fit"
                return q
        assert result is not None, "the store refused a save the model says fits"
        assert sorted(result.written) == sorted(m.key(s) for s in new)
        assert result.superseded == len(superseded)
        for t in superseded:
            del m.blocks[t]
        for s in new:
            m.blocks[s] = self.now
        for s in existing:
            m.blocks[s] = max(m.blocks[s], self.now)
        return q

    @rule(base=prompts, cut=st.integers(0, 13), more=tokens)
    def lookup(self, base, cut, more):
        self.tick()
        q = base[:cut] + tuple(more)
        match = self.store.lookup(NS, list(q))
        expected, ties = self.model.lookup(q)
        assert match.tokens == expected, (q, match, expected)
        if match.hit:
            self.check(match, q)
            keys = {r.key for r in match.blocks}
            used = [b for b in self.model.blocks if self.model.key(b) in keys]
            assert len(used) == len(match.blocks)
            if ties and match.blocks[-1].index * B == _start(ties[0]):
                assert match.blocks[-1].key in {self.model.key(t) for t in ties}
            for b in used:
                self.model.blocks[b] = max(self.model.blocks[b], self.now)

    @rule(base=prompts, cut=st.integers(0, 13))
    def delete(self, base, cut):
        self.tick()
        prefix = base[:cut]
        gone = [
            b for b in self.model.blocks if len(b) >= len(prefix) and b[: len(prefix)] == prefix
        ]
        assert self.store.delete(NS, list(prefix)) == len(gone)
        for b in gone:
            del self.model.blocks[b]

    @rule(fraction=st.floats(0, 1))
    def evict(self, fraction):
        self.tick()
        limit = int(self.model.total() * fraction)
        freed = self.store.evict(max_bytes=max(limit, 1))
        gone = self.model.evict_to(max(limit, 1), set())
        assert freed == sum(map(self.model.nbytes, gone))

    @precondition(lambda self: self.backend in ("lmdb", "redis"))
    @rule()
    def reopen(self):
        self.store.close()
        self.store = self.open()

    @invariant()
    def same_blocks(self):
        if self.store is None:
            return
        with engine_of(self.store).reader() as view:  # raw keys, bypassing the store API
            stored = {
                k
                for k, _ in view.scan(K.SCHEMA + K.parse_namespace(NS) + b"/")
                if K.split_record_key(k)
            }
        assert stored == {self.model.key(b) for b in self.model.blocks}
        stats = self.store.stats()
        assert (stats.blocks, stats.bytes) == (len(self.model.blocks), self.model.total())

    def teardown(self):
        if self.store is not None:
            assert self.store.verify().clean
            self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class LMDBStoreMachine(StoreMachine):
    backend = "lmdb"


class RedisStoreMachine(StoreMachine):
    backend = "redis"


@pytest.fixture
def machine_redis(redis_server):
    RedisStoreMachine.server_url = redis_server.url


# A third of the profile's examples (100 by default, more under HYPOTHESIS_PROFILE=ci).
MACHINE_SETTINGS = settings(
    max_examples=max(40, settings.default.max_examples // 3), stateful_step_count=30
)
TestMemoryStore = StoreMachine.TestCase
TestMemoryStore.settings = MACHINE_SETTINGS
TestLMDBStore = LMDBStoreMachine.TestCase
TestLMDBStore.settings = MACHINE_SETTINGS
# Every step is a few round trips to a real server: fewer, shorter runs.
TestRedisStore = pytest.mark.usefixtures("machine_redis")(RedisStoreMachine.TestCase)
TestRedisStore.settings = settings(max_examples=30, stateful_step_count=25)
