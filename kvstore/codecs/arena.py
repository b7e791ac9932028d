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

import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import mlx.core as mx
import numpy as np

from kvstore.abc.placement import Placement
from kvstore.abc.store import PendingRecord
from kvstore.codecs import cuda, record
from kvstore.codecs.record import ALIGN, RecordPlan, device_payload, write_record
from kvstore.threads import cores

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
            workers = min(8, cores())
            _POOL = ThreadPoolExecutor(workers, thread_name_prefix="kvstore-records")
        return _POOL


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Arena:
    """One thread's buffer (host memory, or pinned memory on a CUDA GPU)."""

    def __init__(self) -> None:
        self.pinned: Any = None
        self.array: np.ndarray | None = None

    def take(self, nbytes: int, pinned: bool) -> np.ndarray:
        """A buffer of at least ``nbytes`` that nothing else refers to."""
        array = self.array
        # Held by this arena, ``array`` here and getrefcount's argument only (and the
        # pinned buffer's ``array``): no record of it is alive. (Counting one fewer
        # made every save take a new buffer: on an H200 a pinned one of 512 MiB,
        # faulted in and page-locked, cost each 4096-token llama-8B save 310 ms.)
        free = array is not None and sys.getrefcount(array) <= 3 + (self.pinned is not None)
        if (
            not free
            or array is None
            or array.nbytes < nbytes
            or (self.pinned is not None) != pinned
        ):
            size = max(nbytes, int(1.25 * array.nbytes) if free and array is not None else 0)
            self.array = None
            if pinned:
                self.pinned = cuda.new_buffer(size)
                self.array = self.pinned.array
            else:
                self.pinned = None
                self.array = np.empty(size, np.uint8)
        assert self.array is not None
        return self.array


def _arena() -> _Arena:
    arena: _Arena | None = getattr(_LOCAL, "arena", None)
    if arena is None:
        arena = _LOCAL.arena = _Arena()
    return arena


def write_records(
    plans: Sequence[RecordPlan],
    *,
    pending: bool = False,
    payloads: Sequence[mx.array | None] | None = None,
) -> list[Any]:
    """The records of ``plans``, each a memoryview into this thread's arena.

    With ``pending``, records written on the pool come back at once as
    :class:`~kvstore.abc.store.PendingRecord` s (a small save's, written on this
    thread, as memoryviews): a commit then puts each as soon as it is written, while
    the pool writes the next ones, and a store that can takes each record's parts as
    they are written (its :class:`~kvstore.abc.placement.Placement`). ``payloads``: on
    a CUDA GPU, each plan's payload already built on the device
    (:mod:`~kvstore.codecs.stacked_payloads`), or ``None`` where
    :func:`~kvstore.codecs.record.device_payload` builds it.
    """
    if not plans:
        return []
    starts, end = [], 0
    for plan in plans:
        starts.append(end)
        end += _align(plan.nbytes_bound)
    on_gpu = cuda.available()
    # MLX evaluates a graph only on the thread whose stream built it: here, not in the pool.
    mx.eval([a for plan in plans for a, _ in plan.tensors if isinstance(a, mx.array)])
    buffer = _arena().take(end, on_gpu)
    view = memoryview(cast(Any, buffer))

    parallel = end >= PARALLEL_MIN_BYTES and len(plans) > 1
    # A commit may write each pending record where it goes while it is being written,
    # a part at a time. A record of one part gains nothing by it, and its write then
    # holds up the pool's next record (8192 tokens of qwen-0.5B, records of 3 MiB: 65-78
    # ms saved by the commit's thread, 76-89 placed whole on the pool).
    places = [
        Placement() if pending and parallel and plan.payload_nbytes > record.PART_BYTES else None
        for plan in plans
    ]

    def one(i: int) -> memoryview:
        out = buffer[starts[i] :]
        n = write_record(plans[i], out, payload_written=on_gpu, placement=places[i])
        return view[starts[i] : starts[i] + n]

    futures: list[Future[memoryview]] = []
    if on_gpu:
        heads = [plan.head_nbytes_bound for plan in plans]
        built = payloads or [None] * len(plans)
        on_device = [
            device_payload(plan) if made is None else made
            for plan, made in zip(plans, built, strict=True)
        ]
        del payloads, built  # from here only ``on_device`` (and ``fetch``) hold them
        pinned = _arena().pinned
        offsets = [start + head for start, head in zip(starts, heads, strict=True)]
        fetch = cuda.download_later(on_device, pinned, offsets) if parallel else None
        if fetch is not None:
            # The copy engine's route: each record downloaded by the pool thread that
            # then hashes it (downloads, checksums and the commit's puts overlap).
            def fetched(i: int) -> memoryview:
                fetch(i)
                return one(i)

            futures = [_pool().submit(fetched, i) for i in range(len(plans))]
        else:
            # Each record is checksummed on the pool as soon as its bytes are down, while
            # the next record's cross the bus.
            cuda.download(
                on_device,
                pinned,
                offsets,
                done=(lambda i: futures.append(_pool().submit(one, i))) if parallel else None,
            )
        del on_device
    if not parallel:
        return [one(i) for i in range(len(plans))]
    if not futures:
        futures = [_pool().submit(one, i) for i in range(len(plans))]
    if pending:
        return [
            PendingRecord(f, plan.nbytes_bound, place)
            for f, plan, place in zip(futures, plans, places, strict=True)
        ]
    return [f.result() for f in futures]
