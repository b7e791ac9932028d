"""Host copies spread over the cores (kvstore.codecs.copies): the same bytes as one
thread's copies, spread only where arrays are filled one at a time, every copy done
before the call returns, and a copy's error raised."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvstore.codecs import copies


@pytest.fixture
def two_threads(monkeypatch):
    monkeypatch.setenv("KVSTORE_COPY_THREADS", "2")
    monkeypatch.setattr(copies, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(copies, "PIECE_MIN_BYTES", 0)
    threads: list[set[int]] = []
    real = copies._copy

    def copy(pairs, casting):
        threads.append({threading.get_ident()})
        return real(pairs, casting)

    monkeypatch.setattr(copies, "_copy", copy)
    return threads


def pairs_of(rng):
    """A join's copies: pieces of [B, H, rows, D] into a target's row ranges, and one of
    another shape (a broadcast)."""
    target = np.zeros((2, 6, 40, 8), np.float32)
    pieces = [rng.standard_normal((2, 6, rows, 8)).astype(np.float32) for rows in (5, 11, 7)]
    pairs, at = [], 0
    for piece in pieces:
        pairs.append((target[:, :, at : at + piece.shape[2]], piece))
        at += piece.shape[2]
    pairs.append((target[:, :, at:], np.float16(3.5)))  # not one shape: handed out whole
    return target, pairs


def test_spread_copies_write_what_one_thread_writes_on_two_threads(two_threads):
    rng = np.random.default_rng(0)
    want, pairs = pairs_of(rng)
    copies._copy(pairs, "safe")
    two_threads.clear()
    got, pairs = pairs_of(np.random.default_rng(0))
    with copies.spread():
        copies.copy_all(pairs)
    assert np.array_equal(got, want)
    assert len(set.union(*two_threads)) == 2  # the caller's share and the pool's


def test_copies_outside_spread_stay_on_the_calling_thread(two_threads):
    got, pairs = pairs_of(np.random.default_rng(1))
    copies.copy_all(pairs)
    assert two_threads == [{threading.get_ident()}]
    assert got[:, :, 23:].min() == 3.5


@pytest.mark.parametrize(
    "floor",
    [
        "PARALLEL_MIN_BYTES",  # too few bytes in all
        "PIECE_MIN_BYTES",  # pieces too small: a hand-off and each piece's Python cost more
    ],
)
def test_small_copies_stay_on_the_calling_thread(two_threads, monkeypatch, floor):
    monkeypatch.setattr(copies, floor, 1 << 30)
    _, pairs = pairs_of(np.random.default_rng(2))
    with copies.spread():
        copies.copy_all(pairs)
    assert two_threads == [{threading.get_ident()}]


def test_an_error_is_raised_after_every_other_copy_is_done(two_threads, monkeypatch):
    done = threading.Event()
    real = copies._copy

    def slow_or_failing(pairs, casting):
        if threading.get_ident() == caller:
            raise TypeError("the caller's share failed")
        time.sleep(0.2)  # the pool's share is still copying when the caller fails
        real(pairs, casting)
        done.set()

    caller = threading.get_ident()
    monkeypatch.setattr(copies, "_copy", slow_or_failing)
    _, pairs = pairs_of(np.random.default_rng(3))
    with copies.spread(), pytest.raises(TypeError, match="caller's share"):
        copies.copy_all(pairs)
    assert done.is_set()  # returned only after the pool's copies finished


def test_a_narrowing_copy_is_refused_as_numpy_refuses_it(two_threads):
    target = np.zeros((1, 4, 8, 2), np.float16)
    wide = np.ones((1, 4, 8, 2), np.float32)
    with copies.spread(), pytest.raises(TypeError, match="Cannot cast"):
        copies.copy_all([(target, wide)], casting="safe")


@pytest.mark.parametrize("setting", ["0", "two"])
def test_a_copy_thread_count_that_is_not_positive_is_refused_by_name(monkeypatch, setting):
    monkeypatch.setenv("KVSTORE_COPY_THREADS", setting)
    with pytest.raises(ValueError, match=f"KVSTORE_COPY_THREADS='{setting}'"):
        copies.threads()
