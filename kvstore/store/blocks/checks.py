"""Checking many records at once: each record's checks, on every core.

A record's ``verify`` is two kinds of work: parsing its header (Python,
holding the GIL) and hashing its payload (xxhash, which releases the GIL).
On several threads, records' payloads are hashed at once while another's
header is parsed, so a restore of many large records waits for roughly the
larger of the two totals (spread over the cores) instead of their sum: the
16 records of a 4096-token llama-8B prefix hash at 41 GB/s on 8 threads of a
16-core host, against 7 GB/s on one. The helper threads are kept for the
process. Small reads stay on the caller's thread (a hand-off costs more than
it saves).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from kvstore.codecs import copies, cuda, cuda_pages
from kvstore.devices import default_is_cuda
from kvstore.errors import CorruptEntryError, FormatVersionError
from kvstore.knobs import count_from_env
from kvstore.threads import KeptPool, cores

__all__ = [
    "PARALLEL_MIN_BYTES",
    "Verdict",
    "check_records",
    "served_run",
    "in_background",
    "start_read_threads",
]

#: Below this many bytes in all, the records are checked on the caller's thread.
PARALLEL_MIN_BYTES = 8 << 20

#: What checking one record found: ``None`` (intact) or the error ``verify`` raised.
Verdict = CorruptEntryError | FormatVersionError | None


def check_records(
    verify: Callable[[memoryview], None], records: Sequence[memoryview]
) -> list[Verdict]:
    """The verdicts of ``verify`` on the leading ``records``, in order, up to the
    first one that fails (included).

    Any exception but ``CorruptEntryError``/``FormatVersionError`` propagates.
    """
    pool = _pool()  # made at a process's first check, a small one's too: not in a big one
    if len(records) < 2 or sum(r.nbytes for r in records) < PARALLEL_MIN_BYTES:
        verdicts: list[Verdict] = []
        for record in records:
            verdicts.append(_check(verify, record))
            if verdicts[-1] is not None:
                break
        return verdicts
    found: list[Verdict] = [None] * len(records)
    raised: list[BaseException] = []
    turns = itertools.count()  # next() on a count is atomic under the GIL

    def work() -> None:
        for turn in turns:
            if turn >= len(records) or raised:
                return
            # Last record first: a restore meanwhile parses the same headers from the
            # first on (record_header.py's _parsed_once), and the checks' parses, each after its
            # record's hash, reach the headers it has parsed only at the end.
            i = len(records) - 1 - turn
            try:
                found[i] = _check(verify, records[i])
            except BaseException as exc:  # re-raised on the caller's thread
                raised.append(exc)
                return

    helpers = [pool.submit(work) for _ in range(min(_workers(), len(records)) - 1)]
    try:
        work()
    finally:
        for helper in helpers:
            helper.result()
    if raised:
        raise raised[0]
    first_bad = next((i for i, verdict in enumerate(found) if verdict is not None), None)
    return found if first_bad is None else found[: first_bad + 1]


def _workers() -> int:
    """Threads checking at once, the caller's included: the cores left to them, at most
    16 (``KVSTORE_VERIFY_THREADS`` sets them). A fresh process's first read faults the
    store's pages in as it hashes them, and faults scale with threads (an H200 host's
    16 cores copied fresh pages at 18 GB/s on 8 threads, 25 on 16:
    ``tools/bench/gpu/probe.py``). On a CUDA GPU the staging threads lock the same
    pages meanwhile, and the cores are theirs first. When 12 threads locked them, a
    4096-token restore took 45.5 ms checked on 16 threads and 37.1 on the 4 left
    (median of 5 fresh processes, ``tools/bench/results/gpu/71cbce0/ab-env.txt``); now
    4 lock them (:func:`~kvstore.codecs.cuda_pages.register_threads`), and on the 12
    left it took 33.9 ms against 37.3 on 6 (``0a997c3/ab-threads2.txt``)."""
    usable = cores()
    # A restore on a GPU sets CUDA up before its first check.
    locking = cuda_pages.register_threads() if cuda.in_use() else 0
    return count_from_env("KVSTORE_VERIFY_THREADS", max(2, min(16, usable - locking)))


#: The threads besides a check's caller.
_POOL = KeptPool("kvstore-verify", lambda: max(1, _workers() - 1))


def _pool() -> ThreadPoolExecutor:
    return _POOL.get()


def _check(verify: Callable[[memoryview], None], record: memoryview) -> Verdict:
    try:
        verify(record)
    except (CorruptEntryError, FormatVersionError) as exc:
        return exc
    return None


def served_run(
    verify: Callable[[memoryview], None], values: Sequence[Any | None]
) -> tuple[list[memoryview], Verdict, int | None]:
    """What a read serves of ``values`` (the records of a run of blocks, ``None``
    where one is not stored): the views of the leading intact records, the verdict
    that ended the run (``None``: none failed), and the index of the first absent
    record when every record before it is served (else ``None``).

    Records before a missing one are checked first, as if read one by one.
    """
    stored: list[memoryview] = []
    for value in values:
        if value is None:
            break
        stored.append(memoryview(value))
    views: list[memoryview] = []
    for mv, verdict in zip(stored, check_records(verify, stored)):
        if verdict is not None:
            return views, verdict, None
        views.append(mv)
    return views, None, (len(stored) if len(stored) < len(values) else None)


T = TypeVar("T")
_BACKGROUND = KeptPool("kvstore-read-check", lambda: 4)


def in_background(fn: Callable[[], T]) -> Future[T]:
    """``fn`` (a read's checks) on a thread of its own, so the reader's copy of the
    views overlaps them; it fans out to the checking threads as usual."""
    return _BACKGROUND.get().submit(fn)


def start_read_threads() -> None:
    """Start the threads a host restore checks and copies on, now rather than inside the
    process's first restore (a store's open calls it: a server opens its store once, at
    its start). A fresh process's first 512-token qwen-0.5B restore took 7.1-8.4 ms
    starting them and 5.9-6.4 with them started (the 2-core CI VM, fresh processes
    alternated). Where the default device is a CUDA GPU nothing is started: there the
    checking threads are as many as the cores CUDA's page locking leaves them, known
    once a restore has set CUDA up (:func:`_workers`)."""
    if default_is_cuda():
        return
    _POOL.get()
    _BACKGROUND.get()
    copies.start_threads()
