"""A CPU restore's arrays written record by record, each record hashed as it is copied out.

A restore's checks hash every record's payload while the fill copies the rows out
of the same pages (:func:`kvstore.store.blocks.checks.in_background`): every byte is
read from memory twice. Here the fill runs record by record instead of array by
array, and hashes each record's payload in order as it goes -- each tensor right
after its copy, while it is still in the cache -- and hands the digest to the
record's check (:func:`kvstore.codecs.record.reader_hashes`), which compares it with
the header's instead of hashing. On the 2-core CI VM, copies of 256 MiB of records
took 18.4 ms, with the checks beside 27.0, fused 19.3 (``tools/bench/fill_fused.py``).

It applies where every array is written through MLX's loader (the large restores of
:func:`~kvstore.codecs.fill.filled_arrays`) and no two row pieces of a record share
bytes; elsewhere :func:`fill_hashing` returns ``None`` having written nothing, and
the caller fills as usual (the checks then hash, as before).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
import numpy as np
import xxhash

from kvstore.codecs.copies import each_on_threads
from kvstore.codecs.fill import LeafSpec, allocated_arrays, fills_directly

__all__ = ["fill_hashing"]

#: ``done(record index, payload digest)`` (``None``: given up, its check hashes it).
Done = Callable[[int, int | None], None]
#: A piece of a record: (first byte, end, array, first row, the piece).
_Task = tuple[int, int, int, int, np.ndarray]


def fill_hashing(
    specs: Sequence[LeafSpec],
    pieces: Sequence[Sequence[np.ndarray]],
    payloads: Sequence[np.ndarray],
    done: Done,
) -> list[mx.array] | None:
    """Arrays of ``specs``, array ``k`` its row pieces ``pieces[k]`` joined along the
    row axis (axis 2) and zeros past them, as :func:`~kvstore.codecs.plans.write_rows`
    writes them; each of ``payloads`` (the records' payloads, uint8) hashed in order as
    its pieces are copied, its digest given to ``done``. ``None`` (nothing written, no
    digest given: the caller gives them up) where it does not apply (the module
    docstring)."""
    if not payloads or not fills_directly(specs):
        return None
    placed = _placed(pieces, payloads)
    if placed is None:
        return None
    tasks, foreign, rows = placed
    owned = allocated_arrays(specs)
    if owned is None:
        return None
    targets = [view for _, view in owned]

    def record(r: int) -> None:
        payload = memoryview(cast(Any, payloads[r]))
        hasher = xxhash.xxh3_64()
        at = 0
        for start, end, k, first, piece in tasks[r]:
            if start > at:
                hasher.update(payload[at:start])
            np.copyto(targets[k][:, :, first : first + piece.shape[2]], piece, casting="safe")
            hasher.update(payload[start:end])
            at = end
        if at < len(payload):
            hasher.update(payload[at:])
        done(r, hasher.intdigest())

    def rest(k: int) -> None:
        for first, piece in foreign[k]:
            np.copyto(targets[k][:, :, first : first + piece.shape[2]], piece, casting="safe")
        targets[k][:, :, rows[k] :] = 0

    each_on_threads(len(payloads), record)
    each_on_threads(len(targets), rest)
    return [array for array, _ in owned]


def _placed(
    pieces: Sequence[Sequence[np.ndarray]], payloads: Sequence[np.ndarray]
) -> tuple[list[list[_Task]], list[list[tuple[int, np.ndarray]]], list[int]] | None:
    """Each record's pieces in payload order, the pieces in no record (each array's), and
    each array's rows; ``None`` where two pieces of a record overlap."""
    bases = [int(p.ctypes.data) for p in payloads]
    order = sorted(range(len(payloads)), key=bases.__getitem__)
    starts = [bases[i] for i in order]
    tasks: list[list[_Task]] = [[] for _ in payloads]
    foreign: list[list[tuple[int, np.ndarray]]] = [[] for _ in pieces]
    rows: list[int] = []
    for k, run in enumerate(pieces):
        first = 0
        for piece in run:
            span = _span(piece)
            at = bisect.bisect_right(starts, span[0]) - 1 if span is not None else -1
            r = order[at] if at >= 0 else -1
            if span is not None and r >= 0 and span[1] <= bases[r] + len(payloads[r]):
                tasks[r].append((span[0] - bases[r], span[1] - bases[r], k, first, piece))
            else:
                foreign[k].append((first, piece))
            first += int(piece.shape[2])
        rows.append(first)
    for held in tasks:
        held.sort(key=lambda task: task[0])
        if any(a[1] > b[0] for a, b in zip(held, held[1:], strict=False)):
            return None
    return tasks, foreign, rows


def _span(piece: np.ndarray) -> tuple[int, int] | None:
    """The bytes ``piece`` spans, first to last (``None``: a negative stride, or empty)."""
    if piece.size == 0 or any(stride < 0 for stride in piece.strides):
        return None
    start = int(piece.ctypes.data)
    last = sum((n - 1) * stride for n, stride in zip(piece.shape, piece.strides, strict=True))
    return start, start + last + piece.itemsize
