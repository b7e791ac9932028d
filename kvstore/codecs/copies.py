"""Host copies spread over the cores: a restore's rows, from the store's pages into
the arrays of its caches.

A restore's fill runs inside MLX's loader (:mod:`.fill`), which hands out one array
at a time, so one thread copies every row: on the 2-core x86 CI machine 256 MiB of
llama-8B rows took 38.5 ms that way and 22.7 ms on two threads (``np.copyto``
releases the GIL). Each array's copies are split here by heads across a pool, and
all of them finish before the call returns (the arrays' memory is only guaranteed
while MLX's read of it lasts).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Literal

import numpy as np

from kvstore.threads import KeptPool, threads_from_env

__all__ = ["PARALLEL_MIN_BYTES", "PIECE_MIN_BYTES", "copy_all", "spread", "threads"]

#: Below this many bytes in all, or this many a piece on average, copies stay on the
#: calling thread: a hand-off and each copy's Python cost more than they save. 2-core
#: CPU, alternating runs: 2048 tokens of llama-8B (4 MiB arrays of 512 KiB pieces)
#: restored in 66.9 -> 61.0 ms spread, while 8192 of qwen-0.5B (2 MiB arrays of 64 KiB
#: pieces) went 39 -> 49 ms when it was spread too.
PARALLEL_MIN_BYTES = 4 << 20
PIECE_MIN_BYTES = 256 << 10

Casting = Literal["no", "equiv", "safe", "same_kind", "unsafe"]

#: Whether this thread's copies may be spread (:func:`spread`).
_HERE = threading.local()


@contextmanager
def spread() -> Iterator[None]:
    """Let :func:`copy_all` on this thread use the pool, inside the ``with``: where
    arrays are filled one at a time (MLX's loader). Elsewhere the callers are many
    threads already (CUDA staging), and copies stay on each."""
    before = getattr(_HERE, "on", False)
    _HERE.on = True
    try:
        yield
    finally:
        _HERE.on = before


def threads() -> int:
    """Threads a copy is split over, the caller's own included: the cores, at most 8
    (``KVSTORE_COPY_THREADS``)."""
    return threads_from_env("KVSTORE_COPY_THREADS", max(1, min(8, os.cpu_count() or 1)))


#: The threads besides a copy's caller.
_POOL = KeptPool("kvstore-copy", lambda: max(1, threads() - 1))


def copy_all(pairs: Sequence[tuple[np.ndarray, np.ndarray]], *, casting: Casting = "safe") -> None:
    """``np.copyto(dst, src, casting=casting)`` for every ``(dst, src)`` of ``pairs``;
    inside :func:`spread`, with :data:`PARALLEL_MIN_BYTES` or more (and pieces of
    :data:`PIECE_MIN_BYTES` on average), on :func:`threads` threads: each pair of one
    shape split by its second axis (a cache's heads), others handed out whole.
    Returns once every copy is done; raises the first copy's error."""
    total = sum(dst.nbytes for dst, _ in pairs)
    if (
        not getattr(_HERE, "on", False)
        or total < PARALLEL_MIN_BYTES
        or total < PIECE_MIN_BYTES * len(pairs)
    ):
        _copy(pairs, casting)
        return
    count = threads()
    if count < 2:
        _copy(pairs, casting)
        return
    shares: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(count)]
    for k, (dst, src) in enumerate(pairs):
        heads = dst.shape[1] if dst.ndim > 1 and dst.shape == src.shape else 0
        if heads >= count:
            for t, share in enumerate(shares):
                start, stop = t * heads // count, (t + 1) * heads // count
                share.append((dst[:, start:stop], src[:, start:stop]))
        else:
            shares[k % count].append((dst, src))
    pool = _POOL.get()
    futures: list[Future[None]] = [pool.submit(_copy, share, casting) for share in shares[1:]]
    try:
        _copy(shares[0], casting)
    finally:  # every copy finished before the caller's memory may go
        errors = [future.exception() for future in futures]
    for error in errors:
        if error is not None:
            raise error


def _copy(pairs: Sequence[tuple[np.ndarray, np.ndarray]], casting: Casting) -> None:
    for dst, src in pairs:
        np.copyto(dst, src, casting=casting)
