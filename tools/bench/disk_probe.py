"""What a durable write of N MiB costs on this machine's disk, four ways.

P2 and G3 compare a durable save with mlx-lm's unsynced ``save_prompt_cache``
(a write into the page cache, the second row). This probe says what the disk
allows: the same bytes written into the page cache and fsynced (appending to a
file, and overwriting one already allocated, which is what LMDB does with freed
pages, and what a store's value file does value by value),
written into space reserved beforehand with ``posix_fallocate`` (allocated
blocks not yet written: what a store could do ahead of its next save), and
written with ``O_DIRECT`` from page-aligned memory (no page-cache copy) then
fsynced; a memcpy into fresh memory for scale. Nothing in the library is
used::

    python3 tools/bench/disk_probe.py --dir /tmp --mib 64 256

Each row: the median of ``--repeats`` and the spread, and GB/s.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def _timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


_libc = ctypes.CDLL(None, use_errno=True)
SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Linux's sync_file_range(2): start writing a range back, without waiting."""
    sync_file_range = getattr(_libc, "sync_file_range", None)
    if sync_file_range is not None:
        sync_file_range(fd, ctypes.c_int64(offset), ctypes.c_int64(nbytes), SYNC_FILE_RANGE_WRITE)


def _fs_type(directory: str) -> str:
    """The mounted file system holding directory (/proc/mounts' longest prefix)."""
    best, kind, real = "", "unknown", os.path.join(os.path.realpath(directory), "")
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                point = os.path.join(fields[1], "")  # "/tmp/" holds "/tmp/x/", not "/tmpx/"
                if real.startswith(point) and len(point) > len(best):
                    best, kind = point, fields[2]
    except OSError:
        pass
    return kind


def probe(directory: str, nbytes: int, repeats: int) -> None:
    buf = mmap.mmap(-1, nbytes)  # page-aligned, as O_DIRECT wants
    chunk = os.urandom(1 << 20)
    for off in range(0, nbytes, len(chunk)):
        buf[off : off + len(chunk)] = chunk[: nbytes - off]
    view = memoryview(buf)
    fd_dir, path = tempfile.mkstemp(dir=directory, prefix="disk-probe-")
    os.close(fd_dir)

    @contextmanager
    def opened(flags: int) -> Iterator[int]:
        """The probe's file opened for writing with ``flags``, closed however the case ends."""
        fd = os.open(path, os.O_WRONLY | flags)
        try:
            yield fd
        finally:
            os.close(fd)

    def append() -> None:
        with opened(os.O_APPEND) as fd:
            os.write(fd, view)
            os.fdatasync(fd)

    def overwrite() -> None:
        with opened(0) as fd:
            os.pwrite(fd, view, 0)
            os.fdatasync(fd)

    def direct(at_end: bool) -> Callable[[], None]:
        def run() -> None:
            with opened(getattr(os, "O_DIRECT", 0)) as fd:
                offset = os.fstat(fd).st_size if at_end else 0
                offset -= offset % 4096
                os.pwrite(fd, view, offset)
                os.fdatasync(fd)

        return run

    def streamed(chunk: int) -> Callable[[], None]:
        # Writeback started behind each chunk (sync_file_range, SYNC_FILE_RANGE_WRITE),
        # so the disk writes while later chunks are still being copied in.
        def run() -> None:
            with opened(os.O_APPEND) as fd:
                start = os.fstat(fd).st_size
                for off in range(0, nbytes, chunk):
                    os.write(fd, view[off : off + chunk])
                    _start_writeback(fd, start + off, min(chunk, nbytes - off))
                os.fdatasync(fd)

        return run

    def reserved(chunk: int | None) -> tuple[Callable[[], None], Callable[[], None]]:
        # The region past the file's end reserved (fallocate) and synced before the
        # timed write, so only writing the data into blocks already allocated is timed.
        at = [0]

        def reserve() -> None:
            with opened(0) as fd:
                at[0] = os.fstat(fd).st_size
                os.posix_fallocate(fd, at[0], nbytes)
                os.fsync(fd)

        def run() -> None:
            with opened(0) as fd:
                step = chunk or nbytes
                for off in range(0, nbytes, step):
                    os.pwrite(fd, view[off : off + step], at[0] + off)
                    if chunk:
                        _start_writeback(fd, at[0] + off, min(step, nbytes - off))
                os.fdatasync(fd)

        return reserve, run

    def filled() -> None:
        # Untimed: the file holds the bytes already, on disk (the value file's space, reused).
        if os.path.getsize(path) < nbytes:
            with opened(0) as fd:
                os.pwrite(fd, view, 0)
                os.fdatasync(fd)

    def overwrite_streamed(chunk: int) -> Callable[[], None]:
        # What a store's value file does: each value written in place, its writeback
        # started at once, one fdatasync before the commit.
        def run() -> None:
            with opened(0) as fd:
                for off in range(0, nbytes, chunk):
                    os.pwrite(fd, view[off : off + chunk], off)
                    _start_writeback(fd, off, min(chunk, nbytes - off))
                os.fdatasync(fd)

        return run

    def emptied() -> None:
        os.truncate(path, 0)

    def unsynced() -> None:
        # What mlx-lm's save_prompt_cache does: a new file's bytes into the page cache.
        with opened(os.O_APPEND) as fd:
            os.write(fd, view)

    def memcpy() -> None:
        fresh = bytearray(nbytes)
        fresh[:] = view

    reserve, into_reserved = reserved(None)
    reserve_streamed, into_reserved_streamed = reserved(32 << 20)
    cases: list[tuple[str, Callable[[], None], Callable[[], None] | None]] = [
        ("memcpy into fresh memory", memcpy, None),
        ("page cache, new file, not synced", unsynced, emptied),
        ("page cache, append + fdatasync", append, None),
        ("page cache, overwrite + fdatasync", overwrite, None),
        ("page cache, append, writeback per 8 MiB", streamed(8 << 20), None),
        ("page cache, append, writeback per 32 MiB", streamed(32 << 20), None),
        ("overwrite in place, writeback per 32 MiB", overwrite_streamed(32 << 20), filled),
        ("reserved (fallocate), write + fdatasync", into_reserved, reserve),
        ("reserved, writeback per 32 MiB", into_reserved_streamed, reserve_streamed),
        ("O_DIRECT, append + fdatasync", direct(True), None),
        ("O_DIRECT, overwrite + fdatasync", direct(False), None),
    ]
    fs = os.statvfs(directory)
    print(f"{nbytes >> 20} MiB into {directory} ({fs.f_bsize}-byte blocks, {_fs_type(directory)})")
    try:
        for name, fn, prepare in cases:
            os.truncate(path, 0)
            times = []
            for _ in range(repeats):
                if prepare is not None:
                    prepare()
                times.append(_timed(fn))
            med = statistics.median(times)
            print(
                f"  {name:36s} {med * 1e3:8.1f} ms  {nbytes / med / 1e9:6.2f} GB/s"
                f"  (min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f})"
            )
    except OSError as exc:
        print(f"  stopped: {exc}")
    finally:
        os.unlink(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--mib", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for mib in args.mib:
        probe(args.dir, mib << 20, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
