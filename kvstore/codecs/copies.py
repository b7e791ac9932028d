"""Host writes on every core: a restore's rows, from the store's pages into the
arrays of its caches.

A restore allocates every array first (:mod:`.fill`) and then writes them all at
once, whole arrays handed out to :func:`threads` threads (numpy's copies release the
GIL). Writing them inside MLX's loader instead, one array per read, left a thread
switch and a GIL hand-off between arrays: on the 2-core x86 CI machine 64 arrays of
llama-8B rows (512 tokens) took 25.9 ms that way and 17.8 on two threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from kvstore.knobs import count_from_env
from kvstore.threads import KeptPool, cores

__all__ = ["each_on_threads", "start_threads", "threads"]


def threads() -> int:
    """Threads the arrays are written on, the caller's own included: the cores, at most 8
    (``KVSTORE_COPY_THREADS``)."""
    return count_from_env("KVSTORE_COPY_THREADS", min(8, cores()))


#: The threads besides the caller's.
_POOL = KeptPool("kvstore-copy", lambda: max(1, threads() - 1))


def start_threads() -> None:
    """Start the pool's threads now (before a process's first restore needs them)."""
    _POOL.get()


def each_on_threads(count: int, work: Callable[[int], None]) -> None:
    """``work(k)`` for every ``k`` in ``range(count)``, on up to :func:`threads` threads
    (the caller's included), each taking the next ``k`` as it finishes one.

    Returns once every call has returned, the pool's included: the caller may then
    let go of what ``work`` wrote through. Raises the first error; after one, no
    thread starts another ``k``.
    """
    helpers = min(threads(), count) - 1
    if helpers < 1:
        for k in range(count):
            work(k)
        return
    lock = threading.Lock()
    pending = iter(range(count))
    failed = threading.Event()

    def run() -> None:
        while not failed.is_set():
            with lock:
                k = next(pending, None)
            if k is None:
                return
            try:
                work(k)
            except BaseException:
                failed.set()
                raise

    pool = _POOL.get()
    futures: list[Future[None]] = [pool.submit(run) for _ in range(helpers)]
    try:
        run()
    finally:  # every call finished before the caller's memory may go
        errors = [future.exception() for future in futures]
    for error in errors:
        if error is not None:
            raise error
