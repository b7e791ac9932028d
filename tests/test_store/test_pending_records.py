"""Records still being written (``PendingRecord``), on every backend: the commit puts
each as soon as it is written, stores the same bytes as a finished record, and a
record whose write fails fails the save with nothing stored."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np
import pytest

from kvstore.abc.store import PendingRecord
from kvstore.errors import StoreConfigError
from kvstore.testing.store import check_match, encoder_for

from .conftest import NS


def pending(records, *, bound_extra=0):
    """Each record as a PendingRecord already resolved (bound: its length + extra)."""
    out = []
    for record in records:
        future: Future = Future()
        future.set_result(memoryview(bytes(record)))
        out.append(PendingRecord(future, len(record) + bound_extra))
    return out


def one_replaced(plain, index, *, result=None, error=None, bound=None):
    """``plain``'s records, pending, with record ``index`` replaced by one whose write
    gives ``result`` or raises ``error`` (its bound: ``bound``, else the one it replaces)."""

    def encode(spans):
        records = pending(plain(spans))
        future: Future = Future()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
        records[index] = PendingRecord(future, bound or records[index].nbytes_bound)
        return records

    return encode


def test_pending_records_are_stored_as_the_finished_ones(store):
    tokens = list(range(30, 50))
    plain = encoder_for(tokens)
    got = store.put_blocks(NS, tokens, plain)
    stored = store.stats().namespaces[NS]
    store.delete(NS)
    # A bound above the length (a checksum that packed shorter) counts as the length.
    again = store.put_blocks(NS, tokens, lambda spans: pending(plain(spans), bound_extra=8))
    assert again.written == got.written and again.written_bytes == got.written_bytes
    assert store.stats().namespaces[NS] == stored
    check_match(store, store.lookup(NS, tokens), tokens)


def test_the_commit_puts_each_record_before_waiting_for_the_next(store):
    """Record 1 is written only once the commit has asked for record 0: a commit that
    waited for every record before its first put would never get it."""
    tokens = list(range(100, 112))  # three blocks of 4
    plain = encoder_for(tokens)
    asked: list[int] = []
    first_asked = threading.Event()

    class Watched(PendingRecord):
        __slots__ = ("index",)

        def result(self):
            asked.append(self.index)
            if self.index == 0:
                first_asked.set()
            return super().result()

    def encode(spans):
        records = plain(spans)
        futures = [Future() for _ in records]
        futures[0].set_result(records[0])

        def write_the_rest():
            if first_asked.wait(10):
                for future, record in zip(futures[1:], records[1:], strict=True):
                    future.set_result(record)
            else:
                for future in futures[1:]:
                    future.set_exception(AssertionError("record 0 was never asked for"))

        threading.Thread(target=write_the_rest, daemon=True).start()
        out = []
        for i, (future, record) in enumerate(zip(futures, records, strict=True)):
            one = Watched(future, len(record))
            one.index = i
            out.append(one)
        return out

    result = store.put_blocks(NS, tokens, encode)
    assert len(result.written) == 3 and asked[:3] == [0, 1, 2]
    check_match(store, store.lookup(NS, tokens), tokens)


def test_a_record_whose_write_failed_fails_the_save_and_stores_nothing(store):
    tokens = list(range(7, 19))
    plain = encoder_for(tokens)
    encode = one_replaced(plain, -1, error=OSError("the pool's copy failed"))
    with pytest.raises(OSError, match="the pool's copy failed"):
        store.put_blocks(NS, tokens, encode)
    assert store.lookup(NS, tokens).tokens == 0
    assert NS not in store.stats().namespaces or store.stats().namespaces[NS].blocks == 0
    store.put_blocks(NS, tokens, plain)  # the store takes the save once the write works
    check_match(store, store.lookup(NS, tokens), tokens)


def test_a_pending_record_that_is_not_a_contiguous_buffer_is_refused_at_the_put(store):
    tokens = list(range(5, 13))
    encode = one_replaced(encoder_for(tokens), 0, result=np.zeros(64, np.uint8)[::2], bound=32)
    with pytest.raises(StoreConfigError, match="C-contiguous"):
        store.put_blocks(NS, tokens, encode)
    assert store.lookup(NS, tokens).tokens == 0
