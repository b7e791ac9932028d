"""A restore's host writes cut by record: each record's rows copied into the caches'
arrays in the order they lie in it, and its payload hashed a chunk behind the copy,
while the chunk is still in the CPU's cache (:mod:`~kvstore.codecs.copied_sums` says
why, and how the store's checks take the digest).

:func:`record_writes` regroups the per-array row pieces of
:func:`~kvstore.codecs.plans.run_plans` into one unit of work per record (plus one
per array with zeros past its rows); :func:`~kvstore.codecs.fill.filled_arrays` runs
the units on every core. Only pieces that are plain views into the records' payloads
are written this way: anything else (rows decoded from a lossy record, a piece to
widen) leaves the arrays to the per-array writes.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash
from numpy.lib.array_utils import byte_bounds

from kvstore.codecs import copies
from kvstore.codecs.arrays import numpy_dtype
from kvstore.codecs.copied_sums import Claims
from kvstore.codecs.fill import LeafSpec, common_alignment
from kvstore.codecs.payload_tensors import Payload
from kvstore.codecs.record import placed_payload

__all__ = [
    "CLAIM_MIN_BYTES",
    "HASH_CHUNK_BYTES",
    "PIECE_MIN_BYTES",
    "RecordUnits",
    "RecordWrites",
    "record_writes",
    "worth_claiming",
]

#: A record's payload is hashed up to the end of its last copied piece once that many
#: bytes are waiting: small enough to be read back from the CPU's cache (L2 is 512 KiB
#: on the CI VM's EPYC), large enough that a hash call's cost is noise. Hashing after
#: each 512 KiB llama-8B tensor and after each 256 KiB of qwen-0.5B's 64 KiB ones were
#: the fastest of the cuts tried.
HASH_CHUNK_BYTES = 256 << 10


#: The bytes a row piece must hold, on average, for a restore's rows to be copied
#: record by record: each piece copied costs ~3 us of Python holding the GIL, and
#: qwen-0.5B's 64 KiB pieces made an 8192-token restore 20.3 -> 24.5 ms where
#: llama-8B's 512 KiB ones made a 2048-token one 31.4 -> 27.1 ms. (A model without
#: windows restores from its headers instead, a few strided copies per record:
#: :mod:`~kvstore.codecs.host_alike`.)
PIECE_MIN_BYTES = 256 << 10


#: The fewest bytes of records a restore hashes as it copies them. Below it the store's
#: checks hash every record from the store's pages while the restore parses and plans,
#: on the cores it leaves idle, and the copies only copy: a 2048-token qwen-0.5B
#: restore (24 MiB) took 5.15-5.94 ms so against 5.71-6.18 claimed, where a 512-token
#: llama-8B one (64 MiB) took 9.2-9.4 claimed against 10.1-10.8, and an 8192-token
#: qwen-0.5B one (96 MiB) 12.9-13.2 against 14.2-14.4 (``python -m
#: tools.bench.restore_python --cpu-route``, 2-core x86 CI VM, alternated).
CLAIM_MIN_BYTES = 32 << 20


def worth_claiming(views: Sequence[memoryview]) -> bool:
    """Whether a restore of the records ``views`` may hash them as it copies: at least
    :data:`CLAIM_MIN_BYTES` of them, and a record for every copying thread (a record
    is hashed by one)."""
    return len(views) >= copies.threads() and sum(v.nbytes for v in views) >= CLAIM_MIN_BYTES


# One piece to copy: its first byte in the store's pages, the array, its rows, itself.
_Piece = tuple[int, int, int, int, np.ndarray]


class RecordUnits:
    """What a restore's record-by-record :class:`~kvstore.codecs.fill.Units` share, however
    they cut each record's copies: units ``0 .. records - 1`` copy a record each
    (:meth:`_copy`, the subclass's), hashing it when it is claimed (:meth:`claim`), then
    one unit per array with rows to zero past the restored ones.

    Args:
        claims: the read's claims (``None``: nothing is hashed here).
        records: how many records are copied.
        tails: ``(array, first row to zero)`` of each array with rows past the restored.
    """

    def __init__(
        self, claims: Claims | None, records: int, tails: Sequence[tuple[int, int]]
    ) -> None:
        self._claims = claims
        self._copies = records
        self._tails = tails
        self.count = records + len(tails)
        self._claimed: set[int] = set()

    def claim(self) -> None:
        """Claim the records no check has begun hashing, just before the copies."""
        if self._claims is not None and self._claims.records:
            self._claimed = self._claims.claim_open()

    def unused(self) -> None:
        """The arrays were written some other way: the checks hash the records."""
        if self._claims is not None:
            self._claims.drop()

    def write(self, k: int, targets: Sequence[np.ndarray]) -> None:
        if k >= self._copies:
            array, rows = self._tails[k - self._copies]
            targets[array][:, :, rows:] = 0
            return
        self._copy(k, targets)

    def _copy(self, k: int, targets: Sequence[np.ndarray]) -> None:
        """Unit ``k``'s record copied into ``targets``, hashed behind its copies by
        :meth:`_hasher` and :meth:`_resolve`."""
        raise NotImplementedError

    def _hasher(self, record: int) -> Any:
        """A hasher of claimed record ``record`` (its index in the read's views), or
        ``None`` when the checks hash it."""
        return xxhash.xxh3_64() if record in self._claimed else None

    def _resolve(self, record: int, hasher: Any, rest: memoryview) -> None:
        """Hash the ``rest`` of claimed record ``record`` and hand the checks its digest."""
        if hasher is not None and self._claims is not None:
            hasher.update(rest)
            self._claims.resolve(record, hasher.intdigest())


class RecordWrites(RecordUnits):
    """Record ``k``'s row pieces copied in the order they lie in it, and hashed a
    :data:`HASH_CHUNK_BYTES` chunk behind when claimed (:class:`RecordUnits`)."""

    def __init__(
        self,
        claims: Claims,
        payloads: list[tuple[int, memoryview, int]],
        pieces: dict[int, list[_Piece]],
        tails: list[tuple[int, int]],
    ) -> None:
        # (record, payload, address) of each record with pieces, in order.
        self._records = [p for p in payloads if p[0] in pieces]
        super().__init__(claims, len(self._records), tails)
        self._pieces = pieces
        #: Where the records lie, modulo fill.ALIGN_BYTES (filled_arrays' ``align``).
        self.align = common_alignment(address for _, _, address in payloads)

    def _copy(self, k: int, targets: Sequence[np.ndarray]) -> None:
        record, payload, address = self._records[k]
        hasher = self._hasher(record)
        done = 0  # bytes of the payload hashed
        for start, array, first, stop, piece in self._pieces.get(record, ()):
            # The pieces before this one, copied just now, hashed from the cache.
            if hasher is not None and start - address - done >= HASH_CHUNK_BYTES:
                hasher.update(payload[done : start - address])
                done = start - address
            targets[array][:, :, first:stop] = piece
        self._resolve(record, hasher, payload[done:])


def record_writes(
    specs: Sequence[LeafSpec],
    pieces: Sequence[Sequence[np.ndarray]],
    claims: Claims,
    room_unwritten: Sequence[bool],
) -> RecordWrites | None:
    """The writes of the arrays ``specs`` (array ``k`` is ``pieces[k]`` joined along
    the row axis, then zeros, unless ``room_unwritten[k]``: its cache takes the rows past
    them unwritten), record by record of ``claims.records``; ``None`` when a piece is not
    a view into one of their payloads of its array's dtype and shape."""
    if not claims.records:
        return None
    count = sum(map(len, pieces))
    if not count or sum(p.nbytes for run in pieces for p in run) < PIECE_MIN_BYTES * count:
        return None
    payloads = []
    for record, view in enumerate(claims.records):
        payload = placed_payload(view)
        if payload is not None and payload.nbytes:
            payloads.append((record, payload, Payload(payload).address))
    payloads.sort(key=lambda p: p[2])
    starts = [address for _, _, address in payloads]
    by_record: dict[int, list[_Piece]] = {}
    tails = []
    for array, ((shape, name), row_pieces) in enumerate(zip(specs, pieces, strict=True)):
        dtype, rows = numpy_dtype(name), 0
        for piece in row_pieces:
            if not (
                isinstance(piece, np.ndarray)
                and piece.dtype == dtype
                and piece.ndim == len(shape) > 2
                and piece.shape[:2] == shape[:2]
                and piece.shape[3:] == shape[3:]
            ):
                return None
            if not piece.shape[2]:
                continue
            first, end = byte_bounds(piece)
            at = bisect.bisect_right(starts, first) - 1
            if at < 0 or end > starts[at] + payloads[at][1].nbytes:
                return None
            stop = rows + int(piece.shape[2])
            by_record.setdefault(payloads[at][0], []).append((first, array, rows, stop, piece))
            rows = stop
        if rows > shape[2]:
            return None
        if rows < shape[2] and not room_unwritten[array]:
            tails.append((array, rows))
    for record_pieces in by_record.values():
        record_pieces.sort(key=lambda p: p[0])  # in the order they lie
    return RecordWrites(claims, payloads, by_record, tails)
