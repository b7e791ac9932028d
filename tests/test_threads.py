"""Thread pools started before their first real task (kvstore.threads)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings

import pytest

from kvstore.threads import KeptPool, started_pool


def test_a_started_pool_has_every_thread_running_when_it_returns():
    pool = started_pool(3, "test-started")
    try:
        assert len(pool._threads) == 3
        names = {pool.submit(lambda: threading.current_thread().name).result() for _ in range(9)}
        assert all(name.startswith("test-started") for name in names)
    finally:
        pool.shutdown()


def test_a_kept_pool_is_made_at_its_first_use_with_the_workers_then_and_kept():
    asked = []

    def workers() -> int:
        asked.append(1)
        return 2

    kept = KeptPool("test-kept", workers)
    assert not asked  # nothing made until used
    pool = kept.get()
    assert kept.get() is pool and len(asked) == 1
    assert len(pool._threads) == 2
    kept.forget()
    assert kept.get() is not pool and len(asked) == 2
    kept.forget()


def test_one_pool_is_made_when_many_threads_ask_at_once():
    kept = KeptPool("test-race", lambda: 2)
    got: list = []
    askers = [threading.Thread(target=lambda: got.append(kept.get())) for _ in range(8)]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join()
    assert len({id(pool) for pool in got}) == 1
    kept.forget()


def test_a_forked_child_makes_its_own_pool_where_the_parents_threads_are_gone():
    kept = KeptPool("test-fork", lambda: 2)
    assert kept.get().submit(lambda: 1).result() == 1
    with warnings.catch_warnings():  # Python 3.12+: forking a process with threads warns
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: the parent's pool has no threads here
        try:
            ok = kept.get().submit(lambda: 2).result(timeout=10) == 2
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    kept.forget()
    assert os.waitstatus_to_exitcode(status) == 0


def test_opening_a_store_starts_the_threads_a_restore_copies_and_checks_on(tmp_path):
    from kvstore.codecs import copies
    from kvstore.store import open_store
    from kvstore.store.blocks import checks

    pools = [copies._POOL, checks._POOL, checks._BACKGROUND]
    for pool in pools:
        pool.forget()
    assert all(pool._pool is None for pool in pools)
    with open_store(f"lmdb://{tmp_path / 's'}"):
        assert all(pool._pool is not None for pool in pools)


def test_a_process_limited_to_one_core_sizes_its_threads_by_it():
    # A container or taskset gives a process fewer cores than the machine has: its
    # copy threads and CPU streams follow its affinity, not os.cpu_count().
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this OS (macOS): os.cpu_count() is all there is")
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
        "from kvstore.threads import cores; from kvstore.codecs import copies;"
        "from kvstore.cpu_streams import stream_count;"
        "print(cores(), copies.threads(), stream_count(), os.cpu_count())"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    assert out[:3] == ["1", "1", "1"], out
