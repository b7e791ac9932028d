"""Host copies on every core (kvstore.codecs.copies): every call made once, on several
threads, all of them finished before the call returns, and the first error raised."""

from __future__ import annotations

import threading
import time

import pytest

from kvstore.codecs import copies


@pytest.fixture
def two_threads(monkeypatch):
    monkeypatch.setenv("KVSTORE_COPY_THREADS", "2")


def test_every_call_is_made_once_on_the_caller_and_the_pool(two_threads):
    done: list[int] = []
    threads: set[int] = set()
    lock = threading.Lock()

    def work(k):
        time.sleep(0.005)  # each call long enough for the other thread to take the next
        with lock:
            done.append(k)
            threads.add(threading.get_ident())

    copies.each_on_threads(12, work)
    assert sorted(done) == list(range(12))
    assert len(threads) == 2 and threading.get_ident() in threads


def test_one_call_or_one_thread_stays_on_the_caller(monkeypatch):
    monkeypatch.setenv("KVSTORE_COPY_THREADS", "1")
    seen: list[int] = []
    copies.each_on_threads(3, lambda k: seen.append(threading.get_ident()))
    monkeypatch.setenv("KVSTORE_COPY_THREADS", "2")
    copies.each_on_threads(1, lambda k: seen.append(threading.get_ident()))
    assert seen == [threading.get_ident()] * 4


def test_an_error_is_raised_after_every_other_call_is_done_and_stops_new_ones(two_threads):
    caller = threading.get_ident()
    finished: list[int] = []
    started: list[int] = []

    pool_busy = threading.Event()

    def work(k):
        started.append(k)
        if threading.get_ident() == caller:
            assert pool_busy.wait(5)
            raise TypeError("the caller's call failed")
        pool_busy.set()
        time.sleep(0.2)  # the pool's call is still running when the caller's fails
        finished.append(k)

    with pytest.raises(TypeError, match="caller's call failed"):
        copies.each_on_threads(50, work)
    assert len(finished) == 1  # returned only after the pool's call finished
    assert len(started) == 2  # and no thread took another after the error


@pytest.mark.parametrize("setting", ["0", "two"])
def test_a_copy_thread_count_that_is_not_positive_is_refused_by_name(monkeypatch, setting):
    monkeypatch.setenv("KVSTORE_COPY_THREADS", setting)
    with pytest.raises(ValueError, match=f"KVSTORE_COPY_THREADS='{setting}'"):
        copies.threads()
