"""Fixtures for the store tests: every conformance test runs on every backend.

``store_url`` is parametrised over memory, LMDB, one real ``redis-server``,
a real 3-node Redis Cluster and a tiered store (memory -> LMDB -> Redis).
The servers are started once per session on free loopback ports, without
persistence, and stopped afterwards. Without ``redis-server`` the Redis
cases skip locally but FAIL under ``CI=true``: CI never passes by skipping.
"""

from __future__ import annotations

import itertools
import os

import pytest

from kvstore.store import open_backend, open_store
from kvstore.store.engines import lmdb_values
from kvstore.testing.redis_servers import RedisClusterServers, RedisServer, redis_binaries
from kvstore.testing.store import verify_record

from .raw import TieredRaw

NS = "testns"
BACKENDS = ["memory", "lmdb", "redis", "redis-cluster", "tiered"]
#: Backends of the contract tests (a tiered store is stores, not a backend).
RAW_BACKENDS = ["memory", "lmdb", "redis", "redis-cluster"]
#: Records are ~100 bytes: chunks this small make most of them several chunk keys.
CHUNK = 48


def require_redis_server() -> None:
    """Skip without redis-server/redis-cli, except under CI, where that is a failure."""
    if redis_binaries() is not None:
        return
    message = "redis-server and redis-cli are needed (apt-get install redis-server)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{message}; under CI=true the Redis tests must run, not skip")
    pytest.skip(message)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One redis-server for the session (tests keep apart by key_prefix)."""
    require_redis_server()
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A 3-node Redis Cluster (no replicas) for the session."""
    require_redis_server()
    with RedisClusterServers(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


_names = itertools.count()


def backend_url(kind: str, request, tmp_path) -> str:
    """A fresh, empty store location of ``kind``."""
    n = next(_names)
    if kind == "memory":
        return f"memory://test-{n}"
    if kind == "lmdb":
        return f"lmdb://{tmp_path / f'store{n}'}"
    if kind == "redis":
        server = request.getfixturevalue("redis_server")
        return f"{server.url}?key_prefix=t{n}/&chunk_size={CHUNK}"
    if kind == "redis-cluster":
        cluster = request.getfixturevalue("redis_cluster")
        return f"{cluster.url}?key_prefix=t{n}/&chunk_size={CHUNK}"
    assert kind == "tiered", kind
    redis = backend_url("redis", request, tmp_path).replace("?", "%3F").replace("&", "%26")
    return f"tiered://?tiers=memory://test-{n},lmdb://{tmp_path / f'tier{n}'},{redis}"


class Clock:
    """A clock the test moves by hand, so recency (and eviction order) is deterministic."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture(params=BACKENDS)
def store_url(request, tmp_path):
    return backend_url(request.param, request, tmp_path)


@pytest.fixture
def make_store(store_url, clock):
    """``make_store(**options)`` opens the test's store (again); all are closed at teardown."""
    opened = []

    def make(**options):
        options.setdefault("block_size", 4)
        options.setdefault("verify", verify_record)
        options.setdefault("clock", clock)
        options.setdefault("touch_interval", 0)
        if store_url.startswith("lmdb"):
            options.setdefault("map_size", 1 << 20)
        if store_url.startswith("redis"):
            options.setdefault("socket_timeout", 5)
        store = open_store(store_url, **options)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def store(make_store):
    return make_store()


@pytest.fixture
def raw(store_url):
    """The test store's backend, opened alone: reads and writes that bypass the store API
    (for a tiered store, every tier's backend: writes go to all, reads to the fastest)."""
    backend = (
        TieredRaw.open(store_url) if store_url.startswith("tiered") else open_backend(store_url)
    )
    yield backend
    backend.close()


def engine_of(store):
    """The engine that persists ``store``'s blocks (a tiered store's slowest tier's)."""
    tiers = getattr(store, "tiers", None)
    return (tiers[-1] if tiers else store).backend


class _ChecksAtTheEnd:
    """A read's checks, run when first waited for (``intact()``, or the read's end)
    instead of on a thread from the start: after a restore's copies."""

    def __init__(self, check):
        self._check, self._result = check, None

    def result(self):
        if self._check is not None:
            self._result, self._check = self._check(), None
        return self._result


@pytest.fixture
def copied_digests(monkeypatch):
    """Restores on the CPU copy record by record and may hash each record as they copy
    it, however small (``record_copies``' thresholds lowered, two copying threads); the
    list of the digests the readers handed the checks."""
    from kvstore.codecs import copied_sums, fill, record_copies

    monkeypatch.setattr(fill, "DIRECT_MIN_BYTES", 0)
    monkeypatch.setattr(record_copies, "CLAIM_MIN_BYTES", 0)
    monkeypatch.setattr(record_copies, "PIECE_MIN_BYTES", 0)
    monkeypatch.setenv("KVSTORE_COPY_THREADS", "2")
    resolved: list[int] = []
    real = copied_sums.Claims.resolve

    def resolve(self, record, digest):
        resolved.append(digest)
        real(self, record, digest)

    monkeypatch.setattr(copied_sums.Claims, "resolve", resolve)
    return resolved


@pytest.fixture
def hashed_as_copied(copied_digests, monkeypatch):
    """:func:`copied_digests`, the checks waiting until the copies are done: every
    record is hashed by its copy."""
    from kvstore.store.blocks import reading

    monkeypatch.setattr(reading, "in_background", _ChecksAtTheEnd)
    return copied_digests


@pytest.fixture
def small_values(monkeypatch):
    """Values of 4 KiB or more go to a store's value file (1 MiB in use): small test
    records do (``pytestmark = pytest.mark.usefixtures("small_values")``)."""
    monkeypatch.setattr(lmdb_values, "VALUE_MIN", 4096)
