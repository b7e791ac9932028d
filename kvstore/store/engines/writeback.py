"""A large commit's pages on their way to the disk while LMDB is still writing them.

A synced LMDB commit copies every dirty page into the file (``pwrite``: into the
page cache) and only then calls ``fdatasync``, so the disk starts writing once
the last page is copied, and one ``fdatasync`` of a large, freshly written range
is slow on Linux (``tools/bench/disk_probe.py``: on the CI VM 64 MiB appended
and synced took 234 ms, 31 ms with writeback started behind every 8 MiB). While
a commit of at least :data:`MIN_BYTES` runs, a pump thread asks the kernel to
start writing the file's dirty pages back (``sync_file_range(2)`` with
``SYNC_FILE_RANGE_WRITE``: start, do not wait) every :data:`PERIOD_S`, so the
disk writes the first pages while later ones are still being copied in.

Durability is LMDB's, unchanged: it still syncs the data pages before it writes
the meta page that makes them the committed state. Starting a page's writeback
early is what the kernel may do on its own at any moment.

Linux only (the call is Linux's); elsewhere, and with
``KVSTORE_COMMIT_WRITEBACK=0``, :func:`writeback_for` returns ``None`` and
commits run as LMDB makes them.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvstore.knobs import switch_from_env

__all__ = ["MIN_BYTES", "PERIOD_S", "Writeback", "start", "writeback_for"]

#: Commits smaller than this are left alone (their fsync is short either way).
MIN_BYTES = 4 << 20
#: How often the pump starts the writeback of what the commit has copied since.
PERIOD_S = 0.002
_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_CALL = _sync_file_range()


def enabled() -> bool:
    """Whether commits start their writeback early here (Linux, not turned off)."""
    return _CALL is not None and switch_from_env("KVSTORE_COMMIT_WRITEBACK")


def start(fd: int, offset: int, length: int) -> None:
    """Start the writeback of ``length`` bytes of ``fd`` at ``offset`` (do not wait): a
    value just written whole (:mod:`~kvstore.store.engines.lmdb_values`). Nothing off
    Linux or with ``KVSTORE_COMMIT_WRITEBACK=0``; a failure leaves it to the sync."""
    if enabled():
        assert _CALL is not None
        _CALL(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


class Writeback:
    """The pump of one data file: :meth:`during` a large commit, it starts the file's
    writeback every :data:`PERIOD_S` from a thread of its own (started on first use)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._active = 0
        self._asked = False  # a commit began since the pump last looked
        self._wake = threading.Condition(self._lock)
        self._fd: int | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        #: Writebacks started so far (tests and tools read it).
        self.started = 0

    @contextmanager
    def during(self) -> Iterator[None]:
        """Pump while the block runs (nestable; a file that cannot be opened is left alone)."""
        with self._lock:
            started = self._start()
            if started:
                self._active += 1
                self._asked = True
                self._wake.notify()
        try:
            yield
        finally:
            if started:
                with self._lock:
                    self._active -= 1

    def _start(self) -> bool:
        if self._closed:
            return False
        if self._fd is None:
            try:
                self._fd = os.open(self._path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                return False
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._pump, name="kvstore-lmdb-writeback", daemon=True
            )
            self._thread.start()
        return True

    def _pump(self) -> None:
        assert _CALL is not None
        while True:
            with self._lock:
                while not (self._active or self._asked or self._closed):
                    self._wake.wait()
                if self._closed:
                    return
                self._asked = False
                fd = self._fd
            # Once at least per wake, however short the commit. The whole file (length
            # 0: to its end); a failure only leaves the writing to the commit's own
            # fdatasync, as without the pump.
            _CALL(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
            self.started += 1
            time.sleep(PERIOD_S)

    def close(self) -> None:
        """Stop the pump and close its descriptor (the environment is closing)."""
        with self._lock:
            self._closed = True
            self._wake.notify()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def writeback_for(data_file: Path) -> Writeback | None:
    """A pump for ``data_file``, or ``None`` where commits are left as LMDB makes them."""
    return Writeback(data_file) if enabled() else None
