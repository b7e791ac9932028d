"""The prefix-store contracts: the backend protocol and the :class:`PrefixStore` ABC.

Two layers, so that a storage engine is a small thing to add:

* :class:`Backend` is an ordered byte-key/byte-value store with atomic
  read-modify-write transactions. LMDB (:mod:`kvstore.store.engines.lmdb`) and memory
  (:mod:`kvstore.store.engines.memory`) and Redis/Valkey (:mod:`kvstore.store.engines.redis`)
  implement it.
* :class:`PrefixStore` is what callers use: chained block keys, token-exact
  lookup, save bookkeeping, zero-copy reads, eviction, stats and integrity.
  One implementation (:class:`kvstore.store.blocks.prefix.BlockPrefixStore`) runs
  over any backend. A block's record is opaque bytes here; the codecs decide
  what is in it.

Contract for backend implementers:

* Keys are ``bytes`` under ``kvstore/v1/`` (layout in :mod:`kvstore.store.keys`);
  values are opaque ``bytes``. Nothing read from a backend is ever unpickled.
* :meth:`Backend.reader` yields a :class:`ReadView`. Values it returns may be
  ``memoryview`` objects into the engine's pages (LMDB); they are valid only
  inside the ``with`` block, so callers copy what they keep. A value the
  engine cannot hand out safely (its stored length runs past its pages: a
  damaged file) is returned empty; no kvstore value is empty, so every reader
  counts it as damage. ``check()`` reports damage in the engine's own
  structures, which ``verify`` lists as ``engine``.
* :meth:`Backend.transact` runs ``fn(WriteView)`` atomically: every put and
  delete it made commits together, or none does. ``fn`` may run more than
  once (LMDB grows its map and retries; Redis retries on a ``WATCH``
  conflict), so it must have no effect outside the view.
* ``scan`` is ordered by key bytes and never called with an empty prefix;
  a backend without ordered keys keeps a sorted index of its keys
  (a Redis ``ZSET`` and ``ZRANGEBYLEX`` serve). ``keys`` lists keys
  without reading values (records can be large and remote).
* A backend whose server may drop record values by itself (Redis
  ``maxmemory`` eviction, TTLs) may return ``None`` from ``get`` for a key
  that ``contains`` still reports; the store counts that read as a miss
  ``evicted_by_server`` and removes the block from its index.
* A backend where every read is a network round trip says so with
  ``supports_pipelining`` and overrides ``get_many``/``view_many``/
  ``contains_many`` to batch; the store then asks for a lookup's whole chain
  and a restore's blocks in one call each.
* Engine exceptions are translated to :mod:`kvstore.errors` at the boundary
  with one context manager (:func:`kvstore.store.engines.boundary.translate_errors`);
  a full map, disk or quota is :class:`~kvstore.errors.StoreFullError` and
  leaves the store as it was.
* Capabilities are boolean properties; a method whose capability is off
  raises :class:`~kvstore.errors.CapabilityError` before doing anything.
* ``stats()`` includes ``"entries"`` (keys stored): a store refuses to adopt
  a non-empty location that has no ``kvstore/v1/__meta__`` record.
* Conformance: ``tests/test_store/conftest.py`` parametrises the store
  suite (``test_prefix``, ``test_eviction``, ``test_integrity``...) over
  memory, LMDB, a real Redis, a real Redis Cluster and a tiered store, and
  ``test_backends.py`` runs this contract on every backend; a new backend
  adds its kind there.

Compatibility: the key layout carries a schema version (``kvstore/v1``); a
change to it takes a new version, never a new meaning for ``v1`` keys.
"""

from __future__ import annotations

import builtins
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from kvstore.abc.placement import Placement
from kvstore.errors import CapabilityError, ReadOnlyStoreError, StoreConfigError, StoreError

__all__ = [
    "StoreSettings",
    "Buffer",
    "ReadView",
    "WriteView",
    "PlacingView",
    "Backend",
    "MissReason",
    "BlockSpan",
    "BlockRef",
    "Match",
    "SaveResult",
    "NamespaceStats",
    "StoreStats",
    "VerifyReport",
    "RecordEncoder",
    "PendingRecord",
    "RecordVerifier",
    "BlockSave",
    "SaveHandle",
    "CheckingViews",
    "Claim",
    "DURABILITY_MODES",
    "PrefixStore",
]

T = TypeVar("T")

#: A value as a backend hands it out: ``bytes``, or a ``memoryview`` into its pages.
Buffer = bytes | memoryview


class ReadView(Protocol):
    """One consistent read of a backend (an LMDB read transaction)."""

    def get(self, key: bytes) -> Buffer | None:
        """The value of ``key`` (valid only while the view is open), or ``None``."""

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is stored, without touching its value."""

    def scan(
        self, prefix: bytes, *, start: bytes | None = None, reverse: bool = False
    ) -> Iterator[tuple[bytes, Buffer]]:
        """``(key, value)`` for keys starting with ``prefix``, in key order.

        Forward: keys ``>= start`` (all of them when ``start`` is ``None``),
        ascending. Reverse: keys ``< start`` (all when ``None``), descending.
        """

    def keys(self, prefix: bytes) -> Iterator[bytes]:
        """Keys starting with ``prefix``, ascending, without reading their values."""


class WriteView(ReadView, Protocol):
    """A read view that also writes; everything commits together or not at all."""

    def put(self, key: bytes, value: Any, *, if_absent: bool = False) -> bool:
        """Store ``value`` (any C-contiguous buffer); ``False`` if ``if_absent`` and present."""

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; ``False`` if it was not stored."""


class PlacingView(WriteView, Protocol):
    """The write view of a backend that :attr:`~Backend.supports_placement`."""

    def place(self, key: bytes, record: PendingRecord) -> None:
        """``record``, still being written, will be put under ``key`` in this
        transaction: start writing it where it will lie (:mod:`~kvstore.abc.placement`).
        A view may decline a record (it is then written whole at ``put``)."""


class Backend(ABC):
    """An ordered key/value engine under a prefix store (see the module docstring)."""

    #: The URL the backend was opened from (``lmdb:///var/kv``).
    url: str = ""

    # Capabilities. Where a default could be wrong, it is the value that only
    # turns off a fast path or a feature, never one that promises too much.
    @property
    def supports_zero_copy(self) -> bool:
        """Read views hand out memoryviews into the engine's own memory."""
        return False

    @property
    def supports_ttl(self) -> bool:
        """Keys can expire on their own (:meth:`set_ttl`)."""
        return False

    @property
    def supports_multiprocess(self) -> bool:
        """Several processes may open the same store at once."""
        return False

    @property
    def supports_persistence(self) -> bool:
        """What is committed survives the process (and a SIGKILL of it)."""
        return False

    @property
    def supports_writes(self) -> bool:
        """False when opened read-only: every write raises ReadOnlyStoreError."""
        return True

    @property
    def supports_pipelining(self) -> bool:
        """Reads are round trips to a server: batch them (``contains_many``, ``view_many``)."""
        return False

    @property
    def supports_placement(self) -> bool:
        """Write views are :class:`PlacingView` s: they take a record still being written
        and write its parts where it will lie as they come; elsewhere records are put
        whole."""
        return False

    @property
    def supports_value_file(self) -> bool:
        """Large values can be written once into a file beside the index (a store's
        ``values="file"`` setting: :meth:`write_values_to`)."""
        return False

    @property
    def has_value_file(self) -> bool:
        """A value file exists beside the index (some values may be in it)."""
        return False

    def give_back_space(self) -> int:
        """Give the filesystem the room freed values leave at the end of this engine's
        files, where no read can still see them: the bytes given back (0: none, or an
        engine that keeps no such room). A write gives it back by itself; maintenance
        (``kvstore gc``, ``kvstore delete``) calls this after freeing, so that the disk
        space comes back at once."""
        return 0

    def write_values_to(self, where: str) -> None:
        """Where this backend's writes put large values from now on: ``"inline"`` or
        ``"file"`` (only where :attr:`supports_value_file`). Reads find either kind."""
        if where != "inline":
            raise StoreConfigError(
                f"[open_store] values={where!r} needs a backend that keeps a value file "
                f"(LMDB); {self.url} keeps every value inline. Omit values.",
                setting="values",
                found=where,
            )

    @abstractmethod
    def reader(self) -> AbstractContextManager[ReadView]:
        """A consistent read view; its values are valid only inside the ``with``."""

    @abstractmethod
    def _transact(self, fn: Callable[[WriteView], T], size_hint: int) -> T:
        """Engine part of :meth:`transact` (writability already checked)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Engine figures (entries, bytes on disk, map size...), JSON-able."""

    @abstractmethod
    def close(self) -> None:
        """Release the engine; idempotent."""

    def transact(self, fn: Callable[[WriteView], T], *, size_hint: int = 0) -> T:
        """Run ``fn`` in one atomic read-modify-write transaction and return its result.

        Args:
            fn: does reads and writes on the view; may be called more than once.
            size_hint: bytes ``fn`` is about to write (lets LMDB grow its map once).

        Raises:
            ReadOnlyStoreError: the backend was opened read-only.
            StoreFullError: the map, disk or quota cannot hold the writes;
                nothing was written.
        """
        self.require_writes("transact")
        return self._transact(fn, size_hint)

    # Conveniences built on the two primitives; engines may override them
    # with faster paths (pipelines, multi-gets).
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Owned copies of the values of ``keys`` (``None`` where absent)."""
        with self.reader() as view:
            return [None if (v := view.get(k)) is None else bytes(v) for k in keys]

    @contextmanager
    def view_many(self, keys: Sequence[bytes]) -> Iterator[list[Buffer | None]]:
        """Zero-copy values of ``keys``, valid only inside the ``with`` block."""
        with self.reader() as view:
            yield [view.get(k) for k in keys]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self.reader() as view:
            return [view.contains(k) for k in keys]

    def scan(self, prefix: bytes, *, keys_only: bool = False) -> list[tuple[bytes, bytes | None]]:
        """Owned ``(key, value)`` pairs under ``prefix`` (value ``None`` if ``keys_only``)."""
        with self.reader() as view:
            return [(bytes(k), None if keys_only else bytes(v)) for k, v in view.scan(prefix)]

    def put_many(self, items: Iterable[tuple[bytes, Any]], *, if_absent: bool = False) -> int:
        """Store every item atomically (all or nothing); returns how many were written.

        With ``if_absent`` a stored key is left as it is, which makes saving a
        content-addressed block idempotent under concurrent writers.
        """
        items = list(items)
        size = sum(memoryview(v).nbytes for _, v in items)

        def write(txn: WriteView) -> int:
            return sum(txn.put(k, v, if_absent=if_absent) for k, v in items)

        return self.transact(write, size_hint=size)

    def delete_many(self, keys: Iterable[bytes]) -> int:
        """Remove ``keys`` atomically; returns how many were stored."""
        keys = list(keys)
        return self.transact(lambda txn: sum(txn.delete(k) for k in keys))

    def check(self) -> tuple[str, ...]:
        """Damage in the engine's own structures (what ``verify`` reports as ``engine``).

        Empty for an intact engine, and for engines that have nothing to check
        beyond their values (memory, Redis). LMDB reads its file without LMDB
        (:mod:`kvstore.store.engines.lmdb_file`).
        """
        return ()

    def mend(self) -> None:
        """Repair what :meth:`check` found that a transaction can (``verify`` with
        ``repair``); nothing where there is nothing of the engine's own to repair."""
        return None

    def set_ttl(self, keys: Sequence[bytes], seconds: float) -> None:
        """Let ``keys`` expire after ``seconds``."""
        self.require("supports_ttl", "set_ttl")
        raise NotImplementedError  # an engine that supports TTLs overrides this

    def require(self, capability: str, operation: str) -> None:
        """Raise CapabilityError unless the boolean property ``capability`` is on."""
        if not getattr(self, capability):
            raise CapabilityError(
                f"[{operation}] The {type(self).__name__} backend ({self.url}) does not "
                f"support this ({capability} is False). Use a backend that does, such as "
                f"Redis for TTLs.",
                capability=capability,
                backend=type(self).__name__,
            )

    def require_writes(self, operation: str) -> None:
        if not self.supports_writes:
            raise ReadOnlyStoreError(
                f"[{operation}] The store {self.url} was opened read-only; open it "
                f"without readonly=True to write.",
                url=self.url,
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


@dataclass(frozen=True)
class StoreSettings:
    """What a store was created with, plus its budgets (:mod:`kvstore.store.settings`
    parses, persists and resolves them)."""

    block_size: int = 256
    storage_policy: str = "lossless"
    max_bytes: int | None = None
    namespace_max_bytes: int | None = None
    namespace_budgets: Mapping[str, int] = field(default_factory=dict)
    #: Blocks between the recurrent-state checkpoints a save keeps of a hybrid
    #: model's prompt (issue 16); 0 keeps only the ones its rules name.
    checkpoint_stride: int = 8
    #: Where large values are written: ``"inline"`` (the engine's own pages) or
    #: ``"file"`` (LMDB: once, into a file beside its index,
    #: :mod:`kvstore.store.engines.lmdb_values`). Fixed at creation; a record written
    #: before the setting existed is ``"inline"``.
    values: str = "inline"

    def budget_for(self, namespace: str) -> int | None:
        """The byte budget of ``namespace``: its own, else the per-namespace default."""
        return self.namespace_budgets.get(namespace, self.namespace_max_bytes)


class MissReason:
    """Why a lookup or a read served nothing (keys of ``StoreStats.misses``)."""

    #: No stored block shares a first token with the prompt.
    COLD = "cold"
    #: The prompt has fewer than two tokens: nothing can be reused.
    SHORT_PROMPT = "short_prompt"
    #: A record failed verification; it was dropped and counted, never served.
    CORRUPT = "corrupt"
    #: A record was written by a newer kvstore (FormatVersionError); kept, not served.
    VERSION = "version"
    #: A matched block was evicted or deleted before it was read.
    VANISHED = "vanished"
    #: The backend could not be reached (StoreUnavailableError).
    UNAVAILABLE = "unavailable"
    #: The server dropped a block's record by itself (Redis ``maxmemory`` eviction
    #: or an expired TTL) while the index still listed it; the block is removed.
    SERVER_EVICTED = "evicted_by_server"
    #: A hybrid model's prompt matched stored KV, but no matched block carries the
    #: recurrent layers' checkpoint at its end (issue 16): nothing can be reused.
    NO_CHECKPOINT = "no_checkpoint"

    ALL = (
        COLD,
        SHORT_PROMPT,
        CORRUPT,
        VERSION,
        VANISHED,
        UNAVAILABLE,
        SERVER_EVICTED,
        NO_CHECKPOINT,
    )


@dataclass(frozen=True)
class BlockSpan:
    """A block a save must encode: the tokens ``[start, stop)`` of the prompt.

    ``checkpoint``: the record should carry the recurrent layers' checkpoint at
    ``stop`` (a position the save said it has one for; issue 16).
    """

    index: int
    start: int
    stop: int
    key: bytes
    checkpoint: bool = False

    @property
    def tokens(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class BlockRef:
    """One block a restore reads, and which of its rows it uses.

    Attributes:
        key: the record key (``kvstore/v1/<namespace>/<block hash>``).
        index: position of the block in the chain (block ``i`` starts at ``i * block_size``).
        start: absolute token position of the record's first row.
        rows: rows of the record the match uses (``[0, rows)``); less than
            ``stored_rows`` when the match ends inside the block, which the
            restore trims (every KV family can drop a record's last rows).
        stored_rows: rows the record holds (``block_size``, or fewer for a tail).
    """

    key: bytes
    index: int
    start: int
    rows: int
    stored_rows: int

    @property
    def stop(self) -> int:
        """Absolute token position just after the last row used."""
        return self.start + self.rows

    @property
    def trimmed(self) -> bool:
        return self.rows < self.stored_rows


@dataclass(frozen=True)
class Match:
    """The longest reusable prefix of a prompt, and the blocks to read for it.

    ``tokens`` is the number of prompt tokens whose KV the store can supply,
    ``0 <= tokens <= prompt_tokens - 1``: at least one token is always left
    for the model to process, because its logits are needed. ``blocks`` cover
    ``[0, tokens)`` in order, without gaps.

    A lookup for a hybrid model (``checkpoints=True``, issue 16) reuses only up
    to the end of a block carrying the recurrent layers' checkpoint: then
    ``tokens`` is that position and ``kv_tokens`` the prompt tokens whose KV
    matched (the prefix the prompt shares with stored ones, whether or not a
    checkpoint ends it); otherwise ``kv_tokens`` is ``tokens``.
    """

    namespace: str
    tokens: int
    prompt_tokens: int
    block_size: int
    blocks: tuple[BlockRef, ...] = ()
    kv_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.kv_tokens is None:
            object.__setattr__(self, "kv_tokens", self.tokens)

    @property
    def hit(self) -> bool:
        return self.tokens > 0

    @property
    def kv_matched(self) -> int:
        """Prompt tokens whose KV the store holds (``>= tokens``)."""
        return self.tokens if self.kv_tokens is None else self.kv_tokens

    def covering(self, start: int, stop: int) -> tuple[BlockRef, ...]:
        """The blocks holding any of the tokens ``[start, stop)`` (clipped to the match)."""
        stop = min(stop, self.tokens)
        return tuple(b for b in self.blocks if b.start < stop and b.stop > start)

    def for_window(self, max_size: int, keep: int = 0) -> tuple[BlockRef, ...]:
        """The blocks a sliding-window layer needs: its ``keep`` first tokens and
        the ``max_size - keep`` most recent ones (mlx-lm ``RotatingKVCache`` layout)."""
        recent_from = max(keep, self.tokens - (max_size - keep))
        wanted = {
            b.key for b in (*self.covering(0, keep), *self.covering(recent_from, self.tokens))
        }
        return tuple(b for b in self.blocks if b.key in wanted)

    def truncated(self, tokens: int) -> Match:
        """This match cut back to its first ``tokens`` tokens (the last block trimmed).

        Raises:
            ValueError: ``tokens`` is negative or more than the match holds.
        """
        if not 0 <= tokens <= self.tokens:
            raise ValueError(
                f"[Match.truncated] tokens must be in [0, {self.tokens}]; received {tokens}."
            )
        if tokens == self.tokens:  # nothing to cut (a restore asks first): 16 replaces, ~0.1 ms
            return self
        blocks = tuple(
            replace(b, rows=min(b.rows, tokens - b.start)) for b in self.blocks if b.start < tokens
        )
        return replace(self, tokens=tokens, blocks=blocks)

    def untrimmed(self) -> Match:
        """This match cut back to whole records, for a family that cannot drop rows.

        Only the last block of a match can be trimmed, so at most one block goes.
        """
        blocks = self.blocks[:-1] if self.blocks and self.blocks[-1].trimmed else self.blocks
        return replace(self, tokens=blocks[-1].stop if blocks else 0, blocks=blocks)


@dataclass(frozen=True)
class SaveResult:
    """What one save did. ``written + deduplicated`` blocks make up the prompt."""

    namespace: str
    tokens: int
    written: tuple[bytes, ...] = ()
    written_bytes: int = 0
    deduplicated: int = 0
    superseded: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    #: The stored sibling that already holds the prompt's tail (then no tail was written).
    covered_by: bytes | None = None
    #: Records written with a recurrent checkpoint at their end (issue 16), upgrades
    #: of stored blocks that lacked one included, and their checkpoints' bytes.
    checkpoints: int = 0
    checkpoint_bytes: int = 0
    #: Stored blocks rewritten to add the checkpoint they lacked.
    upgraded: int = 0
    #: Of ``evicted_bytes``, the evicted blocks' checkpoints'.
    evicted_checkpoint_bytes: int = 0


@dataclass(frozen=True)
class NamespaceStats:
    """A namespace's blocks and bytes (checkpoints' included), and of those the
    records carrying a recurrent checkpoint and the checkpoints' own bytes."""

    blocks: int
    bytes: int
    max_bytes: int | None = None
    checkpoints: int = 0
    checkpoint_bytes: int = 0

    @property
    def kv_bytes(self) -> int:
        """Bytes that are not checkpoints: KV rows, headers, padding."""
        return self.bytes - self.checkpoint_bytes


@dataclass(frozen=True)
class StoreStats:
    """Content figures (persisted, exact across processes) and this handle's activity.

    ``blocks``/``bytes``/``namespaces`` are read from counters every write keeps
    in the same transaction, so they are exact and cost no scan. The activity
    counters (lookups, hits, misses by reason, evictions, corruptions, saves)
    count what *this open store* did since it was opened; they are not
    persisted, so that a read never needs a write.
    """

    blocks: int
    bytes: int
    namespaces: Mapping[str, NamespaceStats]
    max_bytes: int | None
    #: Of ``blocks``/``bytes``: records carrying a recurrent checkpoint, and the
    #: checkpoints' bytes (issue 16; persisted and exact like the totals).
    checkpoints: int = 0
    checkpoint_bytes: int = 0
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    misses: Mapping[str, int] = field(default_factory=dict)
    saves: int = 0
    saved_blocks: int = 0
    saved_bytes: int = 0
    deduplicated_blocks: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    #: Of ``evicted_bytes``, recurrent checkpoints' (issue 16).
    evicted_checkpoint_bytes: int = 0
    corruptions: int = 0
    #: Stored bytes by record family, when asked for (``stats(by_family=True)``, a scan).
    by_family: Mapping[str, int] | None = None
    backend: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class VerifyReport:
    """What :meth:`PrefixStore.verify` found (and removed, with ``repair=True``)."""

    blocks: int = 0
    bytes: int = 0
    corrupt: tuple[builtins.bytes, ...] = ()
    newer_format: tuple[builtins.bytes, ...] = ()
    orphans: tuple[builtins.bytes, ...] = ()
    dangling: tuple[builtins.bytes, ...] = ()
    totals_mismatch: tuple[str, ...] = ()
    repaired: bool = False
    #: Damage in the storage engine's own structures (``Backend.check``): an LMDB
    #: B-tree or free list; ``kvstore verify --fix`` rebuilds the file.
    engine: tuple[str, ...] = ()
    #: Damage in the settings record or its copy (repair rewrites both).
    settings: tuple[str, ...] = ()

    @property
    def clean(self) -> bool:
        return not (
            self.corrupt
            or self.orphans
            or self.dangling
            or self.totals_mismatch
            or self.engine
            or self.settings
        )


#: ``encode(spans) -> records``: one bytes-like record (or :class:`PendingRecord`) per
#: span, in order.
RecordEncoder = Callable[[Sequence[BlockSpan]], Sequence[Any]]


class PendingRecord:
    """A record another thread is still writing, which an encoder may return in place of
    its bytes: the commit puts each record as soon as it is written, while the next ones
    are written (a save's checksums overlap its puts), and waits for none before that.

    Args:
        future: resolves to the record (a C-contiguous buffer), or raises the write's error.
        nbytes_bound: the record's length or a little more, known before it is written
            (the store makes room for this many bytes).
        placement: where its writer hands over each part as it is written, for a store
            that writes the record while it is being written (``WriteView.place``);
            ``None``: the record comes whole.
    """

    __slots__ = ("_future", "nbytes_bound", "placement")

    def __init__(
        self, future: Future[Any], nbytes_bound: int, placement: Placement | None = None
    ) -> None:
        self._future = future
        self.nbytes_bound = nbytes_bound
        self.placement = placement

    def result(self) -> Any:
        """The record once written (waits); the write's error if it failed."""
        return self._future.result()


#: ``verify(record)``: returns, or raises CorruptEntryError / FormatVersionError.
RecordVerifier = Callable[[memoryview], None]

#: How a store makes its commits durable (the ``durability`` store option), the
#: default first: ``"group"`` (saves handed off together commit in one synced
#: transaction), ``"sync"`` (every commit synced), ``"os"`` (left to the OS).
DURABILITY_MODES = ("group", "sync", "os")


@dataclass(frozen=True)
class BlockSave:
    """One save of :meth:`PrefixStore.put_blocks_many`: ``put_blocks``'s arguments."""

    namespace: str
    tokens: Any
    encode: RecordEncoder
    family: str = ""
    #: Positions the encoder can give a recurrent checkpoint for (``put_blocks``'s
    #: ``checkpoints``; issue 16).
    checkpoints: frozenset[int] = frozenset()


class SaveHandle(Protocol):
    """A save handed off (:meth:`PrefixStore.save_behind`), committed in the background."""

    namespace: str
    #: Seconds the hand-off held the caller's thread.
    held_s: float
    #: Once done: seconds from the hand-off to its commit's start, and of that commit.
    queued_s: float
    commit_s: float

    def done(self) -> bool:
        """Whether the save is committed (or failed)."""

    def result(self, timeout: float | None = None) -> SaveResult:
        """The save's result once committed; raises its error, or TimeoutError."""

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(handle)`` once the save is done (at once if it is): a server
        counts its saves without a thread waiting on each."""


#: A read's ``claim`` (:meth:`PrefixStore.read_checking`).
Claim = Callable[[Sequence[memoryview]], AbstractContextManager[None]]


class CheckingViews(list[memoryview]):
    """Views of records whose checks may still be running (:meth:`PrefixStore.read_checking`).

    Their headers have been checked by the reader's own parse, their payloads
    maybe not yet: nothing made from them may leave the caller before
    :meth:`intact` says they passed.
    """

    def __init__(self, views: Iterable[memoryview], intact: Callable[[], int]) -> None:
        super().__init__(views)
        self._intact = intact
        self._count: int | None = None

    def intact(self) -> int:
        """How many leading views passed their checks (waits for the checks)."""
        if self._count is None:
            self._count = self._intact()
        return self._count


class PrefixStore(ABC):
    """A persistent, deduplicated store of KV blocks keyed by token prefixes.

    Shared behaviour lives here: the context manager, read-only and closed
    checks. The block logic is in :class:`kvstore.store.blocks.prefix.BlockPrefixStore`;
    a composite of stores (:class:`kvstore.store.blocks.tiered.TieredPrefixStore`)
    uses its parts through these verbs only, and has no backend of its own.
    """

    def __init__(self, backend: Backend | None) -> None:
        self._backend = backend
        self._closed = False

    @property
    def backend(self) -> Backend:
        """The engine under this store (maintenance tools read and write it directly).

        Raises:
            CapabilityError: a composite store, which has no single backend.
        """
        if self._backend is None:
            raise CapabilityError(
                f"[backend] {self!r} is made of other stores and has no single backend; "
                f"open one of its tiers by its own URL for this.",
                capability="backend",
            )
        return self._backend

    @property
    def url(self) -> str:
        return self.backend.url

    @property
    def read_only(self) -> bool:
        return not self.backend.supports_writes

    @property
    @abstractmethod
    def settings(self) -> StoreSettings:
        """The store's settings (block size, storage policy, budgets)."""

    @property
    def block_size(self) -> int:
        return self.settings.block_size

    @abstractmethod
    def lookup(self, namespace: str, tokens: Any, *, checkpoints: bool = False) -> Match:
        """The longest reusable prefix of ``tokens`` (see :class:`Match`); with
        ``checkpoints`` (a hybrid model's caches), the longest that ends where a
        stored block carries a recurrent checkpoint."""

    @abstractmethod
    def put_blocks(
        self,
        namespace: str,
        tokens: Any,
        encode: RecordEncoder,
        *,
        family: str = "",
        checkpoints: Collection[int] = (),
    ) -> SaveResult:
        """Store the blocks of ``tokens`` not stored yet, in one atomic write.

        Args:
            namespace: from :func:`~kvstore.store.namespace_for`.
            tokens: the prompt's token ids (every one has KV to store).
            encode: ``encode(spans)`` returns one bytes-like record per
                :class:`~kvstore.abc.store.BlockSpan` (the missing blocks, in
                order; the last one may be a partial tail). Not called when
                nothing is missing.
            family: a label kept with each new block for ``stats(by_family=True)``.
            checkpoints: positions the caller can give a recurrent checkpoint for
                (issue 16): a block ending at one is encoded with
                ``BlockSpan.checkpoint``, and a stored one whose record lacks a
                checkpoint is encoded again and replaced (an upgrade).

        Raises:
            StoreFullError: the blocks do not fit the budget even after evicting
                every unpinned leaf, or the map/disk is full; nothing was written.
        """

    def put_blocks_many(self, saves: Sequence[BlockSave]) -> list[SaveResult]:
        """:meth:`put_blocks` of each of ``saves``; a store that can commits them in one
        atomic write (one sync: a group commit). If that write fails, nothing of it
        is stored and the error propagates (the caller may retry them one by one)."""
        out = []
        for s in saves:
            # Only a hybrid model's save names checkpoints (a put_blocks may predate them).
            options = {"checkpoints": s.checkpoints} if s.checkpoints else {}
            out.append(self.put_blocks(s.namespace, s.tokens, s.encode, family=s.family, **options))
        return out

    @abstractmethod
    def read(self, blocks: Sequence[BlockRef]) -> AbstractContextManager[list[memoryview]]:
        """Verified zero-copy views of the records of ``blocks`` (valid inside the ``with``)."""

    @contextmanager
    def read_checking(
        self, blocks: Sequence[BlockRef], *, claim: Claim | None = None
    ) -> Iterator[CheckingViews]:
        """:meth:`read`, handing the views out while their checksums are still being
        computed, so the caller's copy of them overlaps the store's hashing (a restore's
        two passes over the same bytes, on different cores). The views are those of
        the leading stored records; ``views.intact()`` waits for the checks and says
        how many of them passed, counting the rest as :meth:`read` would. A store that
        checks as it reads (this default) hands out verified views.

        ``claim(views)``: entered just before the checks start, and left when the read
        ends, before the checks are waited for (a reader that hashes records as it
        copies them claims them here: :class:`kvstore.codecs.copied_sums.Claims`). The
        caller resolves or drops its claims before ``views.intact()``, which waits for
        the checks that wait for them. Not entered by a store whose views are verified
        before they are handed out, nor by one whose ``verify`` takes no digests
        (:func:`kvstore.codecs.copied_sums.takes_digests`)."""
        with self.read(blocks) as views:
            yield CheckingViews(views, lambda: len(views))

    @abstractmethod
    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each block record of ``keys`` is stored, without reading it."""

    @abstractmethod
    def set_budget(self, max_bytes: int | str | None, *, namespace: str | None = None) -> None:
        """Set (``None``: remove) the byte budget of the store or of one namespace,
        persistently; enforced from the next save on (:meth:`evict` enforces it now)."""

    @abstractmethod
    def delete(self, namespace: str, tokens: Any = ()) -> int:
        """Forget every stored block whose prefix extends ``tokens``; returns blocks removed."""

    @abstractmethod
    def evict(self, *, namespace: str | None = None, max_bytes: int | None = None) -> int:
        """Evict least-recently-used leaf blocks; returns bytes freed."""

    @abstractmethod
    def stats(self, *, by_family: bool = False) -> StoreStats:
        """Content and activity figures (see :class:`StoreStats`)."""

    @abstractmethod
    def verify(self, *, repair: bool = False) -> VerifyReport:
        """Check every record and the index; with ``repair``, remove what is bad."""

    @abstractmethod
    def flush(self) -> None:
        """Wait until every save handed off (:meth:`save_behind`) is committed, and write
        batched recency updates now (they are otherwise written in the background)."""

    # KV caches in and out, built on lookup/put_blocks/read by the codecs below the
    # store (:class:`kvstore.store.kv.CacheMethods` gives every store both).
    @abstractmethod
    def save(
        self,
        namespace: str,
        tokens: Any,
        caches: Sequence[Any],
        *,
        captured: Mapping[tuple[int, int], Any] | None = None,
    ) -> SaveResult:
        """Store the KV the live ``caches`` hold for ``tokens``: one record per block
        (every layer in it), only the blocks not stored yet, in one atomic write.

        ``captured`` maps ``(layer, block start)`` to a snapshot of a whole block
        taken while a sliding window still held it.
        """

    @abstractmethod
    def save_behind(
        self,
        namespace: str,
        tokens: Any,
        caches: Sequence[Any],
        *,
        captured: Mapping[tuple[int, int], Any] | None = None,
    ) -> SaveHandle:
        """:meth:`save`, handed off: copy the new rows out of ``caches`` (the one copy
        the caller cannot avoid), return, and commit in the background under the
        store's ``durability``. :meth:`flush` (and ``close``) wait for it; a
        :meth:`lookup` that could reuse its rows does too, so the process reads its writes.
        """

    @abstractmethod
    def restore(self, match: Match, caches: Sequence[Any]) -> list[Any]:
        """Live caches holding the KV of ``match``, in the families of ``caches``
        (fresh templates: ``model.make_cache(policy)``).

        The result may hold fewer tokens than ``match`` (a block vanished, or a
        layer's rows were never stored): read ``offset`` of any returned cache.
        """

    def activity(self) -> dict[str, Any]:
        """This handle's activity counters (``lookups``, ``misses``...), read from memory.

        The part of :meth:`stats` that needs no read of the backend; empty
        for a store that keeps none.
        """
        return {}

    def touch(self, keys: Sequence[bytes]) -> None:
        """Count a use of the blocks ``keys`` for recency (batched, like a lookup's).

        A tiered store calls it on the tiers a hit did not need to ask, so their
        eviction still sees what is in use. Blocks not stored are ignored.
        """
        return None  # a store without recency has nothing to record

    def close(self) -> None:
        """Flush and release the backend; idempotent."""
        if self._closed:
            return
        try:
            if not self.read_only:
                self.flush()
        finally:
            self._closed = True
            self.backend.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self, operation: str) -> None:
        if self._closed:
            raise StoreError(
                f"[{operation}] The store {self.url} is closed; open it again with open_store().",
                url=self.url,
            )

    def _check_writable(self, operation: str) -> None:
        self._check_open(operation)
        if self.read_only:
            raise ReadOnlyStoreError(
                f"[{operation}] The store {self.url} was opened read-only; open it "
                f"without readonly=True to write.",
                url=self.url,
            )

    def __enter__(self) -> PrefixStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, block_size={self.block_size})"
