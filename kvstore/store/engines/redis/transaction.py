"""One optimistic read-modify-write transaction (``WATCH`` / ``MULTI`` / ``EXEC``).

The view reads through a raw connection to the metadata node, ``WATCH``-ing
every metadata key it reads (and the key index when it scans), and buffers
every write; reads see the transaction's own writes. :meth:`commit` then:

1. writes the payload chunks of new records under fresh keys, with a
   *pending* expiry (an hour), so chunks of a writer that dies before its
   commit clean themselves up;
2. commits every metadata write -- manifests, index entries, totals, the
   key index -- in one ``MULTI``/``EXEC`` on the metadata slot, which fails
   as a whole if a watched key changed (the caller then runs ``fn`` again);
3. after the commit, makes the new chunks permanent (or gives them the
   store's TTL) and deletes the chunks of records it replaced or deleted.

So a reader sees a record only once its manifest is committed, which is
after every chunk was written: never a half-written record. Chunks written
by an attempt that lost a conflict are reused by the next attempt when it
writes the same value, and deleted when the transaction ends without them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from redis import exceptions as rx

from kvstore.abc.store import Buffer
from kvstore.store.engines.redis.client import Command, Connector
from kvstore.store.engines.redis.layout import Layout, Manifest

__all__ = ["RedisTransaction", "ChunkMemo", "lex_range", "lex_pages", "PENDING_TTL_MS"]

#: Expiry of chunks written before their commit (milliseconds).
PENDING_TTL_MS = 3_600_000
_DELETED = object()
# Values smaller than this are copied on put; larger ones are kept as views (zero-copy).
_COPY_BELOW = 1 << 16


def lex_range(prefix: bytes, start: bytes | None, reverse: bool) -> tuple[bytes, bytes]:
    """``ZRANGEBYLEX`` bounds ``(min, max)`` of the keys a ``scan`` covers."""
    stripped = prefix.rstrip(b"\xff")
    hi = b"(" + stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else b"+"
    if not reverse:
        return b"[" + (max(prefix, start) if start is not None else prefix), hi
    if start is not None and (hi == b"+" or b"(" + start < hi):
        hi = b"(" + start
    return b"[" + prefix, hi


def lex_pages(
    query: Callable[[bytes, bytes, int], list[bytes]],
    prefix: bytes,
    start: bytes | None,
    reverse: bool,
) -> Iterator[list[bytes]]:
    """Pages of the keys a ``scan`` covers, in scan order, a query per page.

    ``query(min, max, count)`` runs ``ZRANGEBYLEX`` (``ZREVRANGEBYLEX`` when
    ``reverse``) with ``LIMIT 0 count``; pages grow from 8 to 512 keys, so a
    scan the caller leaves after one key costs one small round trip.
    """
    lo, hi = lex_range(prefix, start, reverse)
    page = 8
    while True:
        keys = query(lo, hi, page)
        if keys:
            yield keys
        if len(keys) < page:
            return
        if reverse:
            hi = b"(" + keys[-1]
        else:
            lo = b"(" + keys[-1]
        page = min(4 * page, 512)


class ChunkMemo:
    """Manifests of the records one ``transact`` call wrote chunks for, across its attempts."""

    def __init__(self) -> None:
        self._by_key: dict[bytes, tuple[Any, Manifest]] = {}

    def manifest(
        self, key: bytes, value: Any, nbytes: int, chunk_size: int
    ) -> tuple[Manifest, bool]:
        """The manifest for ``value`` under ``key``, and whether its chunks must be written."""
        known = self._by_key.get(key)
        if known is not None and known[0] is value:
            return known[1], False
        manifest = Manifest.new(nbytes, chunk_size)
        self._by_key[key] = (value, manifest)  # holding value keeps its identity unique
        return manifest, True

    def unused(self, committed: dict[bytes, Manifest]) -> list[tuple[bytes, Manifest]]:
        """Chunks written by attempts whose manifest was not committed."""
        return [(key, m) for key, (_, m) in self._by_key.items() if committed.get(key) is not m]


class TransactionHost(Protocol):
    """What a transaction uses of its backend (:class:`.backend.RedisBackend`)."""

    layout: Layout
    chunk_size: int
    connector: Connector

    def resolve(self, keys: Sequence[bytes], raws: Sequence[bytes | None]) -> list[Any]: ...

    def settle_chunk(self, chunk: bytes) -> Command: ...

    def manifest(self, key: bytes, raw: bytes) -> Manifest | None: ...


class RedisTransaction:
    """The :class:`~kvstore.abc.store.WriteView` of one attempt (see the module docstring)."""

    def __init__(self, backend: TransactionHost, conn: Any, memo: ChunkMemo) -> None:
        self._b = backend
        self._layout = backend.layout
        self._conn = conn
        self._memo = memo
        self._writes: dict[bytes, Any] = {}
        self._seen: dict[bytes, bytes | None] = {}  # raw metadata values read (and watched)
        self._index_watched = False
        #: Manifests this attempt committed (valid after a successful commit).
        self.committed: dict[bytes, Manifest] = {}

    # ------------------------------------------------------------------ reads

    def _call(self, commands: Sequence[Command]) -> list[Any]:
        replies = self._b.connector.call(self._conn, commands)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    def _load(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Raw metadata values of ``keys`` (manifests for records), watched and cached."""
        todo = [k for k in dict.fromkeys(keys) if k not in self._seen]
        if todo:
            phys = [self._layout.meta(k) for k in todo]
            _, values = self._call([("WATCH", *phys), ("MGET", *phys)])
            self._seen.update(zip(todo, values))
        return [self._seen[k] for k in keys]

    def _resolve(self, keys: Sequence[bytes], raws: Sequence[bytes | None]) -> list[Buffer | None]:
        return self._b.resolve(keys, raws)

    def get(self, key: bytes) -> Buffer | None:
        if key in self._writes:
            value = self._writes[key]
            return None if value is _DELETED else value
        return self._resolve([key], self._load([key]))[0]

    def contains(self, key: bytes) -> bool:
        if key in self._writes:
            return self._writes[key] is not _DELETED
        return self._load([key])[0] is not None

    def _server_keys(
        self, prefix: bytes, start: bytes | None, reverse: bool
    ) -> Iterator[list[bytes]]:
        """Pages of stored keys in scan order (the key index is watched)."""
        if not self._index_watched:
            self._call([("WATCH", self._layout.index)])
            self._index_watched = True
        index = self._layout.index

        def query(lo: bytes, hi: bytes, count: int) -> list[bytes]:
            if reverse:
                return self._call([("ZREVRANGEBYLEX", index, hi, lo, "LIMIT", 0, count)])[0]
            return self._call([("ZRANGEBYLEX", index, lo, hi, "LIMIT", 0, count)])[0]

        return lex_pages(query, prefix, start, reverse)

    def _merged(
        self, prefix: bytes, start: bytes | None, reverse: bool, with_values: bool
    ) -> Iterator[tuple[bytes, Any]]:
        """Stored keys merged with this transaction's writes, in scan order."""
        lo, hi = lex_range(prefix, start, reverse)
        mine = sorted(
            (k for k in self._writes if k.startswith(prefix) and _within(k, lo, hi)),
            reverse=reverse,
        )
        at = 0
        for keys in self._server_keys(prefix, start, reverse):
            theirs = [k for k in keys if k not in self._writes]
            values: Sequence[Any] = (
                self._resolve(theirs, self._load(theirs)) if with_values else theirs
            )
            for key, value in zip(theirs, values):
                while at < len(mine) and (mine[at] > key if reverse else mine[at] < key):
                    yield from self._own(mine[at])
                    at += 1
                if value is not None:
                    yield key, value
        for key in mine[at:]:
            yield from self._own(key)

    def _own(self, key: bytes) -> Iterator[tuple[bytes, Any]]:
        value = self._writes[key]
        if value is not _DELETED:
            yield key, value

    def scan(
        self, prefix: bytes, *, start: bytes | None = None, reverse: bool = False
    ) -> Iterator[tuple[bytes, Buffer]]:
        yield from self._merged(prefix, start, reverse, with_values=True)

    def keys(self, prefix: bytes) -> Iterator[bytes]:
        for key, _ in self._merged(prefix, None, False, with_values=False):
            yield key

    # ------------------------------------------------------------------ writes

    def put(self, key: bytes, value: Any, *, if_absent: bool = False) -> bool:
        view = memoryview(value)  # TypeError for what is not a buffer, before anything
        if not view.c_contiguous:
            raise TypeError("a value must be a C-contiguous buffer")
        if if_absent and self.contains(key):
            return False
        if self._layout.is_record(key):
            self._load([key])  # watch the manifest this write replaces
        if isinstance(value, bytes):
            self._writes[key] = value
        elif view.nbytes < _COPY_BELOW:
            self._writes[key] = view.tobytes()
        else:
            self._writes[key] = view.cast("B")  # the caller's buffer, sent without a copy
        return True

    def delete(self, key: bytes) -> bool:
        existed = self.contains(key)
        if existed:
            self._writes[key] = _DELETED
        return existed

    # ------------------------------------------------------------------ commit

    def watch_broken(self) -> bool:
        """Whether a watched key changed (an empty ``MULTI``/``EXEC`` fails then)."""
        return self._call([("MULTI",), ("EXEC",)])[1] is None

    def release(self) -> None:
        """End the attempt without writing (drops the watches)."""
        self._call([("UNWATCH",)])

    def commit(self) -> bool:
        """Write everything (module docstring); False when a watched key changed."""
        if not self._writes:
            self.release()
            return True
        layout, b = self._layout, self._b
        new: dict[bytes, Manifest] = {}
        chunk_writes: list[Command] = []
        for key, value in self._writes.items():
            if value is _DELETED or not layout.is_record(key):
                continue
            size = memoryview(value).nbytes
            manifest, fresh = self._memo.manifest(key, value, size, b.chunk_size)
            new[key] = manifest
            if fresh:
                view = memoryview(value)
                for i in range(manifest.chunks):
                    piece = view[i * b.chunk_size : (i + 1) * b.chunk_size]
                    chunk_writes.append(
                        ("SET", layout.chunk(key, manifest, i), piece, "PX", PENDING_TTL_MS)
                    )
        b.connector.batch(chunk_writes)

        multi: list[Command] = [("MULTI",)]
        added: list[Any] = []
        removed: list[bytes] = []
        for key, value in self._writes.items():
            phys = layout.meta(key)
            if value is _DELETED:
                multi.append(("DEL", phys))
                removed.append(key)
            else:
                multi.append(("SET", phys, new[key].encode() if key in new else value))
                added += [0, key]
        if added:
            multi.append(("ZADD", layout.index, *added))
        if removed:
            multi.append(("ZREM", layout.index, *removed))
        multi.append(("EXEC",))
        replies = self._b.connector.call(self._conn, multi)
        for reply in replies:  # a command refused while queued (OOM...) aborts the EXEC
            if isinstance(reply, Exception):
                raise reply
        if replies[-1] is None:
            return False
        self.committed = new
        self._settle(new)
        return True

    def _settle(self, new: dict[bytes, Manifest]) -> None:
        """After the commit: new chunks made permanent, replaced chunks deleted.

        Best effort: the commit stands either way. A chunk left pending expires
        within the hour and its block is then a miss ``evicted_by_server``;
        a replaced chunk left behind is garbage with no expiry, which only
        costs memory (``verify`` does not see it).
        """
        b, layout = self._b, self._layout
        after: list[Command] = []
        for key, manifest in new.items():
            for chunk in layout.chunks(key, manifest):
                after.append(b.settle_chunk(chunk))
        for key, raw in self._seen.items():
            if raw is not None and key in self._writes and layout.is_record(key):
                old = b.manifest(key, raw)
                if old is not None:
                    after += [("DEL", chunk) for chunk in layout.chunks(key, old)]
        try:
            b.connector.batch(after)
        except rx.RedisError:
            pass  # see the docstring: the commit is what counts


def _within(key: bytes, lo: bytes, hi: bytes) -> bool:
    """Whether ``key`` lies in the ``ZRANGEBYLEX`` range ``[lo, hi]`` (``[x``/``(x``/``+``)."""
    low = lo[1:]
    if key < low or (lo[:1] == b"(" and key == low):
        return False
    if hi == b"+":
        return True
    return key < hi[1:] or (hi[:1] == b"[" and key == hi[1:])
