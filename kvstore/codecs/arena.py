"""Records written into a reused buffer: no fresh pages per save, every core copying.

A save's records are laid out first (:func:`~kvstore.codecs.record.plan_record`),
then written back to back into this thread's arena, a buffer kept from one save
to the next: its pages are already touched, where a fresh ``bytes`` per record
faults every page in (a third of a save's time on a 2-core x86 VM). Records
are written on several threads at once (copies and xxh3 release the GIL).

On a CUDA GPU the arena is pinned host memory: each record's payload is built
on the device (:func:`~kvstore.codecs.record.device_payload`) and crosses the
bus once, by a kernel writing straight into the arena
(:func:`kvstore.codecs.cuda.download`); the host then only hashes it.

The records handed out are memoryviews into the arena. An arena is reused only
once nothing refers to it any more (a caller that keeps records -- a tiered
store writing back later -- simply makes the next save take a new buffer).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import mlx.core as mx
import numpy as np

from kvstore.codecs import cuda
from kvstore.codecs.record import ALIGN, RecordPlan, device_payload, write_record

__all__ = ["write_records"]

_LOCAL = threading.local()
_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None
#: Below this many bytes in all, records are written on the caller's thread.
PARALLEL_MIN_BYTES = 8 << 20


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _LOCK:
        if _POOL is None:
            workers = max(1, min(8, os.cpu_count() or 1))
            _POOL = ThreadPoolExecutor(workers, thread_name_prefix="kvstore-records")
        return _POOL


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


#: Buffers an arena keeps: a save in waves (:mod:`kvstore.store.blocks.waves`) writes
#: the next wave's records while the last wave's are being committed.
KEPT = 2


class _Buffer:
    """One kept buffer: host memory, or pinned memory on a CUDA GPU."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.pinned: Any = cuda.new_buffer(nbytes) if pinned else None
        self.array: np.ndarray = self.pinned.array if pinned else np.empty(nbytes, np.uint8)

    def free(self) -> bool:
        """Whether no record refers to the buffer: it is held by ``array`` here,
        getrefcount's argument and (pinned) the pinned buffer's ``array`` only.
        (Counting one fewer made every save take a new buffer: on an H200 a pinned one
        of 512 MiB, faulted in and page-locked, cost each 4096-token llama-8B save
        310 ms.)"""
        return sys.getrefcount(self.array) <= 2 + (self.pinned is not None)


class _Arena:
    """One thread's buffers, at most :data:`KEPT`, reused once their records are gone."""

    def __init__(self) -> None:
        self.kept: list[_Buffer] = []

    def take(self, nbytes: int, pinned: bool) -> _Buffer:
        """A buffer of at least ``nbytes`` that nothing else refers to."""
        free = [b for b in self.kept if b.free() and (b.pinned is not None) == pinned]
        for kept in free:
            if kept.array.nbytes >= nbytes:
                return kept
        # None fits: a free one grows, else a new one joins (the oldest in use is let go
        # of when the arena is full; its records keep it alive while they live).
        if free:
            self.kept.remove(free[0])
            nbytes = max(nbytes, int(1.25 * free[0].array.nbytes))
        elif len(self.kept) >= KEPT:
            self.kept.pop(0)
        del free
        fresh = _Buffer(nbytes, pinned)
        self.kept.append(fresh)
        return fresh


def _arena() -> _Arena:
    arena: _Arena | None = getattr(_LOCAL, "arena", None)
    if arena is None:
        arena = _LOCAL.arena = _Arena()
    return arena


def write_records(plans: Sequence[RecordPlan]) -> list[memoryview]:
    """The records of ``plans``, each a memoryview into this thread's arena."""
    if not plans:
        return []
    starts, end = [], 0
    for plan in plans:
        starts.append(end)
        end += _align(plan.nbytes_bound)
    on_gpu = cuda.available()
    # MLX evaluates a graph only on the thread whose stream built it: here, not in the pool.
    mx.eval([a for plan in plans for a, _ in plan.tensors if isinstance(a, mx.array)])
    taken = _arena().take(end, on_gpu)
    buffer = taken.array
    if on_gpu:
        heads = [len(plan.head((1 << 64) - 1)) for plan in plans]
        payloads = [device_payload(plan) for plan in plans]
        cuda.download(
            payloads,
            taken.pinned,
            [start + head for start, head in zip(starts, heads, strict=True)],
        )
        del payloads

    def one(i: int) -> int:
        return write_record(plans[i], buffer[starts[i] :], payload_written=on_gpu)

    if end < PARALLEL_MIN_BYTES or len(plans) < 2:
        lengths = [one(i) for i in range(len(plans))]
    else:
        lengths = list(_pool().map(one, range(len(plans))))
    view = memoryview(cast(Any, buffer))
    return [view[start : start + n] for start, n in zip(starts, lengths, strict=True)]
