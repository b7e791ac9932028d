"""The backend contract (kvstore.abc.store.Backend), run on every backend.

A new backend joins by adding its kind to ``RAW_BACKENDS`` (conftest.py).
"""

from __future__ import annotations

import pytest

from kvstore.errors import ReadOnlyStoreError
from kvstore.store import open_backend

from .conftest import RAW_BACKENDS, backend_url


@pytest.fixture(params=RAW_BACKENDS)
def backend(request, tmp_path):
    b = open_backend(backend_url(request.param, request, tmp_path))
    yield b
    b.close()


KEYS = [b"kv/a", b"kv/a/1", b"kv/a/2", b"kv/b", b"kv/b\x00", b"kv/c", b"kz"]


def fill(backend):
    assert backend.put_many([(k, k.upper()) for k in KEYS]) == len(KEYS)


def test_get_put_delete(backend):
    fill(backend)
    assert backend.get_many([b"kv/a", b"nope"]) == [b"KV/A", None]
    assert backend.contains_many([b"kv/b", b"kv/q"]) == [True, False]
    assert backend.delete_many([b"kv/b", b"kv/q"]) == 1
    assert backend.get_many([b"kv/b"]) == [None]


def test_put_if_absent_is_idempotent(backend):
    assert backend.put_many([(b"k", b"first")], if_absent=True) == 1
    assert backend.put_many([(b"k", b"second"), (b"j", b"new")], if_absent=True) == 1
    assert backend.get_many([b"k", b"j"]) == [b"first", b"new"]
    assert backend.put_many([(b"k", b"third")]) == 1  # overwrite by default
    assert backend.get_many([b"k"]) == [b"third"]


def test_scans_are_ordered_and_bounded_by_the_prefix(backend):
    fill(backend)
    with backend.reader() as view:
        assert [k for k, _ in view.scan(b"kv/")] == KEYS[:-1]
        assert [k for k, _ in view.scan(b"kv/a/")] == [b"kv/a/1", b"kv/a/2"]
        assert [k for k, _ in view.scan(b"kv/", start=b"kv/b")] == [b"kv/b", b"kv/b\x00", b"kv/c"]
        assert [k for k, _ in view.scan(b"kv/", start=b"kv/b", reverse=True)] == KEYS[2::-1]
        assert [k for k, _ in view.scan(b"kv/", reverse=True)] == KEYS[-2::-1]
        assert [k for k, _ in view.scan(b"kv/a/", start=b"kv/zz")] == []
        assert [bytes(v) for _, v in view.scan(b"kv/c")] == [b"KV/C"]
    assert backend.scan(b"kv/a/", keys_only=True) == [(b"kv/a/1", None), (b"kv/a/2", None)]


def test_a_failed_transaction_writes_nothing(backend):
    fill(backend)

    def half(txn):
        txn.put(b"kv/new", b"x")
        txn.delete(b"kv/a")
        txn.put(b"kv/c", b"changed")
        raise RuntimeError("abort")

    with pytest.raises(RuntimeError, match="abort"):
        backend.transact(half)
    assert backend.get_many([b"kv/new", b"kv/a", b"kv/c"]) == [None, b"KV/A", b"KV/C"]
    with pytest.raises(TypeError):  # the engine rejects the second value mid-transaction
        backend.transact(lambda txn: (txn.put(b"kv/1", b"ok"), txn.put(b"kv/2", object())))
    assert backend.get_many([b"kv/1"]) == [None]


def test_a_transaction_reads_its_own_writes(backend):
    def rmw(txn):
        txn.put(b"n", b"1")
        assert bytes(txn.get(b"n")) == b"1" and txn.contains(b"n")
        assert [k for k, _ in txn.scan(b"n")] == [b"n"]
        txn.delete(b"n")
        return txn.get(b"n")

    assert backend.transact(rmw) is None


def test_views_are_valid_inside_the_block(backend):
    fill(backend)
    with backend.view_many([b"kv/a", b"nope"]) as views:
        assert bytes(views[0]) == b"KV/A"
        assert views[1] is None
        if backend.supports_zero_copy:  # LMDB pages, memory's own bytes: no copy made
            assert isinstance(views[0], memoryview)


def test_keys_lists_without_values(backend):
    fill(backend)
    with backend.reader() as view:
        assert list(view.keys(b"kv/b")) == [b"kv/b", b"kv/b\x00"]
    assert backend.transact(lambda txn: (txn.delete(b"kv/a"), list(txn.keys(b"kv/a")))[1]) == [
        b"kv/a/1",
        b"kv/a/2",
    ]


def test_large_values_round_trip_bit_exactly(backend):
    # Above the Redis test chunk size and the 64 KiB zero-copy threshold.
    big = bytes(range(256)) * 1024 + b"end"
    key = b"kvstore/v1/ns/" + b"ab" * 32  # a record key: stored in chunks on Redis
    assert backend.put_many([(key, memoryview(big)), (b"kv/small", b"s")]) == 2
    assert backend.get_many([key, b"kv/small"]) == [big, b"s"]
    assert backend.put_many([(key, b"replaced")]) == 1
    assert backend.get_many([key]) == [b"replaced"]


def test_stats_count_entries(backend):
    fill(backend)
    assert backend.stats()["entries"] == len(KEYS)


def test_read_only_backends_refuse_writes(tmp_path):
    url = f"lmdb://{tmp_path / 'b'}"
    open_backend(url).close()
    ro = open_backend(url, readonly=True)
    with pytest.raises(ReadOnlyStoreError, match="opened read-only"):
        ro.put_many([(b"k", b"v")])
    assert not ro.supports_writes
    ro.close()
