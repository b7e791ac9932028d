"""Records for testing prefix stores: opaque to the store, checkable byte for byte.

A synthetic record stands in for a block of KV rows. Row ``i`` of a prompt is
a digest chained over the prompt's tokens ``0..i`` -- like a real K/V row it
depends on everything before it -- so any block holding position ``i`` of any
prompt with the same first ``i + 1`` tokens has the same row ``i``, and a
restore can be checked exactly (:func:`check_match`)::

    <u64 xxh3 of the rest><u32 rows><u32 row bytes><rows><filler>

:func:`verify_record` is the ``verify`` to open a store with: it raises
:class:`~kvstore.errors.CorruptEntryError` when a single bit is off.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from kvstore.abc.store import BlockSpan, Match, PrefixStore, RecordEncoder
from kvstore.errors import CorruptEntryError

__all__ = [
    "prefix_rows",
    "make_record",
    "encoder_for",
    "verify_record",
    "record_rows",
    "check_match",
    "check_views",
]

_HEAD = struct.Struct("<QII")


def prefix_rows(tokens: Sequence[int] | np.ndarray, row_bytes: int = 16) -> np.ndarray:
    """``[len(tokens), row_bytes]`` uint8 rows, row ``i`` a digest of ``tokens[: i + 1]``."""
    toks = np.asarray(tokens, dtype="<u4")
    out = np.empty((len(toks), row_bytes), dtype=np.uint8)
    h = b""
    for i, t in enumerate(toks.tobytes()[j : j + 4] for j in range(0, 4 * len(toks), 4)):
        h = hashlib.blake2b(h + t, digest_size=row_bytes).digest()
        out[i] = np.frombuffer(h, dtype=np.uint8)
    return out


def make_record(rows: np.ndarray, filler: int = 0) -> bytes:
    """A checksummed record of ``rows`` plus ``filler`` bytes (to make it realistically big)."""
    body = rows.tobytes() + bytes(filler)
    n, width = rows.shape
    rest = struct.pack("<II", n, width) + body
    return struct.pack("<Q", xxhash.xxh3_64_intdigest(rest)) + rest


def encoder_for(
    tokens: Sequence[int] | np.ndarray, row_bytes: int = 16, filler: int = 0
) -> RecordEncoder:
    """An ``encode`` for ``put_blocks`` that makes each span's record from its rows."""
    rows = prefix_rows(tokens, row_bytes)

    def encode(spans: Sequence[BlockSpan]) -> list[bytes]:
        return [make_record(rows[s.start : s.stop], filler) for s in spans]

    return encode


def verify_record(view: memoryview) -> None:
    """Raise CorruptEntryError unless ``view`` is an intact synthetic record."""
    if len(view) < _HEAD.size:
        raise CorruptEntryError(f"[verify] record of {len(view)} bytes is truncated")
    (checksum,) = struct.unpack_from("<Q", view)
    found = xxhash.xxh3_64_intdigest(view[8:])
    if found != checksum:
        raise CorruptEntryError(
            f"[verify] record checksum mismatch: stored {checksum:#x}, computed {found:#x}",
            stored=checksum,
            computed=found,
        )


def record_rows(view: Any) -> np.ndarray:
    """The rows of a synthetic record (a copy)."""
    _, n, width = _HEAD.unpack_from(view)
    return (
        np.frombuffer(view, dtype=np.uint8, count=n * width, offset=_HEAD.size)
        .reshape(n, width)
        .copy()
    )


def check_match(
    store: PrefixStore, match: Match, tokens: Sequence[int] | np.ndarray, row_bytes: int = 16
) -> None:
    """Assert that reading ``match`` yields exactly the rows of ``tokens[: match.tokens]``."""
    with store.read(match.blocks) as views:
        assert len(views) == len(match.blocks), f"read {len(views)} of {len(match.blocks)} blocks"
        check_views(views, match, tokens, row_bytes)


def check_views(
    views: Sequence[Any],
    match: Match,
    tokens: Sequence[int] | np.ndarray,
    row_bytes: int = 16,
) -> None:
    """Assert that ``views``, a read of ``match``'s blocks, hold exactly the rows of
    ``tokens[: match.tokens]``."""
    expected = prefix_rows(np.asarray(tokens)[: match.tokens], row_bytes)
    got = [record_rows(v)[: ref.rows] for v, ref in zip(views, match.blocks, strict=True)]
    restored = np.concatenate(got) if got else expected[:0]
    assert restored.shape == expected.shape, (restored.shape, expected.shape)
    assert np.array_equal(restored, expected), "restored rows differ from the prompt's rows"
