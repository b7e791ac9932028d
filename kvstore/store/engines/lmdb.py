"""The embedded default backend: one LMDB environment, many processes, zero-copy reads.

Readers never block the writer or each other (LMDB MVCC); one writer at a
time per store, across processes. Commits are durable (``sync=True``) and a
writer killed at any point leaves the last committed state. The map (LMDB's
size limit) grows by itself: a transaction that hits ``MapFullError`` is
aborted, the map doubled and the transaction re-run; a process whose map
another process grew adopts the new size on ``MapResizedError``. Every
``lmdb.Error`` is translated by :data:`LMDB_ERRORS`.

An open store is not shared across ``fork()``: LMDB's environment, its locks and its
reader slots belong to the process that opened it. In a forked child every use of a
store the parent had open raises :class:`~kvstore.errors.StoreUnavailableError` (a
restore then recomputes), and ``open_store`` there opens the directory afresh.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from kvstore.abc.placement import Placement
from kvstore.abc.store import Backend, Buffer, PendingRecord
from kvstore.errors import (
    ReadOnlyStoreError,
    StoreConfigError,
    StoreError,
    StoreFullError,
    StoreUnavailableError,
)
from kvstore.store.engines import lmdb_values as _values
from kvstore.store.engines import writeback as _writeback
from kvstore.store.engines.boundary import Translation, raise_translated, translate_errors
from kvstore.store.engines.lmdb_env import SharedEnv
from kvstore.store.engines.lmdb_file import check_file, meta_damage
from kvstore.store.engines.lmdb_guard import DAMAGED, address_of, view_at
from kvstore.store.engines.lmdb_values import (
    POINTER_BYTES,
    SPACE_KEY,
    Pointer,
    Space,
    oldest_reader,
    space_of,
    space_problems,
    stored_space,
)
from kvstore.store.keys import prefix_successor

__all__ = ["LMDB_ERRORS", "LMDBBackend", "open_lmdb_backend"]

T = TypeVar("T")

_DAMAGED = "The LMDB file is damaged; run `kvstore verify URL --fix`, which rebuilds it."
_BUG = "This is a kvstore bug; please report it with the traceback."

#: Every python-lmdb exception class and what it becomes (tests check none is missing).
LMDB_ERRORS: dict[type[BaseException], Translation] = {
    lmdb.MapFullError: Translation(
        StoreFullError, "The LMDB map reached max_map_size; raise it, set a budget or evict."
    ),
    lmdb.DiskError: Translation(
        StoreFullError, "The disk is full; free space or set a byte budget (max_bytes)."
    ),
    lmdb.TxnFullError: Translation(
        StoreFullError, "One transaction dirtied too many pages; save fewer blocks per call."
    ),
    lmdb.PageFullError: Translation(StoreFullError, "An LMDB page overflowed. " + _BUG),
    lmdb.MemoryError: Translation(StoreError, "The process ran out of memory."),
    lmdb.ReadersFullError: Translation(
        StoreUnavailableError,
        "Every LMDB reader slot is taken; raise max_readers or close idle processes.",
    ),
    lmdb.TlsFullError: Translation(
        StoreUnavailableError, "Too many threads hold read transactions; retry later."
    ),
    lmdb.LockError: Translation(
        StoreUnavailableError, "The store's lock file could not be locked; retry later."
    ),
    lmdb.MapResizedError: Translation(
        StoreUnavailableError, "Another process grew the map during the call; retry."
    ),
    lmdb.ReadonlyError: Translation(
        ReadOnlyStoreError, "The store or its files are read-only; check permissions."
    ),
    lmdb.VersionMismatchError: Translation(
        StoreConfigError, "The store was written by another LMDB version; open it with that one."
    ),
    lmdb.IncompatibleError: Translation(
        StoreConfigError, "The file was created with incompatible LMDB flags; it is not ours."
    ),
    lmdb.InvalidError: Translation(
        StoreConfigError, "The path holds a file that is not an LMDB store; pick another path."
    ),
    lmdb.InvalidParameterError: Translation(
        StoreConfigError, "An LMDB option is invalid; check map_size and max_readers."
    ),
    lmdb.CryptoFailError: Translation(StoreConfigError, "The store is encrypted; kvstore is not."),
    lmdb.EnvEncryptionError: Translation(
        StoreConfigError, "The store is encrypted; kvstore is not."
    ),
    lmdb.DbsFullError: Translation(StoreConfigError, "Too many named databases. " + _BUG),
    lmdb.CorruptedError: Translation(StoreError, _DAMAGED),
    lmdb.PageNotFoundError: Translation(StoreError, _DAMAGED),
    lmdb.BadChecksumError: Translation(StoreError, _DAMAGED),
    lmdb.ProblemError: Translation(StoreError, _DAMAGED),
    lmdb.PanicError: Translation(StoreError, "LMDB hit a fatal error; reopen the store."),
    lmdb.BadTxnError: Translation(StoreError, "The transaction failed earlier; retry the call."),
    lmdb.BadRslotError: Translation(StoreError, "A reader slot was misused. " + _BUG),
    lmdb.BadDbiError: Translation(StoreError, "A database handle went stale; reopen the store."),
    lmdb.BadValsizeError: Translation(StoreError, "A key or value LMDB cannot hold. " + _BUG),
    lmdb.CursorFullError: Translation(StoreError, "The B-tree is too deep. " + _BUG),
    lmdb.KeyExistsError: Translation(StoreError, _BUG),
    lmdb.NotFoundError: Translation(StoreError, _BUG),
    lmdb.Error: Translation(StoreError, "Unexpected LMDB error."),
}

_MiB = 1 << 20
# LMDB errors about one value's pages: that value is damaged, the rest still reads.
_UNREADABLE = (lmdb.PageNotFoundError, lmdb.CorruptedError)


class _LMDBView:
    """A read (or write) view over one LMDB transaction opened with ``buffers=True``.

    Values are read through a cursor whose node is checked first
    (:mod:`kvstore.store.engines.lmdb_guard`): a value that would run past the
    file is returned as :data:`~kvstore.store.engines.lmdb_guard.DAMAGED`, a
    key that would run past its page is skipped, and LMDB's own "damaged page"
    errors on one value make that value damaged, never a dead process.
    """

    __slots__ = (
        "_txn",
        "_cursor",
        "_guard",
        "_end",
        "_shared",
        "_mapped",
        "_to_file",
        "_file",
        "_space",
        "_claimed",
        "_reuse",
        "_placed",
    )

    def __init__(
        self, txn: lmdb.Transaction, shared: SharedEnv, write: bool, to_file: bool = False
    ) -> None:
        self._txn = txn
        self._cursor: lmdb.Cursor | None = None
        self._shared = shared
        self._guard = shared.guard
        self._mapped = not write
        self._end = 0  # measured when the first value is read
        #: A write view's large values go to the value file (``values="file"``), and
        #: pointers it replaces or deletes free their space (wherever the file exists).
        self._to_file = write and to_file
        self._file = self._to_file or (write and shared.values.exists())
        #: The value file's space as this transaction changes it (read at first use).
        self._space: Space | None = None
        #: The file's end as committed (bytes past it are claimed by nothing).
        self._claimed = 0
        self._reuse: Callable[[int], bool] | None = None
        #: Records placed in the value file while they are still being written (their
        #: offset, the bytes allocated and their placement), until they are put.
        self._placed: dict[bytes, tuple[int, int, Placement]] = {}

    def _cur(self) -> lmdb.Cursor:
        if self._cursor is None:
            self._cursor = self._txn.cursor()
        return self._cursor

    def _committed(self) -> int:
        # Bytes of committed pages: LMDB writes a page to the file before the meta
        # page that makes it visible, and the file only grows.
        if not self._end:
            info = self._shared.env.info()
            pages = (info["last_pgno"] + 1) * self._guard.psize
            self._end = min(self._shared.file_size(), info["map_size"], pages)
        return self._end

    def _value(self, cursor: lmdb.Cursor) -> Buffer:
        span = self._guard.value_span(cursor.key(), self._committed(), mapped=self._mapped)
        if span is None:
            return DAMAGED
        offset, size = span
        shared = self._shared
        base = shared.map_base
        if offset < 0 or base == 0:
            return cursor.value()
        if base is None or shared.map_unconfirmed is not None:
            # Once per map: python-lmdb's view of one value says where the map lies, and
            # its view of a second (elsewhere) that the values lie where LMDB's layout
            # says, before any value is viewed without it.
            theirs = cursor.value()
            found = address_of(theirs) - offset
            if len(theirs) != size or found <= 0 or (base is not None and found != base):
                shared.map_base, shared.map_unconfirmed = 0, None
            elif base is None:
                shared.map_base, shared.map_unconfirmed = found, offset
            elif offset != shared.map_unconfirmed:
                shared.map_unconfirmed = None
            return theirs
        # An overflow value in the map, viewed where LMDB itself finds it. python-lmdb's
        # own view first touches every page of it on this thread (its ``preload``):
        # 16 values of 32 MiB, ~4.4 ms here even with every page mapped, ~5-9 ms in a
        # fresh process, before a restore could parse its first header. A restore's
        # checks and page-locking read the pages on threads of their own anyway.
        return view_at(base + offset, size)

    def _resolved(self, cursor: lmdb.Cursor) -> Buffer:
        """The value under the cursor, a pointer's from the value file."""
        value = self._value(cursor)
        if Pointer.looks_like(value):  # its length first: one compare for any other value
            return self._shared.values.view(value)
        return value

    def get(self, key: bytes) -> Buffer | None:
        cursor = self._cur()
        try:
            if not cursor.set_key(key):
                return None
        except _UNREADABLE:
            return DAMAGED  # LMDB found the node but not its overflow pages
        return self._resolved(cursor)

    def contains(self, key: bytes) -> bool:
        # set_key positions the cursor without materialising the value.
        return self._cur().set_key(key)

    def _items(
        self, cursor: lmdb.Cursor, prefix: bytes, step: Callable[[], bool], ascending: bool
    ) -> Iterator[tuple[bytes, Buffer]]:
        mapped = self._mapped
        while True:
            raw = cursor.key()
            if self._guard.key_ok(raw, mapped=mapped):
                key = bytes(raw)
                if ascending and not key.startswith(prefix):
                    return
                if not ascending and (key < prefix or not key.startswith(prefix)):
                    return
                yield key, self._resolved(cursor)
            if not step():
                return

    def scan(
        self, prefix: bytes, *, start: bytes | None = None, reverse: bool = False
    ) -> Iterator[tuple[bytes, Buffer]]:
        cursor = self._txn.cursor()
        if not reverse:
            if cursor.set_range(max(prefix, start) if start is not None else prefix):
                yield from self._items(cursor, prefix, cursor.next, True)
            return
        if start is not None and cursor.set_range(start):
            positioned = cursor.prev()
        elif start is None and cursor.set_range(prefix_successor(prefix)):
            positioned = cursor.prev()
        else:
            positioned = cursor.last()
        if positioned:
            yield from self._items(cursor, prefix, cursor.prev, False)

    def keys(self, prefix: bytes) -> Iterator[bytes]:
        cursor = self._txn.cursor()
        if not cursor.set_range(prefix):
            return
        mapped = self._mapped
        while True:
            raw = cursor.key()
            if self._guard.key_ok(raw, mapped=mapped):
                key = bytes(raw)
                if not key.startswith(prefix):
                    return
                yield key
            if not cursor.next():
                return

    def put(self, key: bytes, value: Any, *, if_absent: bool = False) -> bool:
        if not self._file:
            return self._txn.put(key, value, overwrite=not if_absent)
        cursor = self._cur()
        if cursor.set_key(key):
            if if_absent:
                return False
            self._release(cursor)
        if self._to_file:
            nbytes = memoryview(value).nbytes
            placed = self._placed.pop(key, None)
            if placed is not None:
                value = self._placed_pointer(placed, value, nbytes).encode()
            elif nbytes >= _values.VALUE_MIN:
                offset = self._space_now().allocate(nbytes, self._reusable())
                value = self._shared.values.write(offset, value).encode()
        return self._txn.put(key, value)

    def place(self, key: bytes, record: PendingRecord) -> None:
        """Write ``record`` into the value file while it is being written: its bound's
        space is allocated now and every part goes there as it comes
        (:mod:`kvstore.abc.placement`); ``put(key, record)`` then puts its pointer."""
        placement = record.placement
        if (
            not self._to_file
            or placement is None
            or record.nbytes_bound < _values.VALUE_MIN
            or key in self._placed
        ):
            return
        bound = record.nbytes_bound
        offset = self._space_now().allocate(bound, self._reusable())
        self._placed[key] = (offset, bound, placement)
        placement.attach(self._shared.values.sink(offset, bound))

    def _placed_pointer(
        self, placed: tuple[int, int, Placement], value: Any, nbytes: int
    ) -> Pointer:
        """The pointer to a placed record, now written whole (``value``): its parts are
        in the file, or, where they do not make it, it is written there now; the space
        allocated past its pages is freed."""
        offset, bound, placement = placed
        placement.detach()
        placement.check()  # a part the disk refused fails the transaction, as a write would
        space = self._space_now()
        if nbytes > bound:  # not what was placed: never written past its space
            space.release(offset, bound, self._txn.id())
            offset = space.allocate(nbytes, self._reusable())
            return self._shared.values.write(offset, value)
        if placement.moved:  # its parts are not the record's bytes: the record, whole
            pointer = self._shared.values.write(offset, value)
        else:
            pointer = self._shared.values.pointer(offset, nbytes)
        unused = _values.pages(bound) - _values.pages(nbytes)
        if unused:
            space.release(offset + _values.pages(nbytes), unused, self._txn.id())
        return pointer

    def _unplace(self) -> None:
        """Records placed and never put: no part goes to the file any more, and their
        space is free again (this transaction's end must not find a writer in it)."""
        placed, self._placed = self._placed, {}
        for offset, bound, placement in placed.values():
            placement.detach()
            if self._space is not None:
                self._space.release(offset, bound, self._txn.id())

    def delete(self, key: bytes) -> bool:
        if self._file:
            cursor = self._cur()
            if not cursor.set_key(key):
                return False
            self._release(cursor)
        return self._txn.delete(key)

    # -- the value file (write views) ------------------------------------------------------
    def _release(self, cursor: lmdb.Cursor) -> None:
        """Free the space of the pointer under ``cursor``, which this transaction replaces
        or deletes. Only a value inside its node can be one (40 bytes): any other is left
        untouched (python-lmdb reads a whole value, and a damaged size would fault)."""
        if self._guard.inline_size(cursor.key()) != POINTER_BYTES:
            return
        old = cursor.value()
        if not Pointer.looks_like(old):
            return
        pointer = Pointer.decode(old)
        if pointer is not None:  # a damaged pointer's space stays taken
            self._space_now().release(pointer.offset, pointer.length, self._txn.id())

    def _space_now(self) -> Space:
        if self._space is None:
            space = stored_space(self._txn)
            if space is None:  # none yet, or damaged: everything in the file is taken
                space = Space(self._shared.values.size())
            self._space, self._claimed = space, space.end
            # What a killed or failed writer appended past the end: nothing claims it,
            # and on a full disk LMDB's own file may need the room.
            self._shared.values.truncate(space.end)
        return self._space

    def _reusable(self) -> Callable[[int], bool]:
        """Whether space freed by a transaction may be written now: it committed before
        this one, and every open read transaction (any process's) began after it."""
        if self._reuse is None:  # once a transaction: the reader table is read, not locked
            current = self._txn.id()
            oldest = oldest_reader(self._shared.env.readers())
            self._reuse = lambda freed: freed < current and (oldest is None or oldest >= freed)
        return self._reuse

    @property
    def txn_id(self) -> int:
        return int(self._txn.id())

    def value_file_space(self) -> tuple[list[Pointer], Space | None]:
        """Every live value's pointer in the file (a damaged pointer is the record's
        damage, found by reading it), and the space record as stored."""
        live = []
        cursor = self._txn.cursor()
        for _ in cursor.iternext(keys=True, values=False):
            if self._guard.inline_size(cursor.key()) != POINTER_BYTES:
                continue
            raw = cursor.value()
            pointer = Pointer.decode(raw) if Pointer.looks_like(raw) else None
            if pointer is not None:
                live.append(pointer)
        return live, stored_space(self._txn)

    def rewrite_space(self, space: Space) -> None:
        """Replace the space record (:meth:`LMDBBackend.mend`)."""
        self._space, self._claimed = space, space.end

    def read_space(self) -> None:
        """Read the value file's space, so that this transaction's commit records it and
        cuts its free end off the file (:meth:`before_commit`)."""
        self._space_now()

    def abandon(self) -> None:
        """The transaction will not commit: give back the room it appended to the file
        (LMDB's writer lock is still held: no other writer claims it meanwhile)."""
        self._unplace()
        self._shared.values.dirty = False
        if self._space is not None:
            self._shared.values.truncate(self._claimed)

    def before_commit(self) -> None:
        """The value file's part of the commit: its values synced, its space recorded."""
        self._unplace()
        if self._space is not None:
            # Under LMDB's writer lock, past every value placed: should the commit fail,
            # the file is only shorter than free space it records, which a write extends.
            # (ends_free first: the reader table is read only where an end might go.)
            if self._space.ends_free and self._space.give_back_end(self._reusable()):
                self._shared.values.truncate(self._space.end)
            self._txn.put(SPACE_KEY, self._space.encode())
        self._shared.values.before_commit()


class _Reading:
    """``LMDBBackend.reader()``: a read transaction under the gate, engine errors raised
    as ours -- what ``_begin`` and ``translate_errors`` do for a write, as one object.

    Every lookup and every save opens one: a re-save of a stored prefix (P3) is hashing
    and this one read. As four nested generator context managers it cost ~64 us (with a
    ``contains``) in the bench's cold conditions, right after the peer's save, against 12
    for ``env.begin`` and a get; as one object, with the gate on a plain lock, ~33 us.
    """

    __slots__ = ("_backend", "_txn")

    def __init__(self, backend: LMDBBackend) -> None:
        self._backend = backend
        self._txn: lmdb.Transaction | None = None

    def __enter__(self) -> _LMDBView:
        backend = self._backend
        backend._check_process("read")
        gate = backend._gate
        while True:
            gate.enter()
            try:
                txn = backend._env.begin(write=False, buffers=True)
            except lmdb.MapResizedError:  # another process grew the map: adopt it
                gate.leave()
            except BaseException as exc:
                gate.leave()
                raise_translated(exc, LMDB_ERRORS, "read", backend.url)
                raise
            else:
                self._txn = txn
                return _LMDBView(txn, backend._shared, write=False)  # type: ignore[arg-type]
            # set_mapsize needs no transaction open in this process: resize alone.
            with gate.exclusive("read"), translate_errors(LMDB_ERRORS, "read", backend.url):
                backend._set_mapsize(0)

    def __exit__(self, kind: Any, exc: BaseException | None, trace: Any) -> None:
        backend = self._backend
        try:
            assert self._txn is not None
            self._txn.abort()
        finally:
            self._txn = None
            backend._gate.leave()
        if exc is not None:
            raise_translated(exc, LMDB_ERRORS, "read", backend.url)


class LMDBBackend(Backend):
    """An LMDB environment (a directory holding ``data.mdb`` and ``lock.mdb``).

    Args:
        path: the store directory; created (with parents) unless ``create=False``.
        map_size: initial map size in bytes; it grows as needed.
        max_map_size: ceiling for growth (``None``: grow until the disk is full).
        readonly: open for reading only (writes raise ReadOnlyStoreError).
        create: create a new store when ``path`` holds none.
        max_readers: concurrent read transactions across all processes.
        sync: fsync every commit (durable); ``False`` trades durability after a
            power loss (not a process crash) for commit latency.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int = 256 * _MiB,
        max_map_size: int | None = None,
        readonly: bool = False,
        create: bool = True,
        max_readers: int = 126,
        sync: bool = True,
        url: str | None = None,
    ) -> None:
        self.path = Path(path).expanduser()
        #: Where writes put large values (the store's ``values`` setting says:
        #: :meth:`write_values_to`); until then LMDB's pages.
        self._values = "inline"
        self.url = url or f"lmdb://{self.path.resolve()}"
        self._readonly = readonly
        self._max_map_size = max_map_size
        self._check_path(create and not readonly)
        self._check_meta()
        with translate_errors(LMDB_ERRORS, "open_store", self.url):
            self._shared: SharedEnv | None = SharedEnv.acquire(
                self.path,
                self.url,
                map_size=max(map_size, _MiB),
                subdir=True,
                readonly=readonly,
                create=create and not readonly,
                max_readers=max_readers,
                max_dbs=0,
                sync=sync,
                metasync=sync,
                lock=True,
            )
        self._env = self._shared.env
        self._gate = self._shared.gate

    def _check_meta(self) -> None:
        """Refuse a file whose meta page LMDB would take damage from on trust: LMDB would
        write it into the other meta page with the next commit, and could abort on it."""
        if not (self.path / "data.mdb").exists():
            return
        try:
            damage = meta_damage(self.path)
        except OSError:
            return  # unreadable: LMDB's own open says why
        if damage is not None:
            raise StoreError(
                f"[open_store] {self.url}: {damage}. The LMDB file is damaged; run "
                f"'kvstore verify {self.url} --fix', which rebuilds it.",
                url=self.url,
                problem=damage,
            )

    def _check_path(self, create: bool) -> None:
        p = self.path
        if p.exists() and not p.is_dir():
            raise StoreConfigError(
                f"[open_store] An LMDB store is a directory; {p} is a file. Point the URL at "
                f"a directory (lmdb:///path/to/store).",
                path=str(p),
            )
        if (p / "data.mdb").exists():
            return
        if not p.exists():
            if not create:
                raise StoreConfigError(
                    f"[open_store] No store at {p}; it does not exist. Open it without "
                    f"readonly=True/create=False to create one.",
                    path=str(p),
                )
            p.mkdir(parents=True, exist_ok=True)
            return
        # lock.mdb alone: another process is creating the store right now.
        if set(os.listdir(p)) - {"lock.mdb"}:
            raise StoreConfigError(
                f"[open_store] {p} is a non-empty directory with no LMDB store (no data.mdb) "
                f"in it; refusing to create one among other files. Use an empty or new "
                f"directory.",
                path=str(p),
            )
        if not create:
            raise StoreConfigError(
                f"[open_store] {p} is empty: no store to open read-only.", path=str(p)
            )

    @property
    def environment(self) -> lmdb.Environment:
        """The python-lmdb environment (shared by every store open on this path in this
        process), for tools and benchmarks; the store itself goes through the gate."""
        return self._env

    @property
    def writeback(self) -> _writeback.Writeback | None:
        """The pump that starts large commits' writeback early (``None`` where commits
        are left as LMDB makes them: read-only, unsynced, off, or not on Linux)."""
        return self._shared.writeback if self._shared is not None else None

    # Capabilities.
    @property
    def supports_zero_copy(self) -> bool:
        return True

    @property
    def supports_multiprocess(self) -> bool:
        return True

    @property
    def supports_persistence(self) -> bool:
        return True

    @property
    def supports_writes(self) -> bool:
        return not self._readonly

    @property
    def supports_value_file(self) -> bool:
        return True

    @property
    def supports_placement(self) -> bool:
        return self._values == "file"

    @property
    def has_value_file(self) -> bool:
        return self._shared is not None and self._shared.values.exists()

    def give_back_space(self) -> int:
        """The value file's free end cut off it (:meth:`Space.give_back_end`) by a write
        transaction of its own: the bytes given back. None is made where the space record
        ends in no free extent; one is where another process's read still sees the end
        (nothing goes then)."""
        if not self.has_value_file:
            return 0
        self.require_writes("give_back_space")
        with self._begin("give_back_space", write=False) as txn:
            space = stored_space(txn)
        if space is None or not space.ends_free:
            return 0
        values = self._shared.values  # type: ignore[union-attr]
        before = values.size()
        self._transact(_LMDBView.read_space, 0)
        return max(0, before - values.size())

    def write_values_to(self, where: str) -> None:
        """Values of at least :data:`~kvstore.store.engines.lmdb_values.VALUE_MIN` bytes
        go to ``<store>/values.kv`` (``"file"``) or LMDB's pages (``"inline"``)."""
        if where not in ("inline", "file"):
            raise StoreConfigError(
                f"[open_store] values must be 'inline' or 'file'; received {where!r}.",
                setting="values",
                found=where,
            )
        self._values = where

    @contextmanager
    def _begin(self, operation: str, write: bool) -> Iterator[lmdb.Transaction]:
        """A transaction under the gate, adopting a map another process grew."""
        self._check_process(operation)
        while True:
            with self._gate.shared():
                with translate_errors(LMDB_ERRORS, operation, self.url):
                    if write:
                        # Slots of processes that died inside a read transaction pin the
                        # pages (and value-file space) freed after their snapshot: a store
                        # open for days would never reuse them and grow at every save.
                        # Cleared here, as at open; ~0.1 us a transaction.
                        self._env.reader_check()
                    try:
                        txn = self._env.begin(write=write, buffers=True)
                    except lmdb.MapResizedError:
                        txn = None
                if txn is not None:
                    try:
                        yield txn
                    finally:
                        txn.abort()  # a no-op after a commit
                    return
            # set_mapsize needs no transaction open in this process: resize alone.
            with (
                self._gate.exclusive(operation),
                translate_errors(LMDB_ERRORS, operation, self.url),
            ):
                self._set_mapsize(0)

    def _check_process(self, operation: str) -> None:
        """Raise where this store was opened by the process this one was forked from."""
        shared = self._shared
        if shared is not None and shared.pid != os.getpid():
            raise StoreUnavailableError(
                f"[{operation}] {self.url} was opened in process {shared.pid}, which this "
                f"process ({os.getpid()}) was forked from; an LMDB store cannot be used "
                f"across fork(). Open it again in this process (open_store).",
                url=self.url,
                opened_in=shared.pid,
            )

    def reader(self) -> _Reading:
        return _Reading(self)

    def _transact(self, fn: Callable[[_LMDBView], T], size_hint: int) -> T:
        while True:
            with self._begin("write", write=True) as txn:
                with translate_errors(LMDB_ERRORS, "write", self.url):
                    view = _LMDBView(
                        txn,
                        self._shared,  # type: ignore[arg-type]
                        write=True,
                        to_file=self._values == "file",
                    )
                    try:
                        result = fn(view)
                        view.before_commit()
                        self._commit(txn, size_hint)
                        return result
                    except lmdb.MapFullError:
                        view.abandon()
                        # the transaction is void: grow the map, run fn again
                    except BaseException as exc:
                        view.abandon()
                        if isinstance(exc, lmdb.Error):
                            self._raise_if_disk_full(exc, size_hint)
                        raise
            self._grow(size_hint)

    def _commit(self, txn: lmdb.Transaction, size_hint: int) -> None:
        """``txn.commit()``; a large one with its writeback started early
        (:mod:`~kvstore.store.engines.writeback`)."""
        writeback = self.writeback
        if writeback is None or size_hint < _writeback.MIN_BYTES:
            txn.commit()
            return
        with writeback.during():
            txn.commit()

    def _raise_if_disk_full(self, exc: lmdb.Error, size_hint: int) -> None:
        """A write that failed because the disk is full is StoreFullError.

        LMDB 0.9 reports a short write at commit as EIO, not ENOSPC, so an EIO
        counts as "full" when the filesystem has (almost) no room left.
        """
        code = getattr(exc, "code", None)
        full = isinstance(exc, lmdb.DiskError) or code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        if not full and code == errno.EIO:
            try:
                full = shutil.disk_usage(self.path).free < size_hint + 16 * _MiB
            except OSError:
                full = False
        if full:
            raise StoreFullError(
                f"[write] The disk holding {self.url} is full ({exc}); nothing was written. "
                f"Free space, or set a byte budget (max_bytes) below the free space.",
                url=self.url,
                needed=size_hint,
            ) from exc

    def _grow(self, size_hint: int) -> None:
        """Double the map (at least enough for ``size_hint`` more bytes), within the ceiling."""
        with self._gate.exclusive("write"), translate_errors(LMDB_ERRORS, "write", self.url):
            info = self._env.info()
            current = info["map_size"]
            used = (info["last_pgno"] + 1) * self._env.stat()["psize"]
            wanted = max(2 * current, used + 2 * size_hint + 64 * _MiB)
            if self._max_map_size is not None:
                wanted = min(wanted, self._max_map_size)
            if wanted <= current:
                raise StoreFullError(
                    f"[write] The LMDB map of {self.url} is full at max_map_size="
                    f"{self._max_map_size} bytes and this write needs about {size_hint} more. "
                    f"Raise max_map_size, set a byte budget (max_bytes) or evict.",
                    map_size=current,
                    max_map_size=self._max_map_size,
                    needed=size_hint,
                )
            self._set_mapsize(wanted)

    def _set_mapsize(self, size: int) -> None:
        """Resize (0: adopt another process's size) and remap the map, under the
        exclusive gate: its address may change, so the next read learns it anew."""
        self._env.set_mapsize(size)
        if self._shared is not None:
            self._shared.map_base = self._shared.map_unconfirmed = None

    def stats(self) -> dict[str, Any]:
        with translate_errors(LMDB_ERRORS, "stats", self.url):
            info, stat = self._env.info(), self._env.stat()
            with self._env.begin() as txn:
                space = stored_space(txn)
        data = self.path / "data.mdb"
        return {
            "engine": f"lmdb {'.'.join(map(str, lmdb.version()))}",
            "path": str(self.path),
            "entries": stat["entries"],
            "map_size": info["map_size"],
            "used_bytes": (info["last_pgno"] + 1) * stat["psize"],
            "file_bytes": data.stat().st_size if data.exists() else 0,
            "value_file_bytes": self._shared.values.size() if self._shared is not None else 0,
            # Freed and not yet reused (later saves write there first); 0 without a file.
            "value_file_free_bytes": sum(n for _, n, _ in space.free) if space else 0,
            "value_file_free_extents": len(space.free) if space else 0,
            "readers": info["num_readers"],
            "max_readers": info["max_readers"],
        }

    def check(self) -> tuple[str, ...]:
        """Damage in ``data.mdb``'s B-trees, free list or meta pages, read without LMDB
        (:func:`~kvstore.store.engines.lmdb_file.check_file`; ``kvstore verify --fix``
        rebuilds a damaged file), and the value file's space disagreeing with its live
        values (:func:`~kvstore.store.engines.lmdb_values.space_problems`; :meth:`mend`
        rewrites it)."""
        with translate_errors(LMDB_ERRORS, "verify", self.url):
            problems = tuple(check_file(self.path).problems)
        if problems or not self.has_value_file:
            return problems
        with self.reader() as view:
            live, space = view.value_file_space()  # type: ignore[attr-defined]
        found = space_problems(live, space, self._shared.values.size())  # type: ignore[union-attr]
        return tuple(f"value file: {p}" for p in found)

    def mend(self) -> None:
        """Rewrite the value file's space from its live values (what :meth:`check`
        found wrong there: never again free under a value, leaked pages free again)."""
        if not self.has_value_file:
            return

        def rewrite(view: Any) -> None:  # this backend's own view
            live, _ = view.value_file_space()
            view.rewrite_space(space_of(live, view.txn_id))

        self.transact(rewrite)

    def close(self) -> None:
        shared, self._shared = getattr(self, "_shared", None), None
        if shared is not None:
            shared.release()


def open_lmdb_backend(location: str, url: str, options: dict[str, Any]) -> LMDBBackend:
    """The ``lmdb`` URL scheme: ``location`` is the store directory."""
    if not location:
        raise StoreConfigError(
            f"[open_store] {url!r} names no directory. Use lmdb:///absolute/path or "
            f"lmdb:relative/path.",
            url=url,
        )
    return LMDBBackend(location, url=url, **options)
