"""The prefix index: one small entry per block, and the child search lookups use.

An index entry sits under its parent (``.c/<parent>/`` for a full block,
``.t/<parent>/`` for a partial tail; see :mod:`kvstore.store.keys`) and holds
what lookup, eviction and verification need without touching the record:

    <u8 version=1><u8 flags><u16 ntokens><u32 depth><u64 nbytes><f64 created>
    <32 digest><32 parent digest><u8 family length><family utf-8><ntokens x LE u32>

``flags`` bit 0 marks a full block. Entries are written in the same
transaction as their record.

A block whose record carries a recurrent checkpoint at its end (issue 16) has
flags bit 1 set and is a version-2 entry: the same bytes, then
``<u64 checkpoint nbytes>`` (the checkpoint's share of ``nbytes``). Entries
without one stay version 1, byte for byte.

.. versionchanged:: 0.1 entry version 2: checkpointed blocks.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.abc.store import Buffer, ReadView
from kvstore.errors import CorruptEntryError, FormatVersionError
from kvstore.store.keys import ORDER_TOKENS, order_prefix

__all__ = [
    "IndexEntry",
    "encode_entry",
    "decode_entry",
    "iter_entries",
    "encode_use",
    "decode_use",
    "common_prefix",
    "best_child",
]

_USE = struct.Struct("<d")
_HEADER = struct.Struct("<BBHIQd32s32sB")
_CHECKPOINT_BYTES = struct.Struct("<Q")
_VERSION = 1
_VERSION_CHECKPOINT = 2
_FULL = 1
_CHECKPOINT = 2


@dataclass(frozen=True)
class IndexEntry:
    """A block as the index knows it. ``tokens`` is ``None`` when not decoded."""

    digest: bytes
    parent: bytes
    depth: int
    ntokens: int
    nbytes: int
    created: float
    family: str
    full: bool
    tokens: np.ndarray | None = None
    #: Bytes of the record that are a recurrent checkpoint at the block's end (0: none).
    checkpoint_nbytes: int = 0

    @property
    def checkpointed(self) -> bool:
        """The record carries the recurrent layers' checkpoint at the block's end."""
        return self.checkpoint_nbytes > 0


def encode_entry(entry: IndexEntry) -> bytes:
    assert entry.tokens is not None
    family = entry.family.encode("utf-8")[:255]
    checkpointed = entry.checkpoint_nbytes > 0
    head = _HEADER.pack(
        _VERSION_CHECKPOINT if checkpointed else _VERSION,
        (_FULL if entry.full else 0) | (_CHECKPOINT if checkpointed else 0),
        entry.ntokens,
        entry.depth,
        entry.nbytes,
        entry.created,
        entry.digest,
        entry.parent,
        len(family),
    )
    body = head + family + np.ascontiguousarray(entry.tokens, dtype="<u4").tobytes()
    return body + _CHECKPOINT_BYTES.pack(entry.checkpoint_nbytes) if checkpointed else body


def decode_entry(value: Buffer, *, with_tokens: bool = True) -> IndexEntry:
    """Parse an index entry; tokens are copied out (the value may be an LMDB page).

    Raises:
        CorruptEntryError: truncated or inconsistent bytes.
        FormatVersionError: an entry written by a newer kvstore.
    """
    if len(value) < _HEADER.size:
        raise CorruptEntryError(
            f"[index] An index entry is at least {_HEADER.size} bytes; received {len(value)}.",
            found=len(value),
        )
    version, flags, ntokens, depth, nbytes, created, digest, parent, flen = _HEADER.unpack_from(
        value
    )
    if version not in (_VERSION, _VERSION_CHECKPOINT):
        raise FormatVersionError(
            f"[index] Index entry version {version} is not one this reader knows (reads "
            f"{_VERSION}-{_VERSION_CHECKPOINT}). Upgrade kvstore.",
            found=version,
            supported=(_VERSION, _VERSION_CHECKPOINT),
        )
    start = _HEADER.size + flen
    extra = _CHECKPOINT_BYTES.size if version == _VERSION_CHECKPOINT else 0
    if len(value) != start + 4 * ntokens + extra:
        raise CorruptEntryError(
            f"[index] An index entry of {ntokens} tokens is {start + 4 * ntokens + extra} "
            f"bytes; received {len(value)}.",
            found=len(value),
        )
    checkpoint_nbytes = 0
    if extra:
        (checkpoint_nbytes,) = _CHECKPOINT_BYTES.unpack_from(value, start + 4 * ntokens)
        if not (flags & _CHECKPOINT and 0 < checkpoint_nbytes <= nbytes):
            raise CorruptEntryError(
                f"[index] A version-2 entry carries a checkpoint of 1 to nbytes ({nbytes}) "
                f"bytes, flagged; received {checkpoint_nbytes} bytes, flags {flags:#x}.",
                found=checkpoint_nbytes,
            )
    elif flags & _CHECKPOINT:
        raise CorruptEntryError(
            "[index] A version-1 entry cannot be flagged as carrying a checkpoint.",
            found=flags,
        )
    family = bytes(value[_HEADER.size : start]).decode("utf-8", "replace")
    tokens = (
        np.frombuffer(value, dtype="<u4", count=ntokens, offset=start).copy()
        if with_tokens
        else None
    )
    return IndexEntry(
        digest,
        parent,
        depth,
        ntokens,
        nbytes,
        created,
        family,
        bool(flags & _FULL),
        tokens,
        checkpoint_nbytes,
    )


def iter_entries(
    view: ReadView,
    prefix: bytes,
    *,
    start: bytes | None = None,
    reverse: bool = False,
    with_tokens: bool = True,
) -> Iterator[tuple[bytes, IndexEntry]]:
    """Decoded index entries under ``prefix``; entries that do not decode are skipped
    (``verify()`` reports them), so one damaged entry never fails a lookup or a save."""
    for key, value in view.scan(prefix, start=start, reverse=reverse):
        try:
            yield key, decode_entry(value, with_tokens=with_tokens)
        except (CorruptEntryError, FormatVersionError):
            continue


def encode_use(last_use: float, index_key: bytes) -> bytes:
    """The ``.u/`` value: last use (float64 seconds), then the block's index key,
    so a block named only by its record key can be found in the index."""
    return _USE.pack(last_use) + index_key


def decode_use(value: Buffer) -> tuple[float, bytes]:
    if len(value) < _USE.size:
        raise CorruptEntryError(
            f"[index] A last-use value is at least {_USE.size} bytes; received {len(value)}.",
            found=len(value),
        )
    return _USE.unpack_from(value)[0], bytes(value[_USE.size :])


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def best_child(
    view: ReadView, directories: Sequence[bytes], query: np.ndarray
) -> tuple[int, bytes, IndexEntry] | None:
    """The entry under ``directories`` sharing the longest prefix with ``query``.

    Order keys sort children lexicographically by tokens, so in each directory
    the best child is the predecessor or the successor of the query's position,
    except among children whose first :data:`ORDER_TOKENS` tokens all equal the
    query's: that run is contiguous and read whole. Ties go to the smaller
    record (fewer rows), then to key order.

    Returns:
        ``(common prefix length, index key, entry)``, or ``None`` when no child
        shares even the first token.
    """
    order = order_prefix(query, pad=True)
    full_run = len(query) >= ORDER_TOKENS
    best: tuple[tuple[int, int, bytes], IndexEntry] | None = None
    for directory in directories:
        seek = directory + order
        found: list[tuple[bytes, IndexEntry]] = []
        for key, entry in iter_entries(view, directory, start=seek):
            found.append((key, entry))
            if not (full_run and key[len(directory) : len(seek)] == order):
                break
        for key, entry in iter_entries(view, directory, start=seek, reverse=True):
            found.append((key, entry))
            break
        for key, entry in found:
            assert entry.tokens is not None
            lcp = common_prefix(entry.tokens, query)
            rank = (-lcp, entry.ntokens, key)
            if lcp and (best is None or rank < best[0]):
                best = (rank, entry)
    if best is None:
        return None
    (neg_lcp, _, key), entry = best
    return -neg_lcp, key, entry
