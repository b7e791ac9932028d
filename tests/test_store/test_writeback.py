"""A large synced LMDB commit starts its writeback early (kvstore.store.engines.writeback):
the pump runs during such commits only, leaves the records as a commit without it does,
stops with the store, and is off where it cannot help."""

from __future__ import annotations

import sys
import time

import pytest

from kvstore.store import open_store
from kvstore.store.engines import writeback

from .store_worker import NS, open_, prompt, save

LINUX = sys.platform.startswith("linux")
BIG = 5 << 20  # one record over writeback.MIN_BYTES


def started_after(pump: writeback.Writeback, count: int, timeout: float = 10.0) -> int:
    """The pump's count of writebacks started, once it exceeds ``count`` (or the timeout)."""
    deadline = time.monotonic() + timeout
    while pump.started <= count and time.monotonic() < deadline:
        time.sleep(0.005)
    return pump.started


@pytest.mark.skipif(not LINUX, reason="sync_file_range(2) is Linux's")
def test_a_large_synced_commit_starts_its_writeback_and_stores_what_it_would_without(tmp_path):
    tokens = prompt(1, 3)
    with_pump = open_(tmp_path / "a")
    pump = with_pump.backend.writeback
    assert isinstance(pump, writeback.Writeback) and pump.started == 0
    save(with_pump, tokens, filler=BIG)
    assert started_after(pump, 0) >= 1
    with open_store(f"lmdb://{tmp_path / 'b'}", block_size=16, sync=True) as plain:
        plain.backend.writeback.close()  # the same commits, LMDB's alone
        save(plain, tokens, filler=BIG)
        keys = list(plain.lookup(NS, tokens).blocks)
        want = plain.backend.get_many([ref.key for ref in keys])
    got = with_pump.backend.get_many([ref.key for ref in keys])
    assert got == want and all(v is not None for v in got)
    assert with_pump.verify().clean
    with_pump.close()


@pytest.mark.skipif(not LINUX, reason="sync_file_range(2) is Linux's")
def test_small_commits_leave_the_pump_asleep_and_close_stops_it(tmp_path):
    store = open_(tmp_path / "s")
    pump = store.backend.writeback
    for i in range(5):
        save(store, prompt(2, i))  # records of a few hundred bytes
    assert pump.started == 0 and pump._thread is None  # never started
    save(store, prompt(2, 9), filler=BIG)
    started_after(pump, 0)
    thread = pump._thread
    assert thread is not None and thread.is_alive()
    store.close()
    assert not thread.is_alive() and pump._fd is None


def test_no_pump_where_commits_are_not_synced_or_it_is_switched_off(tmp_path, monkeypatch):
    with open_store(f"lmdb://{tmp_path / 'os'}", sync=False) as unsynced:
        assert unsynced.backend.writeback is None
    with open_store(f"lmdb://{tmp_path / 'ro'}") as store:
        save(store, prompt(3, 0))
    with open_store(f"lmdb://{tmp_path / 'ro'}", readonly=True) as readonly:
        assert readonly.backend.writeback is None
    monkeypatch.setenv("KVSTORE_COMMIT_WRITEBACK", "0")
    with open_store(f"lmdb://{tmp_path / 'off'}") as off:
        assert off.backend.writeback is None
        save(off, prompt(3, 1), filler=BIG)  # commits as LMDB makes them
        assert off.lookup(NS, prompt(3, 1)).hit
    if not LINUX:
        monkeypatch.delenv("KVSTORE_COMMIT_WRITEBACK")
        with open_store(f"lmdb://{tmp_path / 'mac'}") as elsewhere:
            assert elsewhere.backend.writeback is None
