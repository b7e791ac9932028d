"""Large values in segment files beside LMDB: written once, straight from the caller's buffer.

LMDB's ``put`` copies a value into pages it allocates for the transaction, and the
commit copies those pages into the file: two host copies of every byte of a save,
where mlx-lm's ``save_prompt_cache`` makes one. On an H200 the puts were 118 ms and
the commit 298 ms of a 565 ms durable save of 512 MiB (``tools/bench/save_profile.py
--phases``, ``tools/bench/results/gpu/91bbaed/``). A store opened with
``values="segments"`` writes each value of at least :data:`VALUE_MIN` bytes into a
segment file instead (one ``pwrite``: one copy, into the page cache) and puts a
:data:`POINTER_BYTES`-byte pointer under its key in LMDB, which stays the index.

Layout: ``<store>/values/<n>.seg`` (``n`` in 8 hex digits), append-only.

* **Writes** happen inside the LMDB write transaction that puts the key, so LMDB's
  writer lock orders them across processes. A value goes at the end of the newest
  segment (a new one past :data:`SEGMENT_BYTES`), 4 KiB aligned, and its writeback
  starts at once. The segments written are ``fdatasync``-ed before LMDB commits:
  a committed pointer never points at bytes that are not on disk. A transaction
  that aborts (or a process killed in one) leaves bytes no pointer refers to at a
  segment's end: dead bytes, never read.
* **Accounting**: under a private key per segment, LMDB holds the bytes of its live
  values, changed in the same transaction as the pointers.
* **Reclaiming**: a segment is never overwritten. Once it holds no live value and
  is not the newest, it is unlinked after the commit that emptied it. A reader whose
  snapshot still holds a pointer into it either has it mapped (an unlinked file's
  pages stay valid while mapped) or finds it gone, and the value reads as absent:
  a miss. No reader ever sees bytes change under it, without LMDB's reader table.
* **Integrity**: a pointer carries an xxh3 of its fields (a flipped bit in it reads
  as damaged, never as another value); the value's own bytes are the caller's to
  check (kvstore's records carry their checksums). A value past its segment's end
  (a truncated file) reads as damaged.

Known cost: a segment whose values die unevenly keeps its dead bytes until its last
live value goes (no compaction yet); ``stats()`` reports segment bytes against live.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from kvstore.store.engines import writeback as _writeback
from kvstore.store.engines.lmdb_guard import DAMAGED

__all__ = [
    "LIVE_PREFIX",
    "POINTER_BYTES",
    "Pointer",
    "SEGMENT_BYTES",
    "Segments",
    "VALUE_MIN",
    "VALUES_DIR",
    "is_private",
]

#: Values at least this long go to a segment (smaller ones stay in LMDB's pages).
VALUE_MIN = 1 << 20
#: A segment takes values until it is this long (one value may take it past).
SEGMENT_BYTES = 256 << 20
#: Where values start in a segment: page multiples (mapped, page-locked on a GPU).
ALIGN = 4096
VALUES_DIR = "values"
#: Private keys (hidden from the store's scans): the live bytes of each segment.
LIVE_PREFIX = b"\x00kvstore.values/live/"

_MAGIC = b"\x8bKVSEG1\n"
_POINTER = struct.Struct("<8sIIQQ")  # magic, segment, its salt, offset, length
#: A segment's first page: magic and a random salt its pointers carry. A process that
#: mapped a segment and finds a pointer into another file of the same name (a store
#: whose values were deleted by hand and written anew) reads that value as gone.
_HEADER = struct.Struct("<8sI")
_FILE_MAGIC = b"\x8bKVSEGF\n"
#: A pointer's length: its fields and the xxh3-64 of them.
POINTER_BYTES = _POINTER.size + 8
_LIVE = struct.Struct("<Q")


def is_private(key: bytes | memoryview) -> bool:
    """Whether ``key`` is one of the segments' own (not the store's)."""
    return bytes(key[: len(LIVE_PREFIX)]) == LIVE_PREFIX


def live_key(segment: int) -> bytes:
    return LIVE_PREFIX + segment.to_bytes(4, "big")


def encode_live(nbytes: int) -> bytes:
    return _LIVE.pack(nbytes)


def decode_live(raw: Any) -> int:
    return _LIVE.unpack(bytes(raw))[0] if raw is not None and len(raw) == _LIVE.size else 0


@dataclass(frozen=True)
class Pointer:
    """Where a value lives: ``length`` bytes at ``offset`` of segment ``segment``."""

    segment: int
    salt: int
    offset: int
    length: int

    def encode(self) -> bytes:
        fields = _POINTER.pack(_MAGIC, self.segment, self.salt, self.offset, self.length)
        return fields + xxhash.xxh3_64_digest(fields)

    @staticmethod
    def looks_like(raw: Any) -> bool:
        """Whether an LMDB value is a pointer (or a damaged one)."""
        return len(raw) == POINTER_BYTES and bytes(raw[: len(_MAGIC)]) == _MAGIC

    @classmethod
    def decode(cls, raw: Any) -> Pointer | None:
        """The pointer, or ``None`` where its checksum or fields are wrong."""
        data = bytes(raw)
        fields, check = data[: _POINTER.size], data[_POINTER.size :]
        if xxhash.xxh3_64_digest(fields) != check:
            return None
        _, segment, salt, offset, length = _POINTER.unpack(fields)
        if not salt or offset < ALIGN or offset % ALIGN or length <= 0:
            return None
        return cls(segment, salt, offset, length)


def segment_name(segment: int) -> str:
    return f"{segment:08x}.seg"


def segment_number(name: str) -> int | None:
    stem, dot, ext = name.partition(".")
    if ext != "seg" or len(stem) != 8:
        return None
    try:
        return int(stem, 16)
    except ValueError:
        return None


class _Mapped:
    """One segment open for reading: its descriptor and its mappings (newest last; an
    older one stays while a view of it may be alive)."""

    def __init__(self, fd: int, salt: int) -> None:
        self.fd = fd
        self.salt = salt
        self.maps: list[mmap.mmap] = []


def _salt_of(fd: int) -> int | None:
    """A segment's salt, from its header (``None``: no header: not a segment)."""
    head = os.pread(fd, _HEADER.size, 0)
    if len(head) < _HEADER.size:
        return None
    magic, salt = _HEADER.unpack(head)
    return salt if magic == _FILE_MAGIC and salt else None


class Segments:
    """The segment files of one store directory, for one process."""

    def __init__(self, store: Path, *, sync: bool) -> None:
        self.directory = store / VALUES_DIR
        self._sync = sync
        self._lock = threading.Lock()
        self._mapped: dict[int, _Mapped] = {}
        self._appending: dict[int, tuple[int, int]] = {}  # segment -> (write fd, salt)
        #: Segments appended to by the transaction under way (synced before it commits).
        self._dirty: set[int] = set()
        #: Segments the transaction under way emptied (unlinked after it commits).
        self._emptied: set[int] = set()
        self._newest: int | None = None  # learned once per transaction

    # -- reading --------------------------------------------------------------------------
    def view(self, raw: Any) -> Any:
        """The value a pointer ``raw`` refers to: a view of the mapped segment;
        ``None`` where the segment is gone (its values were all deleted after the
        reader's snapshot); :data:`DAMAGED` where the pointer or the file is damaged."""
        pointer = Pointer.decode(raw)
        if pointer is None:
            return DAMAGED
        end = pointer.offset + pointer.length
        with self._lock:
            mapped = self._mapped.get(pointer.segment)
            if mapped is None:
                try:
                    fd = os.open(
                        self.directory / segment_name(pointer.segment),
                        os.O_RDONLY | getattr(os, "O_CLOEXEC", 0),
                    )
                except FileNotFoundError:
                    return None
                except OSError:
                    return DAMAGED
                salt = _salt_of(fd)
                if salt is None:
                    os.close(fd)
                    return DAMAGED
                mapped = self._mapped[pointer.segment] = _Mapped(fd, salt)
            if pointer.salt != mapped.salt:
                return None  # another file of that name than the pointer's: it is gone
            if not mapped.maps or len(mapped.maps[-1]) < end:
                size = os.fstat(mapped.fd).st_size
                if size < end:
                    return DAMAGED  # truncated: mapping past the end would fault
                mapped.maps.append(mmap.mmap(mapped.fd, size, prot=mmap.PROT_READ))
            return memoryview(mapped.maps[-1])[pointer.offset : end]

    def release_unlinked(self) -> None:
        """Unmap the segments unlinked since they were mapped, where no view of them is
        alive (their disk space is freed once the last mapping goes)."""
        with self._lock:
            for segment, mapped in list(self._mapped.items()):
                try:
                    if os.fstat(mapped.fd).st_nlink:
                        continue
                except OSError:
                    continue
                kept = []
                for m in mapped.maps:
                    try:
                        m.close()
                    except BufferError:  # a view is alive: next time
                        kept.append(m)
                mapped.maps = kept
                if not kept:
                    os.close(mapped.fd)
                    del self._mapped[segment]

    # -- writing, inside a write transaction ----------------------------------------------
    def numbers(self) -> list[int]:
        """The segments on disk, in order."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(n for name in names if (n := segment_number(name)) is not None)

    def newest(self) -> int | None:
        """The segment values are appended to now (``None``: there is none yet)."""
        if self._newest is None:
            found = self.numbers()
            self._newest = found[-1] if found else None
        return self._newest

    def append(self, value: Any) -> tuple[Pointer, int | None]:
        """Write ``value`` at the end of the newest segment (a new one when that is full);
        ``(its pointer, the segment it filled up)`` -- that one stops being the newest
        and may be empty already."""
        view = memoryview(value).cast("B")
        segment = self.newest()
        filled = None
        opened = self._append_fd(segment) if segment is not None else None
        size = os.fstat(opened[0]).st_size if opened is not None else 0
        if segment is None or opened is None or size >= SEGMENT_BYTES:
            filled = segment
            segment = 0 if segment is None else segment + 1
            self._newest = segment
            opened = self._create(segment)
            size = ALIGN
        fd, salt = opened
        offset = -(-size // ALIGN) * ALIGN
        written = 0
        while written < view.nbytes:
            written += os.pwrite(fd, view[written:], offset + written)
        if self._sync and view.nbytes >= _writeback.MIN_BYTES:
            _writeback.start(fd, offset, view.nbytes)
        self._dirty.add(segment)
        return Pointer(segment, salt, offset, view.nbytes), filled

    def _append_fd(self, segment: int) -> tuple[int, int] | None:
        """The write descriptor and salt of ``segment`` (``None``: not a segment now)."""
        opened = self._appending.get(segment)
        if opened is not None and os.fstat(opened[0]).st_nlink:
            return opened
        if opened is not None:  # unlinked by hand meanwhile
            os.close(self._appending.pop(segment)[0])
        try:
            fd = os.open(
                self.directory / segment_name(segment), os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
            )
        except FileNotFoundError:
            return None
        salt = _salt_of(fd)
        if salt is None:
            os.close(fd)
            return None
        self._appending[segment] = (fd, salt)
        return fd, salt

    def _create(self, segment: int) -> tuple[int, int]:
        if not self.directory.is_dir():
            self.directory.mkdir()
            if self._sync:
                _fsync_directory(self.directory.parent)
        salt = secrets.randbits(32) or 1
        path = self.directory / segment_name(segment)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        os.pwrite(fd, _HEADER.pack(_FILE_MAGIC, salt), 0)
        if self._sync:
            os.fdatasync(fd)
            _fsync_directory(self.directory)
        self._appending[segment] = (fd, salt)
        return fd, salt

    def emptied(self, segment: int) -> None:
        """The transaction under way deleted ``segment``'s last live value."""
        self._emptied.add(segment)

    def before_commit(self) -> None:
        """Sync what the transaction appended: its pointers may then commit."""
        if self._sync:
            for segment in sorted(self._dirty):
                os.fdatasync(self._appending[segment][0])
        self._dirty.clear()

    def after_commit(self, still_empty: Iterable[int]) -> None:
        """Unlink the emptied segments that are still empty and not the newest (a
        segment's number is never taken again: the newest file stays)."""
        newest = self.newest()
        for segment in still_empty:
            if segment != newest:
                self.unlink(segment)
        self.end_transaction()

    def end_transaction(self) -> None:
        """Forget the transaction's state (committed, or aborted)."""
        self._dirty.clear()
        self._emptied.clear()
        self._newest = None

    @property
    def emptied_segments(self) -> set[int]:
        return set(self._emptied)

    def unlink(self, segment: int) -> None:
        opened = self._appending.pop(segment, None)
        if opened is not None:
            os.close(opened[0])
        try:
            os.unlink(self.directory / segment_name(segment))
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise

    def disk_bytes(self) -> int:
        total = 0
        for segment in self.numbers():
            try:
                total += (self.directory / segment_name(segment)).stat().st_size
            except OSError:
                pass
        return total

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._appending.values():
                os.close(fd)
            self._appending.clear()
            for mapped in self._mapped.values():
                for m in mapped.maps:
                    try:
                        m.close()
                    except BufferError:
                        pass  # a view outlives the store: its mapping goes with it
                os.close(mapped.fd)
            self._mapped.clear()


def _fsync_directory(directory: Path) -> None:
    """A new segment's name on disk before any pointer to it commits."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
