"""Thread pools whose threads are all running before their first real task.

A :class:`~concurrent.futures.ThreadPoolExecutor` starts a thread on a
``submit`` that finds none idle. Started inside a restore, each new thread
waits for the GIL its first steps need while the restore's own thread holds it:
on an H200 host a pool of 16 threads made inside the first timed restore held
its header parse up by about 15 ms (``tools/bench/results/gpu/9a9d5cb/``). A
pool made here has every thread waiting for work when it returns, so the cost
is paid once, where the pool is made (a process's first read, its warm-up).

:func:`keep_thread_state` is for the other threads that run Python here: a C++
library's own workers calling back into it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["KeptPool", "cores", "keep_thread_state", "started_pool"]


@functools.cache
def cores() -> int:
    """The cores this process may run on, which the pools here are sized by: its CPU
    affinity where the OS has one (a container or ``taskset`` limited to 2 of a host's
    64 cores gets 2), otherwise the machine's count. Asked once: ``os.cpu_count`` reads
    ``/sys`` each time (~6 us on the CI VM), and a restore sizes its pools anew.
    """
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def started_pool(workers: int, prefix: str) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads (named ``prefix``), every one started."""
    pool = ThreadPoolExecutor(workers, thread_name_prefix=prefix)
    # Each task waits for all the others, so no thread is idle at a later submit and
    # the pool starts a new one for each.
    barrier = threading.Barrier(workers)
    for future in [pool.submit(barrier.wait) for _ in range(workers)]:
        future.result()
    return pool


class KeptPool:
    """A :func:`started_pool` made at its first use (``workers()`` threads then) and
    kept for the process.

    A child forked from the process has none of its threads: there the pool is
    forgotten, and the child's first use makes its own (a pool whose threads are gone
    would take tasks and never run them)."""

    def __init__(self, prefix: str, workers: Callable[[], int]) -> None:
        self._prefix = prefix
        self._workers = workers
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget_in_child)

    def _forget_in_child(self) -> None:
        # The parent's lock may have been held by a thread that is not in the child.
        self._lock = threading.Lock()
        self._pool = None

    def get(self) -> ThreadPoolExecutor:
        """The pool, made now if it is not yet."""
        with self._lock:
            if self._pool is None:
                self._pool = started_pool(self._workers(), self._prefix)
            return self._pool

    def forget(self) -> None:
        """Shut the pool down (after its tasks) and make the next :meth:`get` a new one."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()


# CPython's: takes the GIL for a thread, making it a thread state if it has none.
_GIL_ENSURE = ctypes.pythonapi.PyGILState_Ensure if sys.implementation.name == "cpython" else None
_KEPT = threading.local()  # per thread state: set once the state is kept


def keep_thread_state() -> bool:
    """Keep the calling thread's Python thread state until the process ends; whether it
    was kept just now. Called with the GIL held; meant for threads Python did not start
    (on one it did, harmless: Python deletes that thread's state when the thread ends).

    A thread that is not Python's calls into Python through ``PyGILState_Ensure``,
    which makes it a thread state, and ``PyGILState_Release``, which destroys it: every
    call-back, however short, allocates the state, maps and unmaps its frame stack
    (a TLB shootdown on every core), and drops its ``threading.local`` values. MLX's
    loader calls a Python file object so, on its four I/O threads, once for each array
    it reads: a :class:`~kvstore.codecs.fill.LeafStream` allocation took 113-144 us
    an array, and 68-84 with each thread's state kept (64 arrays of 4.5 MiB, 2-core CI
    VM, ``mmap``/``munmap`` once an array under ``strace``). One ``PyGILState_Ensure``
    more than it releases keeps the state: a few hundred bytes a thread, for the
    threads of a fixed pool. Elsewhere than CPython, nothing is done."""
    if _GIL_ENSURE is None or getattr(_KEPT, "kept", False):
        return False
    _GIL_ENSURE()  # never released: the thread keeps its state from now on
    _KEPT.kept = True
    return True
