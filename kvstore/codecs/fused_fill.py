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
from numpy.lib.stride_tricks import as_strided

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
    addresses = [int(view.ctypes.data) for view in targets]

    def record(r: int) -> None:
        payload = memoryview(cast(Any, payloads[r]))
        hasher = xxhash.xxh3_64()
        at = 0
        for start, end, source, target in _runs(tasks[r], targets, addresses):
            np.copyto(target, source, casting="safe")
            # Hashed right after its copy read it: the run's bytes are still in the cache.
            hasher.update(payload[at:end])
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


#: The most source bytes one copy (and the hash after it) takes: the bytes the hash reads
#: again stay in the cache (2 MiB: each core's L2 here is 1 MiB, the L3 32 MiB shared).
RUN_MAX_BYTES = 2 << 20


def _runs(
    tasks: Sequence[_Task], targets: Sequence[np.ndarray], addresses: Sequence[int]
) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
    """A record's pieces (``tasks``, in payload order) as ``(first byte, end, source,
    target)`` copies: pieces alike (shape, strides, dtype and first row), evenly spaced in
    the record and written into arrays alike evenly spaced in memory (a layer after another
    of one buffer, :mod:`~kvstore.codecs.one_buffer`) taken by one copy of them stacked, up
    to :data:`RUN_MAX_BYTES`. Each stacked view is made from the addresses of the pieces
    and arrays themselves, so its members are exactly those pieces and arrays.
    """
    runs = []
    i = 0
    while i < len(tasks):
        start, end, k, first, piece = tasks[i]
        rows = int(piece.shape[2])
        target = targets[k][:, :, first : first + rows]
        j = i + 1
        if j < len(tasks):
            step_src = tasks[j][0] - start
            step_dst = addresses[tasks[j][2]] - addresses[k]
            limit = max(1, RUN_MAX_BYTES // max(1, end - start))
            while j < len(tasks) and j - i < limit:
                s2, _, k2, f2, p2 = tasks[j]
                if not (
                    f2 == first
                    and p2.shape == piece.shape
                    and p2.strides == piece.strides
                    and p2.dtype == piece.dtype
                    and s2 - start == (j - i) * step_src
                    and addresses[k2] - addresses[k] == (j - i) * step_dst
                    and targets[k2].shape == targets[k].shape
                    and targets[k2].strides == targets[k].strides
                    and targets[k2].dtype == targets[k].dtype
                ):
                    break
                j += 1
        count = j - i
        if count > 1 and step_src > 0 and step_dst > 0:
            source = as_strided(piece, (count, *piece.shape), (step_src, *piece.strides))
            target = as_strided(
                target, (count, *target.shape), (step_dst, *target.strides), writeable=True
            )
        else:
            count, j = 1, i + 1
        runs.append((start, tasks[j - 1][1], source if count > 1 else piece, target))
        i = j
    return runs


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
    extents: dict[tuple[Any, ...], int | None] = {}
    for k, run in enumerate(pieces):
        first = 0
        for piece in run:
            span = _span(piece, extents)
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


def _span(piece: np.ndarray, extents: dict[tuple[Any, ...], int | None]) -> tuple[int, int] | None:
    """The bytes ``piece`` spans, first to last (``None``: a negative stride, or empty);
    ``extents`` keeps each layout's extent (a restore's pieces share a few)."""
    layout = (piece.shape, piece.strides, piece.itemsize)
    extent = extents.get(layout, 0)
    if extent == 0:
        if piece.size == 0 or any(stride < 0 for stride in piece.strides):
            extent = None
        else:
            extent = piece.itemsize + sum(
                (n - 1) * stride for n, stride in zip(piece.shape, piece.strides, strict=True)
            )
        extents[layout] = extent
    if extent is None:
        return None
    start = int(piece.ctypes.data)
    return start, start + extent
