"""Saves written behind the generating thread: one background thread and a bounded queue.

``kvstore serve`` hands each save to :class:`SaveQueue` (the
:class:`~kvstore.mlx_lm.Writer` of its :class:`~kvstore.mlx_lm.StorePromptCache`),
so the generation thread only settles the arrays' graph and enqueues. The
queue is bounded: when the store cannot keep up, a save is dropped (counted and
logged) rather than holding the generation thread or memory. When the store
grows a write-behind path of its own (issue 13), the server takes that writer
instead; this one is no general-purpose writer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

__all__ = ["SaveQueue"]

log = logging.getLogger("kvstore.serve")

_STOP = object()


class SaveQueue:
    """A single writer thread running submitted saves in order.

    Args:
        maxsize: saves waiting at most; a submit beyond it is dropped.

    Attributes:
        written, failed, dropped: saves run, saves that raised, saves dropped.
    """

    def __init__(self, maxsize: int = 32) -> None:
        self._queue: queue.Queue[object] = queue.Queue(maxsize=maxsize)
        self.maxsize = maxsize
        self.written = self.failed = self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="kvstore-writer", daemon=True)
        self._thread.start()
        self._closed = False

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the writer thread; never blocks (a full queue drops it)."""
        if self._closed:
            self.dropped += 1
            return
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.dropped += 1
            log.warning(
                "kvstore: the save queue is full (%d waiting); a save was dropped", self.maxsize
            )

    @property
    def pending(self) -> int:
        """Saves submitted and not finished yet."""
        return self._queue.unfinished_tasks

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted save has run; ``False`` if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def close(self, timeout: float | None = 30.0) -> bool:
        """Run what is queued, then stop the thread; ``False`` if it did not finish."""
        if self._closed:
            return True
        self._closed = True
        done = self.flush(timeout)
        self._queue.put(_STOP)
        self._thread.join(timeout)
        return done and not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is _STOP:
                    return
                assert callable(job)
                job()
                self.written += 1
            except Exception:  # the prompt cache logs store faults; this is anything else
                self.failed += 1
                log.exception("kvstore: a save raised")
            finally:
                self._queue.task_done()
