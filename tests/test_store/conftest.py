"""Fixtures for the store tests: every conformance test runs on memory and on LMDB."""

from __future__ import annotations

import itertools

import pytest

from kvstore.store import open_backend, open_store
from kvstore.testing.store import verify_record

NS = "testns"
BACKENDS = ["memory", "lmdb"]


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


_names = itertools.count()


@pytest.fixture(params=BACKENDS)
def store_url(request, tmp_path):
    if request.param == "memory":
        return f"memory://test-{next(_names)}"
    return f"lmdb://{tmp_path / 'store'}"


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
    """The test store's backend, opened alone: reads and writes that bypass the store API."""
    backend = open_backend(store_url)
    yield backend
    backend.close()
