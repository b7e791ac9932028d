"""Large values in one file beside LMDB, written once and in place of values deleted before.

LMDB's ``put`` copies a value into pages it allocates for the transaction, and its
commit writes those pages into the file: a durable save of a 2 GiB KV cache on an H100
host spent 322 ms in the puts before its commit's 686 ms of writing could start, where
the same bytes written into a file of their own, over the space the last save's values
took, took 675 ms in all (``tools/bench/results/gpu/7edfb6b-h100/``). A store whose
``values`` setting is ``"file"`` (a new LMDB store's default) writes each value of at
least :data:`VALUE_MIN` bytes into
``<store>/values.kv`` instead -- one ``pwrite`` straight from the caller's buffer, its
writeback started at once, so the disk writes while the save is still encoding the
next records -- and puts a :data:`POINTER_BYTES`-byte :class:`Pointer` under its key in
LMDB, which stays the index. Readers resolve pointers wherever they find them, so a
store may hold both kinds of value.

* **Space**: which extents of the file are free, and where it ends, is one private
  LMDB value (:data:`SPACE_KEY`, checksummed), read and written inside the write
  transaction that puts or deletes the pointers: LMDB's writer lock orders every
  process's allocations, and an aborted transaction (or a process killed in one) takes
  its allocations and frees back with it; what it appended past the claimed end is cut
  off by the next writer (or by itself, where it fails rather than dies), so a full
  disk gets its room back.
* **In place, never under a reader**: a value's extent is freed by the transaction
  that deletes (or replaces) its pointer, tagged with that transaction's id. A later
  writer reuses it only once every read transaction open in any process (LMDB's
  reader table) began at or after that id: a reader that may still hold the pointer
  never sees its bytes change. Otherwise the write goes at the file's end. Free
  extents that end the file, once reusable so, are cut off it by the next transaction
  that writes the space (:meth:`Space.give_back_end`): the file shrinks with the store.
* **Durability**: the values a transaction wrote are ``fdatasync``-ed (``fsync`` on
  macOS: :func:`kvstore.files.sync_data`) before LMDB commits (synced stores): a
  committed pointer never points at bytes not handed to the disk.
  Bytes an aborted transaction wrote lie in space its commit never claimed.
* **Placed while written**: a record still being written gets its space when the
  transaction places it, and its writer's threads write its parts there as they come
  (:meth:`ValueFile.sink`, :mod:`kvstore.abc.placement`); the transaction puts its
  pointer once the record is whole, and ends only once no thread writes into its space.
* **Integrity**: a pointer carries the file's random salt and an xxh3 of its fields;
  a flipped bit in one, a pointer into another file or past the file's end reads as
  damaged, never as another value. The value's own bytes are the caller's to check
  (kvstore's records carry their checksums). A damaged or missing space record is
  rebuilt as "everything up to the file's end is taken": space may leak, values are
  never overwritten.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from kvstore.abc.placement import Sink
from kvstore.errors import StoreError, StoreFullError
from kvstore.files import fsync_path, sync_data
from kvstore.store.engines import writeback as _writeback
from kvstore.store.engines.lmdb_guard import DAMAGED

__all__ = [
    "ALIGN",
    "FILE_NAME",
    "POINTER_BYTES",
    "Pointer",
    "SPACE_KEY",
    "Space",
    "VALUE_MIN",
    "ValueFile",
    "oldest_reader",
    "pages",
    "reader_slots",
    "space_of",
    "space_problems",
    "stored_space",
]

#: Values at least this long go to the file (smaller ones stay in LMDB's pages).
VALUE_MIN = 1 << 20
#: Where values start in the file, and how their space is counted: page multiples
#: (mapped, and page-locked for a GPU's copies, as LMDB's own values are).
ALIGN = 4096
FILE_NAME = "values.kv"
#: The free extents and the end of the file (private: no store prefix scan reaches it).
SPACE_KEY = b"\x00kvstore.values/space"

_MAGIC = b"\x8bKVVAL1\n"
_POINTER = struct.Struct("<8sQQQ")  # magic, the file's salt, offset, length
#: A pointer's length: its fields and the xxh3-64 of them.
POINTER_BYTES = _POINTER.size + 8
#: The file's first page: magic and the random salt its pointers carry.
_HEADER = struct.Struct("<8sQ")
_FILE_MAGIC = b"\x8bKVVALF\n"
_SPACE_HEAD = struct.Struct("<8sQQ")  # magic, end, extents
_SPACE_MAGIC = b"\x8bKVSPC1\n"
_EXTENT = struct.Struct("<QQQ")  # offset, length, the id of the transaction that freed it


@dataclass(frozen=True)
class Pointer:
    """Where a value lives: ``length`` bytes at ``offset`` of the file salted ``salt``."""

    salt: int
    offset: int
    length: int

    def encode(self) -> bytes:
        fields = _POINTER.pack(_MAGIC, self.salt, self.offset, self.length)
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
        _, salt, offset, length = _POINTER.unpack(fields)
        if not salt or offset < ALIGN or offset % ALIGN or length <= 0:
            return None
        return cls(salt, offset, length)


def pages(length: int) -> int:
    """``length`` bytes rounded up to whole pages (:data:`ALIGN`): the space a value takes."""
    return -(-length // ALIGN) * ALIGN


class Space:
    """The file's free extents and its end, as one write transaction sees them.

    Args:
        end: the first byte past every extent ever allocated (page-aligned).
        free: ``(offset, length, freed_by)`` extents, sorted, not overlapping; two are
            adjacent only where different transactions freed them (joined once both may
            be reused: :meth:`allocate`).
    """

    def __init__(self, end: int = ALIGN, free: list[tuple[int, int, int]] | None = None) -> None:
        self.end = max(pages(end), ALIGN)
        self.free = sorted(free or [])
        self._joined_for: Callable[[int], bool] | None = None  # see _join_reusable

    def encode(self) -> bytes:
        body = _SPACE_HEAD.pack(_SPACE_MAGIC, self.end, len(self.free)) + b"".join(
            _EXTENT.pack(*extent) for extent in self.free
        )
        return body + xxhash.xxh3_64_digest(body)

    @classmethod
    def decode(cls, raw: Any) -> Space | None:
        """The space record, or ``None`` where it is damaged."""
        data = bytes(raw)
        body, check = data[:-8], data[-8:]
        if len(data) < _SPACE_HEAD.size + 8 or xxhash.xxh3_64_digest(body) != check:
            return None
        magic, end, count = _SPACE_HEAD.unpack_from(body)
        if magic != _SPACE_MAGIC or len(body) != _SPACE_HEAD.size + count * _EXTENT.size:
            return None
        free = [
            _EXTENT.unpack_from(body, _SPACE_HEAD.size + i * _EXTENT.size) for i in range(count)
        ]
        if any(o % ALIGN or n % ALIGN or not n or o + n > end for o, n, _ in free):
            return None
        return cls(end, free)

    def allocate(self, length: int, reusable: Callable[[int], bool]) -> int:
        """The offset of ``length`` bytes: the first free extent that fits and that no
        reader may still see (``reusable(freed_by)``), else the file's end. Neighbours
        that may both be reused are joined first, under the later transaction."""
        need = pages(length)
        self._join_reusable(reusable)
        for i, (offset, size, freed_by) in enumerate(self.free):
            if size >= need and reusable(freed_by):
                if size == need:
                    del self.free[i]
                else:
                    self.free[i] = (offset + need, size - need, freed_by)
                return offset
        offset, self.end = self.end, self.end + need
        return offset

    def release(self, offset: int, length: int, freed_by: int) -> None:
        """Free ``length`` bytes at ``offset`` (deleted by transaction ``freed_by``),
        merged with a free neighbour only where the same transaction freed it.

        A neighbour freed earlier stays apart: merged under the later id, space that
        may be reused now would wait for the readers of this transaction, and a save
        over its budget frees (evicts) before it allocates in the same transaction, so
        every eviction beside the free space the save was about to reuse sent the save
        to the file's end (a store kept to 300 MiB had a 736 MiB file after 1200 saves,
        still growing: ``tools/bench/results/cpu-budget-churn/``)."""
        size = pages(length)
        extents = self.free
        i = 0
        while i < len(extents) and extents[i][0] < offset:
            i += 1
        if i and extents[i - 1][2] == freed_by and extents[i - 1][0] + extents[i - 1][1] == offset:
            prev = extents.pop(i - 1)
            i -= 1
            offset, size = prev[0], prev[1] + size
        if i < len(extents) and extents[i][2] == freed_by and offset + size == extents[i][0]:
            size += extents.pop(i)[1]
        extents.insert(i, (offset, size, freed_by))

    @property
    def ends_free(self) -> bool:
        """Whether a free extent ends the file."""
        return bool(self.free) and self.free[-1][0] + self.free[-1][1] == self.end

    def give_back_end(self, reusable: Callable[[int], bool]) -> bool:
        """Move the end down past the free extents that end the file and that no reader
        may still see (``reusable(freed_by)``): whether it moved. The file is then cut
        there (:meth:`ValueFile.truncate`), so a store that shrinks, by eviction or
        deletion, gives the tail of its file back at its next write instead of keeping
        its high-water size. Space freed inside the file stays free for later values."""
        if not self.ends_free:
            return False
        self._join_reusable(reusable)
        # Joined, every reusable extent that ends the file is this last one: one touching
        # it from before is one that may not be reused yet.
        offset, _, freed_by = self.free[-1]
        if not reusable(freed_by):
            return False
        self.free.pop()
        self.end = max(offset, ALIGN)
        return True

    def _join_reusable(self, reusable: Callable[[int], bool]) -> None:
        """Join runs of adjacent extents that may all be reused, under the latest id
        (whatever reuses the latest may reuse the others). Once per predicate: a write
        transaction asks with one (:meth:`allocate` per record), and what it frees
        itself may not be reused in it, so a second pass would join nothing."""
        if self._joined_for is reusable:
            return
        self._joined_for = reusable
        joined: list[tuple[int, int, int]] = []
        last_reusable = False
        for extent in self.free:
            now_reusable = reusable(extent[2])
            if now_reusable and last_reusable and joined[-1][0] + joined[-1][1] == extent[0]:
                offset, size, freed_by = joined[-1]
                joined[-1] = (offset, size + extent[1], max(freed_by, extent[2]))
            else:
                joined.append(extent)
            last_reusable = now_reusable
        self.free = joined


def stored_space(txn: Any) -> Space | None:
    """The space record an LMDB transaction ``txn`` reads; ``None`` where there is none
    (no value written yet) or it is damaged."""
    raw = txn.get(SPACE_KEY)
    return Space.decode(raw) if raw is not None else None


def space_problems(live: list[Pointer], space: Space | None, file_size: int) -> list[str]:
    """How the file's space disagrees with the ``live`` pointers: every page from the
    header to the end belongs to exactly one live value or one free extent. Space
    marked free under a live value (a later write would overwrite it) or shared by two
    values is damage; pages neither holds are leaked (from a damaged pointer deleted,
    or a damaged space record); a value past the end or the file is damage."""
    problems: list[str] = []
    end = space.end if space is not None else pages(file_size)
    if space is None and live:
        problems.append("the value file's space record is missing or damaged")
    owned = sorted((p.offset, pages(p.length), "a value") for p in live)
    free = [(o, n, "free space") for o, n, _ in (space.free if space is not None else [])]
    edge, last = ALIGN, None
    for offset, size, what in sorted(owned + free):
        if offset + size > end or (what == "a value" and offset + size > pages(file_size)):
            problems.append(f"{what} at byte {offset} runs past the value file's end")
        if offset < edge and last is not None:
            problems.append(f"{what} at byte {offset} overlaps {last} (space shared)")
        elif offset > edge:
            problems.append(f"{offset - edge} bytes at byte {edge} held by no value (leaked)")
        edge, last = max(edge, offset + size), what
    if edge < end:
        problems.append(f"{end - edge} bytes at byte {edge} held by no value (leaked)")
    return problems


def space_of(live: list[Pointer], freed_by: int) -> Space:
    """The space ``live`` values leave: the gaps between them free (freed by
    transaction ``freed_by``: no reader older than it reuses them), the end after the
    last one. What a repair writes where :func:`space_problems` found any."""
    space = Space()
    for pointer in sorted(live, key=lambda p: p.offset):
        if pointer.offset > space.end:
            space.release(space.end, pointer.offset - space.end, freed_by)
        space.end = max(space.end, pointer.offset + pages(pointer.length))
    return space


def reader_slots(readers_table: str) -> list[tuple[int, int | None]]:
    """``(pid, snapshot)`` of each slot in LMDB's reader table (``Environment.readers()``:
    a header, then ``pid thread txnid`` per slot, ``-`` for a slot with no transaction
    open: ``None``)."""
    slots = []
    for line in readers_table.splitlines()[1:]:
        fields = line.split()
        if len(fields) == 3 and fields[0].isdigit():
            slots.append((int(fields[0]), int(fields[2]) if fields[2].isdigit() else None))
    return slots


def oldest_reader(readers_table: str) -> int | None:
    """The oldest snapshot any open read transaction holds (:func:`reader_slots`);
    ``None`` where none is open."""
    return min((txn for _, txn in reader_slots(readers_table) if txn is not None), default=None)


class ValueFile:
    """``<store>/values.kv`` for one process: a write descriptor and read mappings.

    Args:
        directory: the store's directory.
        sync: whether a transaction's values are synced before it commits.
    """

    def __init__(self, directory: Path, *, sync: bool) -> None:
        self.path = directory / FILE_NAME
        self._sync = sync
        self._lock = threading.Lock()
        self._read_fd: int | None = None
        self._write_fd: int | None = None
        self._salt: int | None = None
        #: Mappings for reading, newest last (an older one stays while a view of it may
        #: be alive; they go with the process or the last view).
        self._maps: list[mmap.mmap] = []
        #: Values written by the transaction under way (synced before it commits).
        self.dirty = False

    def exists(self) -> bool:
        return self.path.exists()

    # -- reading --------------------------------------------------------------------------
    def view(self, raw: Any) -> Any:
        """The value pointer ``raw`` refers to (a view of the mapped file), or
        :data:`DAMAGED` where the pointer, or the file it points into, is damaged."""
        pointer = Pointer.decode(raw)
        if pointer is None:
            return DAMAGED
        end = pointer.offset + pointer.length
        with self._lock:
            if self._read_fd is None:
                try:
                    self._read_fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError:
                    return DAMAGED
            if self._salt is None:
                self._salt = _salt_of(self._read_fd)
            if self._salt is None or pointer.salt != self._salt:
                return DAMAGED  # no header, or a pointer into another file of this name
            if not self._maps or len(self._maps[-1]) < end:
                size = os.fstat(self._read_fd).st_size
                if size < end:
                    return DAMAGED  # truncated: mapping past the end would fault
                self._unmap_unused()
                self._maps.append(mmap.mmap(self._read_fd, size, prot=mmap.PROT_READ))
            return memoryview(self._maps[-1])[pointer.offset : end]

    def _unmap_unused(self) -> None:
        """Close the mappings no view holds any more (a growing file maps anew)."""
        kept = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view of it is alive
                kept.append(m)
        self._maps = kept

    # -- writing, inside a write transaction ----------------------------------------------
    def write(self, offset: int, value: Any) -> Pointer:
        """``value`` written at ``offset`` (its writeback started); its pointer.

        Raises:
            StoreFullError: the disk is full (the transaction is then aborted: nothing
                it wrote is claimed).
            StoreError: the file could not be written.
        """
        view = memoryview(value).cast("B")
        self.sink(offset, view.nbytes)(0, view)  # one part: the whole value
        return self.pointer(offset, view.nbytes)

    def sink(self, offset: int, nbytes: int) -> Sink:
        """Where the parts of a value placed at ``offset`` are written, each as it comes
        (:mod:`kvstore.abc.placement`; on any thread, while the transaction that placed
        it is open), its writeback started; none past ``nbytes``. The pointer comes
        from :meth:`pointer` once every part is written.

        Raises:
            StoreFullError, StoreError: as :meth:`write` (so does the sink).
        """
        with self._failing("write"):
            fd, _ = self._writer()  # opened here, on the transaction's thread
        self.dirty = True
        sync = self._sync

        def write_part(at: int, part: memoryview) -> None:
            if at < 0 or at + part.nbytes > nbytes:
                raise StoreError(
                    f"[write] A part of {part.nbytes} bytes at byte {at} runs past the "
                    f"{nbytes} bytes placed for it in {self.path}; nothing was written.",
                    path=str(self.path),
                )
            with self._failing("write"):
                _write_all(fd, part.cast("B"), offset + at)
            if sync:
                _writeback.start(fd, offset + at, part.nbytes)

        return write_part

    def pointer(self, offset: int, length: int) -> Pointer:
        """The pointer to ``length`` bytes written at ``offset`` of this file."""
        _, salt = self._writer()
        return Pointer(salt, offset, length)

    def before_commit(self) -> None:
        """Sync what the transaction wrote: its pointers may then commit."""
        if self.dirty and self._sync and self._write_fd is not None:
            with self._failing("sync"):
                sync_data(self._write_fd)
        self.dirty = False

    @contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        """An ``OSError`` of the file as ours: a full disk is :class:`StoreFullError`."""
        try:
            yield
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise StoreFullError(
                    f"[write] The disk holding {self.path} is full ({exc}); nothing was "
                    f"written. Free space, or set a byte budget (max_bytes) below the free "
                    f"space.",
                    path=str(self.path),
                ) from exc
            raise StoreError(
                f"[write] Could not {what} the value file {self.path} ({exc}); nothing was "
                f"written. Check the disk and the file's permissions.",
                path=str(self.path),
            ) from exc

    def truncate(self, end: int) -> None:
        """Cut the file back to ``end`` bytes where it is longer: what a failed or killed
        writer appended past the space claimed, or a free end no reader can still see
        (:meth:`Space.give_back_end`); no pointer reaches either. Called under LMDB's
        writer lock; readers never map past what their pointers claim."""
        if self.size() <= end or not self.exists():
            return
        with self._failing("truncate"):
            fd, _ = self._writer()
            os.ftruncate(fd, end)

    def size(self) -> int:
        """Bytes of the file now (0: none)."""
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def _writer(self) -> tuple[int, int]:
        if self._write_fd is None:
            created = not self.path.exists()
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            salt = _salt_of(fd)
            if salt is None:  # a new file (or an empty one a killed creator left)
                salt = secrets.randbits(63) or 1
                os.pwrite(fd, _HEADER.pack(_FILE_MAGIC, salt).ljust(ALIGN, b"\0"), 0)
                os.fsync(fd)
                if created:  # its name on disk before any pointer to it commits
                    fsync_path(self.path.parent)
            self._write_fd, self._salt = fd, salt
        assert self._salt is not None
        return self._write_fd, self._salt

    def close(self) -> None:
        with self._lock:
            for fd in (self._read_fd, self._write_fd):
                if fd is not None:
                    os.close(fd)
            self._read_fd = self._write_fd = None
            self._unmap_unused()
            self._maps.clear()  # a view outlives the store: its mapping goes with it


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    written = 0
    while written < view.nbytes:
        written += os.pwrite(fd, view[written:], offset + written)


def _salt_of(fd: int) -> int | None:
    """The file's salt, from its header (``None``: no header: not a value file)."""
    head = os.pread(fd, _HEADER.size, 0)
    if len(head) < _HEADER.size:
        return None
    magic, salt = _HEADER.unpack(head)
    return salt if magic == _FILE_MAGIC and salt else None
