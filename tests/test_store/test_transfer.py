"""Moving blocks as they are indexed (kvstore.store.maintenance.transfer): the parents-first walk,
copies that keep keys and totals exact, pruning."""

from __future__ import annotations

import itertools
import random

from kvstore.store import keys as K
from kvstore.store import open_store
from kvstore.store.maintenance.transfer import ChainWalk, copy_block, namespaces_of, prune_blocks
from kvstore.testing.store import check_match, encoder_for, verify_record

from .conftest import NS, engine_of

_copies = itertools.count()


def save_tree(store, seed: int = 0) -> list[list[int]]:
    """Prompts branching at many depths, with more siblings than a walk page."""
    rng = random.Random(seed)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, rng.randrange(50)] for _ in range(5)]
    prompts += [[1, 2, 3, 4, 100 + i, 6, 7, 8, 9] for i in range(7)]
    prompts += [[rng.randrange(3) for _ in range(rng.randrange(2, 21))] for _ in range(12)]
    for p in prompts:
        store.put_blocks(NS, p, encoder_for(p))
    return prompts


def walk(store, **kw):
    return list(ChainWalk(engine_of(store), NS.encode(), page=2, **kw))


def test_the_walk_yields_every_block_once_parents_first(store):
    save_tree(store)
    seen: set[bytes] = set()
    blocks = walk(store)
    for b in blocks:
        assert b.entry.parent == K.ROOT or b.entry.parent in seen, "a child before its parent"
        assert b.entry.digest not in seen
        seen.add(b.entry.digest)
    assert len(blocks) == store.stats().blocks
    assert {b.record_key for b in blocks} == {
        K.record_key(NS.encode(), b.entry.digest) for b in walk(store)
    }


def test_skip_after_and_root_select_subtrees(store):
    save_tree(store)
    blocks = walk(store)
    first = blocks[0]
    below = walk(store, root=first.entry.digest)
    assert below and all(b.entry.depth > first.entry.depth for b in below)
    w = ChainWalk(engine_of(store), NS.encode(), page=2)
    kept = []
    for b in w:
        kept.append(b)
        if b.entry.digest == first.entry.digest:
            w.skip_after(b)
    assert len(kept) == len(blocks) - len(below)


def test_copies_keep_lookups_totals_and_are_idempotent(store):
    prompts = save_tree(store)
    url = f"memory://transfer-{next(_copies)}"
    with open_store(url, block_size=4, verify=verify_record, touch_interval=0) as copy:
        for _ in range(2):  # the second pass writes nothing
            written = 0
            for b in walk(store):
                record, use = engine_of(store).get_many([b.record_key, b.use_key])
                written += copy.backend.transact(
                    lambda txn, b=b, r=record, u=use: copy_block(txn, b, r, use=u)
                )
        assert written == 0
        assert copy.stats().namespaces == store.stats().namespaces
        assert copy.verify().clean
        for p in prompts:
            match = copy.lookup(NS, p)
            assert match == store.lookup(NS, p)
            check_match(copy, match, p)

        # prune: drop every block holding token 100..106 at position 4, and what follows
        def keep(keys):
            return [k not in doomed for k in keys]

        doomed = {
            b.record_key for b in walk(copy) if b.entry.depth == 1 and b.entry.tokens[0] >= 100
        }
        removed = prune_blocks(copy.backend, NS.encode(), keep, page=2)
        assert removed == len(doomed) + sum(
            len(walk(store, root=b.entry.digest)) for b in walk(store) if b.record_key in doomed
        )
        assert copy.verify().clean and copy.stats().blocks == store.stats().blocks - removed
        assert namespaces_of(copy.backend)[NS.encode()][0] == copy.stats().blocks
