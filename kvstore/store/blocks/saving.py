"""Saving a prompt's blocks: which are missing, encoding them, and the commit.

A save hashes the prompt into :class:`Span` blocks (full blocks, then the
partial *tail*), asks which are stored (:func:`survey`), encodes only the
missing ones outside the write lock (:func:`encode_missing`), and commits them
in one transaction (:func:`commit_blocks`): records, index entries and last
uses, stored tails the new blocks extend removed (*superseded*), totals
adjusted. A block another process evicted between the survey and the commit
makes the commit raise :class:`Stale`; the caller encodes it too and retries.

Checkpoints (issue 16): a save may name positions it can give a recurrent
checkpoint for. A block ending at one is encoded with ``BlockSpan.checkpoint``;
a stored block ending at one whose record lacks a checkpoint is *upgraded* --
encoded again with it and its record and index entry replaced in the same
commit (:func:`upgradable`). How many of a record's bytes are its checkpoint
is the record's to say (``describe``, kvstore's records by their header); the
index entry keeps it, and the totals count it apart.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np

from kvstore.abc.store import (
    BlockSave,
    BlockSpan,
    PendingRecord,
    PlacingView,
    ReadView,
    RecordEncoder,
    SaveResult,
    WriteView,
)
from kvstore.errors import CorruptEntryError, FormatVersionError, StoreConfigError
from kvstore.store import keys as K
from kvstore.store.blocks.eviction import Block
from kvstore.store.blocks.housekeeping import Housekeeper, touch_in
from kvstore.store.blocks.index import (
    IndexEntry,
    best_child,
    decode_entry,
    encode_entry,
    encode_use,
    iter_entries,
)
from kvstore.store.blocks.removal import delete_block
from kvstore.store.blocks.stats import Counters, add_totals

__all__ = [
    "Describe",
    "Span",
    "SaveOutcome",
    "Stale",
    "spans_of",
    "survey",
    "encode_missing",
    "commit_blocks",
    "record_nbytes",
    "record_nbytes_bound",
]

#: ``make_room(txn, incoming bytes, pinned record keys) -> evicted blocks``.
MakeRoom = Callable[[WriteView, int, set[bytes]], list[Block]]
#: ``describe(record) -> bytes of it that are a recurrent checkpoint`` (0: none).
Describe = Callable[[Any], int]


class Stale(Exception):
    """A block seen stored before the write transaction is gone inside it: encode it too."""


@dataclass(frozen=True)
class Span:
    """A block of the prompt being saved."""

    index: int
    start: int
    tokens: np.ndarray
    digest: bytes
    parent: bytes
    full: bool


@dataclass(frozen=True)
class SaveOutcome:
    written: tuple[bytes, ...]
    written_bytes: int
    deduplicated: int
    superseded: int
    evicted: tuple[Block, ...]
    covered_by: bytes | None
    checkpoints: int = 0
    checkpoint_bytes: int = 0
    upgraded: int = 0


def spans_of(
    ns: bytes, toks: np.ndarray, block_size: int, digests: list[bytes] | None = None
) -> list[Span]:
    """The prompt's full blocks, then its partial tail (if any); ``digests``: their
    :func:`block_digests`, where the caller has them already."""
    if digests is None:
        digests = block_digests(ns, toks, block_size)
    parents, full, size = [K.ROOT, *digests], len(toks) // block_size, block_size
    return [
        Span(i, i * size, toks[i * size : (i + 1) * size], d, parents[i], i < full)
        for i, d in enumerate(digests)
    ]


def block_digests(ns: bytes, toks: np.ndarray, block_size: int) -> list[bytes]:
    """The digest of each block of the prompt: its full blocks, then its tail (if any)."""
    digests = K.chain_digests(ns, toks, block_size)
    start = len(digests) * block_size
    if start < len(toks):
        digests.append(K.block_digest(digests[-1] if digests else K.ROOT, ns, toks[start:].data))
    return digests


def survey(
    view: ReadView, ns: bytes, spans: list[Span]
) -> tuple[list[bytes], bytes | None, list[Span]]:
    """(record keys already serving the prompt, the tail's covering sibling, spans missing)."""
    existing: list[bytes] = []
    cover: bytes | None = None
    missing: list[Span] = []
    for span in spans:
        key = K.record_key(ns, span.digest)
        if view.contains(key):
            existing.append(key)
        elif not span.full and (cover := _covering(view, ns, span)) is not None:
            existing.append(cover)
        else:
            missing.append(span)
    return existing, cover, missing


def stored_already(
    reader: Callable[[], AbstractContextManager[ReadView]], ns: bytes, digests: list[bytes]
) -> list[bytes] | None:
    """The record key of every block (``digests``: :func:`block_digests`) where each is
    stored as its own record (a re-save of a stored prompt), else ``None``: what
    :func:`survey` finds then, from one read, without the spans, jobs and encoder of the
    whole path (P3's re-save is mostly such work in cold caches)."""
    keys = [K.record_key(ns, digest) for digest in digests]
    with reader() as view:
        contains = view.contains
        return keys if keys and all(contains(key) for key in keys) else None


def deduplicated(
    house: Housekeeper | None,
    counters: Counters,
    namespace: str,
    tokens: int,
    existing: list[bytes],
    cover: bytes | None,
    now: float,
) -> SaveResult:
    """The result of a save whose blocks are all stored: their recency batched (``house``),
    the save counted."""
    if house is not None:
        house.touch(existing, now)
    counters.add(saves=1, deduplicated_blocks=len(existing))
    return SaveResult(namespace, tokens, deduplicated=len(existing), covered_by=cover)


def counted(counters: Counters, job: SaveJob, out: SaveOutcome) -> SaveResult:
    """The result of ``job``'s commit, counted."""
    result = result_of(job, out)
    counters.add(
        saves=1,
        saved_blocks=len(out.written),
        saved_bytes=out.written_bytes,
        deduplicated_blocks=out.deduplicated,
        evictions=len(out.evicted),
        evicted_bytes=result.evicted_bytes,
        evicted_checkpoint_bytes=result.evicted_checkpoint_bytes,
    )
    return result


def _entry_of(view: ReadView, ns: bytes, span: Span) -> tuple[bytes, IndexEntry] | None:
    """The index key and entry of a stored span (``None`` if absent or unreadable)."""
    key = K.child_key(ns, span.parent, span.tokens, span.digest, span.full)
    raw = view.get(key)
    if raw is None:
        return None
    try:
        return key, decode_entry(raw)
    except (CorruptEntryError, FormatVersionError):
        return None


def upgradable(
    view: ReadView, ns: bytes, spans: list[Span], checkpoints: Collection[int]
) -> list[Span]:
    """Stored spans ending at one of ``checkpoints`` whose record carries none."""
    if not checkpoints:
        return []
    out = []
    for span in spans:
        if span.start + len(span.tokens) not in checkpoints:
            continue
        found = _entry_of(view, ns, span)
        if found is not None and not found[1].checkpointed:
            out.append(span)
    return out


def _covering(view: ReadView, ns: bytes, span: Span) -> bytes | None:
    """The record key of a stored sibling whose tokens start with the tail's, if any."""
    dirs = (K.children_dir(ns, span.parent), K.tails_dir(ns, span.parent))
    found = best_child(view, dirs, span.tokens)
    if found is None or found[0] != len(span.tokens):
        return None
    return K.record_key(ns, found[2].digest)


def encode_missing(
    ns: bytes,
    spans: list[Span],
    encoded: dict[int, Any],
    encode: RecordEncoder,
    checkpoints: Collection[int] = (),
) -> None:
    """Encode ``spans`` (outside the write lock) into ``encoded``, checking what comes back."""
    if not spans:
        return
    records = list(
        encode(
            [
                BlockSpan(
                    s.index,
                    s.start,
                    s.start + len(s.tokens),
                    K.record_key(ns, s.digest),
                    s.start + len(s.tokens) in checkpoints,
                )
                for s in spans
            ]
        )
    )
    if len(records) != len(spans):
        raise StoreConfigError(
            f"[save] encode() must return one record per span: {len(spans)} spans, "
            f"{len(records)} records.",
            found=len(records),
            expected=len(spans),
        )
    for span, record in zip(spans, records, strict=True):
        if not isinstance(record, PendingRecord):  # a pending one: checked once written
            record_nbytes(record)  # rejects what is not a contiguous buffer, before the write
        encoded[span.index] = record


def commit_blocks(
    txn: WriteView,
    *,
    ns: bytes,
    spans: list[Span],
    encoded: dict[int, Any],
    now: float,
    family: str,
    make_room: MakeRoom,
    checkpoints: Collection[int] = (),
    describe: Describe | None = None,
    placing: bool = False,
) -> SaveOutcome:
    """Write the prompt's missing blocks, and upgrade the stored ones that lack a
    checkpoint at one of ``checkpoints``, in ``txn`` (see the module docstring).
    ``placing``: the backend :attr:`~kvstore.abc.store.Backend.supports_placement`:
    records still being written are placed first, written as they come.

    Raises:
        Stale: a block the caller did not encode is missing now.
        StoreFullError: from ``make_room``.
    """
    existing, covered_by, new = survey(txn, ns, spans)
    if any(span.index not in encoded for span in new):
        raise Stale
    # Upgrades the caller encoded whose record does carry a checkpoint (else the
    # stored record stays: rewriting it would gain nothing).
    measure = describe or (lambda record: 0)
    upgrades = []
    fresh = {s.index for s in new}
    for span in upgradable(txn, ns, [s for s in spans if s.index not in fresh], checkpoints):
        if span.index in encoded and measure(_written(encoded, span.index)) > 0:
            found = _entry_of(txn, ns, span)
            assert found is not None
            upgrades.append((span, *found))
    superseded = _superseded(txn, ns, new)
    grown = sum(record_nbytes(encoded[s.index]) - e.nbytes for s, _, e in upgrades)
    freed = sum(e.nbytes for _, e in superseded)
    pinned = {*existing, *(K.record_key(ns, e.digest) for _, e in superseded)}
    # Records still being written count at their bound: room is made before the puts,
    # each of which then waits for its record only (the next ones are written meanwhile).
    incoming = sum(record_nbytes_bound(encoded[s.index]) for s in new) + grown - freed
    evicted = make_room(txn, incoming, pinned) if incoming > 0 else []
    for span in new if placing else ():  # records go where they lie as they are written
        record = encoded[span.index]
        if isinstance(record, PendingRecord):
            cast(PlacingView, txn).place(K.record_key(ns, span.digest), record)
    checkpoints_written = checkpoint_bytes = new_bytes = 0
    for span in new:
        record = _written(encoded, span.index)
        nbytes = record_nbytes(record)
        new_bytes += nbytes
        ckpt = measure(record)
        checkpoints_written += ckpt > 0
        checkpoint_bytes += ckpt
        txn.put(K.record_key(ns, span.digest), record)
        entry = IndexEntry(
            span.digest,
            span.parent,
            span.index,
            len(span.tokens),
            nbytes,
            now,
            family,
            span.full,
            span.tokens,
            ckpt,
        )
        index_key = K.child_key(ns, span.parent, span.tokens, span.digest, span.full)
        txn.put(index_key, encode_entry(entry))
        txn.put(K.use_key(ns, span.digest), encode_use(now, index_key))
    for span, index_key, old in upgrades:
        record = encoded[span.index]
        ckpt = measure(record)
        checkpoints_written += 1
        checkpoint_bytes += ckpt
        txn.put(K.record_key(ns, span.digest), record)
        upgraded = replace(old, nbytes=record_nbytes(record), checkpoint_nbytes=ckpt)
        txn.put(index_key, encode_entry(upgraded))
    for index_key, entry in superseded:
        delete_block(txn, ns, index_key, entry.digest)
    for key in existing:
        touch_in(txn, key, now)
    add_totals(
        txn,
        ns,
        len(new) - len(superseded),
        new_bytes + grown - freed,
        checkpoints=checkpoints_written,
        checkpoint_bytes=checkpoint_bytes,
    )
    return SaveOutcome(
        tuple(K.record_key(ns, s.digest) for s in new),
        new_bytes,
        len(existing),
        len(superseded),
        tuple(evicted),
        covered_by,
        checkpoints_written,
        checkpoint_bytes,
        len(upgrades),
    )


def _superseded(txn: ReadView, ns: bytes, new: list[Span]) -> list[tuple[bytes, IndexEntry]]:
    """Stored tails that a new block extends (its tokens start with theirs)."""
    out = []
    for span in new:
        for key, entry in iter_entries(txn, K.tails_dir(ns, span.parent)):
            assert entry.tokens is not None
            if entry.ntokens < len(span.tokens) and np.array_equal(
                entry.tokens, span.tokens[: entry.ntokens]
            ):
                out.append((key, entry))
    return out


def _written(encoded: dict[int, Any], index: int) -> Any:
    """Block ``index``'s record, written: a :class:`PendingRecord` waited for, checked,
    and kept in ``encoded`` in its place (a retried commit puts the same bytes)."""
    record = encoded[index]
    if isinstance(record, PendingRecord):
        record = encoded[index] = record.result()
        record_nbytes(record)
    return record


def record_nbytes_bound(record: Any) -> int:
    """:func:`record_nbytes`, or a pending record's bound (its length or a little more)."""
    if isinstance(record, PendingRecord):
        return record.nbytes_bound
    return record_nbytes(record)


def record_nbytes(record: Any) -> int:
    """Size of a record, which must be a C-contiguous buffer."""
    try:
        view = memoryview(record)
    except TypeError as exc:
        raise StoreConfigError(
            f"[save] A record must be bytes-like (bytes, bytearray, memoryview, numpy "
            f"array); received {type(record).__name__}.",
            found=type(record).__name__,
        ) from exc
    if not view.c_contiguous:
        raise StoreConfigError(
            "[save] A record must be a C-contiguous buffer; copy it (np.ascontiguousarray).",
            found=type(record).__name__,
        )
    return view.nbytes


@dataclass
class SaveJob:
    """One save of a ``put_blocks_many``: its spans, what is stored, what it encoded,
    and its result once known."""

    save: BlockSave
    ns: bytes
    toks: np.ndarray
    spans: list[Span]
    encoded: dict[int, Any] = field(default_factory=dict)
    existing: list[bytes] = field(default_factory=list)
    cover: bytes | None = None
    missing: list[Span] = field(default_factory=list)
    result: SaveResult | None = None

    @classmethod
    def of(cls, save: BlockSave, block_size: int, digests: list[bytes] | None = None) -> SaveJob:
        """The job of ``save``; ``digests``: its blocks' (:func:`block_digests`), if known."""
        ns = K.parse_namespace(save.namespace)
        toks = K.as_tokens(save.tokens, "save")
        spans = spans_of(ns, toks, block_size, digests) if len(toks) else []
        job = cls(save, ns, toks, spans)
        if not len(toks):
            job.result = SaveResult(save.namespace, 0)
        return job


def survey_jobs(view: ReadView, jobs: list[SaveJob]) -> None:
    """For every save without a result: what is stored, what covers it, and what to
    encode (missing blocks, and stored blocks ending where the save has a checkpoint
    that their record lacks: encoded again and replaced, issue 16)."""
    for job in jobs:
        if job.result is None:
            job.existing, job.cover, missing = survey(view, job.ns, job.spans)
            absent = {s.index for s in missing}
            stored = [s for s in job.spans if s.index not in absent]
            job.missing = [*missing, *upgradable(view, job.ns, stored, job.save.checkpoints)]


def result_of(job: SaveJob, out: SaveOutcome) -> SaveResult:
    """The :class:`~kvstore.abc.store.SaveResult` of a committed save."""
    return SaveResult(
        job.save.namespace,
        len(job.toks),
        out.written,
        out.written_bytes,
        out.deduplicated,
        out.superseded,
        len(out.evicted),
        sum(b.nbytes for b in out.evicted),
        out.covered_by,
        out.checkpoints,
        out.checkpoint_bytes,
        out.upgraded,
        sum(b.checkpoint_nbytes for b in out.evicted),
    )
