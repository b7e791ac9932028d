"""Write-behind saves (kvstore.store.kv.writer): the same records as a save, read-your-writes,
flush and close, group commits, failures that reach the handle, the copy taken at hand-off."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from kvstore.abc.store import DURABILITY_MODES
from kvstore.codecs import codec_for
from kvstore.errors import StoreConfigError, StoreFullError, StoreUnavailableError
from kvstore.store import open_store
from kvstore.store.engines.lmdb import LMDBBackend

from .kv_helpers import BLOCK, assert_same_caches, model_for, prompt, token_by_token

POLICIES = ["lossless", "kv:quant:8:64", "kv:turboquant:4:4", "kv:mxfp8"]


@pytest.fixture(scope="module")
def tiny():
    model = model_for("tiny")
    tokens = prompt(7, 3 * BLOCK + 5)
    return model, tokens, token_by_token(model, tokens)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_save_handed_off_stores_the_records_a_save_would(tmp_path, tiny, policy):
    model, tokens, caches = tiny
    kw = {} if policy == "lossless" else {"storage_policy": policy}
    with (
        open_store(f"lmdb://{tmp_path / 'a'}", block_size=BLOCK, **kw) as a,
        open_store(f"lmdb://{tmp_path / 'b'}", block_size=BLOCK, **kw) as b,
    ):
        handle = a.save_behind("ns", tokens, caches)
        assert handle.held_s >= 0
        got, want = handle.result(timeout=60), b.save("ns", tokens, caches)
        assert (got.written, got.written_bytes) == (want.written, want.written_bytes)
        records = list(want.written)
        ra = a.backend.get_many(records)
        rb = b.backend.get_many(records)
        assert ra == rb and all(r is not None for r in ra)


def test_a_lookup_sees_the_saves_handed_off_before_it(tmp_path, tiny):
    model, tokens, caches = tiny
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK, group_window=0.2) as store:
        store.save_behind("ns", tokens, caches)
        match = store.lookup("ns", tokens)  # waits for the namespace's pending save
        assert match.tokens == len(tokens) - 1
        restored = store.restore(match, model.make_cache())
        assert_same_caches(restored, token_by_token(model, tokens[:-1]))


def test_a_lookup_waits_only_for_the_saves_that_can_add_to_it(tmp_path, tiny):
    """A server's lookups: one that parted from a pending save before the rows it adds
    does not wait for its commit; one that shares them waits, and sees them."""
    _, tokens, caches = tiny
    stored = 2 * BLOCK
    gate = threading.Event()
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK) as store:
        store.save("ns", tokens[:stored], caches)
        real = store.put_blocks_many

        def held(saves):
            gate.wait(30)  # the commit waits for the test
            return real(saves)

        store.put_blocks_many = held  # type: ignore[method-assign]
        handle = store.save_behind("ns", tokens, caches)  # adds rows from `stored` on
        called = []
        handle.add_done_callback(called.append)
        parted = [*tokens[:stored], (tokens[stored] + 1) % 256, *tokens[stored + 1 :]]
        assert store.lookup("ns", parted).tokens == stored  # what was stored before
        assert store.lookup("other", tokens).tokens == 0
        assert not handle.done() and called == []  # neither lookup waited for the commit
        gate.set()
        assert store.lookup("ns", [*tokens, 1]).tokens == len(tokens)  # waited: its rows
        assert called == [handle] and handle.done()
        assert handle.queued_s >= 0 and handle.commit_s >= 0
        late: list = []
        handle.add_done_callback(late.append)
        assert late == [handle]  # done already: called at once


def test_saves_past_the_backlogs_bound_are_skipped_and_the_rest_commit(
    tmp_path, tiny, monkeypatch, caplog
):
    """A disk slower than the saves coming in: a save that would take the copies
    waiting for their commit past KVSTORE_BEHIND_MAX_MIB is skipped (its handle says
    so, nothing of it is stored), one alone always goes, and the rest commit."""
    from kvstore.store.kv import writer

    _, tokens, caches = tiny
    monkeypatch.setattr(writer, "MAX_PENDING_BYTES", 1)  # any save waiting fills it
    gate = threading.Event()
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK) as store:
        real = store.put_blocks_many

        def held(saves):
            gate.wait(30)  # the commit waits for the test
            return real(saves)

        store.put_blocks_many = held  # type: ignore[method-assign]
        first = store.save_behind("ns", tokens, caches)  # alone: goes, however large
        with caplog.at_level("WARNING", logger="kvstore.store"):
            skipped = [store.save_behind(f"ns{i}", tokens, caches) for i in range(3)]
        for handle in skipped:
            assert handle.done()
            with pytest.raises(StoreUnavailableError, match=r"Skipped: the saves handed off"):
                handle.result()
        warned = [r for r in caplog.records if "was skipped" in r.getMessage()]
        assert len(warned) == 1  # once until the backlog clears
        gate.set()
        assert first.result(timeout=60).written
        assert store.lookup("ns0", tokens).tokens == 0  # nothing of a skipped save
        again = store.save_behind("ns0", tokens, caches)  # the backlog is empty again
        assert again.result(timeout=60).written
        assert store.lookup("ns0", tokens).tokens == len(tokens) - 1


def test_close_commits_what_was_handed_off(tmp_path, tiny):
    _, tokens, caches = tiny
    url = f"lmdb://{tmp_path / 's'}"
    store = open_store(url, block_size=BLOCK, group_window=0.2)
    handle = store.save_behind("ns", tokens, caches)
    store.close()
    assert handle.done() and handle.result().written
    with open_store(url) as again:
        assert again.lookup("ns", tokens).tokens == len(tokens) - 1


def test_saves_handed_off_together_commit_in_one_transaction(tmp_path, tiny, monkeypatch):
    _, tokens, caches = tiny
    commits = []
    real = LMDBBackend._transact
    monkeypatch.setattr(
        LMDBBackend, "_transact", lambda self, fn, size: commits.append(1) or real(self, fn, size)
    )
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK, group_window=0.5) as store:
        before = len(commits)
        handles = [store.save_behind(f"ns{i}", tokens, caches) for i in range(3)]
        store.flush()
        assert all(h.result().written for h in handles)
        assert len(commits) - before == 1  # one group, one write


def test_sync_commits_each_save_on_its_own(tmp_path, tiny, monkeypatch):
    _, tokens, caches = tiny
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK, durability="sync") as store:
        commits = []
        real = store.put_blocks_many
        gate = threading.Event()

        def counted(saves):
            gate.wait(30)  # the three saves queue up behind the first commit
            commits.append(len(saves))
            return real(saves)

        monkeypatch.setattr(store, "put_blocks_many", counted)
        for i in range(3):
            store.save_behind(f"ns{i}", tokens, caches)
        gate.set()
        store.flush()
        assert commits == [1, 1, 1]


def test_a_failing_save_reaches_its_handle_and_the_others_commit(tmp_path, tiny):
    _, tokens, caches = tiny
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK, group_window=0.3) as store:
        store.set_budget(1024, namespace="small")  # nothing fits: StoreFullError
        bad = store.save_behind("small", tokens, caches)
        good = store.save_behind("big", tokens, caches)
        store.flush()
        with pytest.raises(StoreFullError):
            bad.result()
        assert good.result().written
        assert store.lookup("big", tokens).tokens == len(tokens) - 1


def test_the_hand_off_copies_the_rows_the_cache_may_overwrite(tmp_path):
    """A cache trimmed and refilled after the hand-off: the store keeps what it held then."""
    model = model_for("tiny")
    tokens = prompt(9, 2 * BLOCK)
    caches = token_by_token(model, tokens)
    want = [codec_for(c).snapshot(c, 0, len(tokens)) for c in caches]
    want = [{k: np.array(v) for k, v in s.tensors.items()} for s in want]
    gate = threading.Event()
    with open_store(f"lmdb://{tmp_path / 's'}", block_size=BLOCK) as store:
        real = store.put_blocks_many

        def held(saves):
            gate.wait(30)
            return real(saves)

        store.put_blocks_many = held  # type: ignore[method-assign]
        store.save_behind("ns", tokens, caches)
        for cache in caches:  # overwrite the live rows before the writer reads anything
            cache.trim(len(tokens))
            shape = (1, cache.keys.shape[1], len(tokens), cache.keys.shape[3])
            cache.update_and_fetch(
                mx.ones(shape, cache.keys.dtype), mx.ones(shape, cache.keys.dtype)
            )
        mx.eval([c.keys for c in caches])
        gate.set()
        store.flush()
        restored = store.restore(store.lookup("ns", tokens + [1]), model.make_cache())
        for cache, rows in zip(restored, want, strict=True):
            got = codec_for(cache).snapshot(cache, 0, len(tokens))
            for name, array in got.tensors.items():
                assert np.array_equal(np.array(array), rows[name]), name


def test_durability_is_checked_and_reaches_lmdb(tmp_path):
    assert DURABILITY_MODES[0] == "group"
    with open_store(f"lmdb://{tmp_path / 'a'}", durability="os") as store:
        assert store.durability == "os"
        assert not store.backend.environment.flags()["sync"]
    with open_store(f"lmdb://{tmp_path / 'b'}") as store:
        assert store.durability == "group" and store.backend.environment.flags()["sync"]
    with open_store(f"lmdb://{tmp_path / 'c'}", sync=False) as store:
        assert store.durability == "os"
    with pytest.raises(StoreConfigError, match="durability"):
        open_store(f"lmdb://{tmp_path / 'd'}", durability="fast")
    with pytest.raises(StoreConfigError, match="disagree"):
        open_store(f"lmdb://{tmp_path / 'e'}", durability="sync", sync=False)


def test_memory_and_tiered_stores_write_behind_too(tmp_path, tiny):
    _, tokens, caches = tiny
    for url in ("memory://", f"tiered://?tiers=memory://,lmdb://{tmp_path / 't'}"):
        with open_store(url, block_size=BLOCK) as store:
            store.save_behind("ns", tokens, caches)
            assert store.lookup("ns", tokens).tokens == len(tokens) - 1
