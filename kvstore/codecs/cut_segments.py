"""A save's payloads copied from the whole tensors their blocks were cut from, straight
into the pinned arena by the copy engine: no payload built on the device.

A save's blocks are cut from whole-range snapshots (:mod:`kvstore.store.kv.save`):
record ``r``'s tensor ``j`` is rows ``[a, b)`` (axis 2) of a whole tensor ``W_j``
``[batch, heads, rows, width]``. In the record those rows lie back to back, C-ordered:
``batch * heads`` runs of ``(b - a) * width`` elements, each a run of ``W_j`` at a
pitch of its row count. So each tensor of a record is one 2-D copy (a segment of
:data:`kvstore.codecs.cuda.SEGMENT_WORDS` words): read at ``W_j``'s device address,
written at the tensor's offset in the record's payload in the arena; the gaps between
tensors (and after the last) are segments of zeros, written by the host.

:func:`~kvstore.codecs.record.device_payload` instead makes each piece flat (a copy on
the device), concatenates a record's pieces (a second copy), and the record then
crosses the bus (a third): ~65 kernels and two device allocations per record, evaluated
on the writer's thread before any record is downloaded (at 16384 tokens of a llama-8B
shape 301-405 ms, with decode steps beside it slowed 5-40x:
``tools/bench/results/gpu/6f53194-h100/g3stall``). Here every byte is read once on the
device and written once to the host, by the copy engine. (A kernel doing the same
copies over the bus ran at ~9 GB/s and held the SMs a decode step beside it needed:
``results/gpu/163f866-h100/``.)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import mlx.core as mx
import numpy as np

from kvstore.codecs.arrays import byte_view
from kvstore.codecs.cuda import SEGMENT_WORDS
from kvstore.codecs.record import RecordPlan
from kvstore.codecs.stacked_payloads import Cut

__all__ = ["flat_wholes", "row_copies", "segments"]


def flat_wholes(cuts: Sequence[Sequence[Cut]]) -> tuple[list[mx.array], dict[int, int]]:
    """The distinct whole tensors of ``cuts``, each as a flat uint8 array (C-ordered: a
    whole that is a strided view is copied here), and each whole's index among them by
    ``id``."""
    flats: list[mx.array] = []
    index: dict[int, int] = {}
    for plan_cuts in cuts:
        for whole, _, _ in plan_cuts:
            if id(whole) not in index:
                index[id(whole)] = len(flats)
                flats.append(byte_view(whole))
    return flats, index


def segments(
    plan: RecordPlan,
    cuts: Sequence[Cut],
    payload_offset: int,
    addresses: Sequence[int],
    index: dict[int, int],
) -> np.ndarray:
    """The segments (count, then :data:`SEGMENT_WORDS` words a segment) writing the
    payload of ``plan`` at ``payload_offset`` of the arena: each tensor from the device
    ``addresses`` of the flat wholes (:func:`flat_wholes`) it was cut from, zeros
    between, the bytes :func:`~kvstore.codecs.record.device_payload` makes followed by
    zeros to ``plan.payload_nbytes``."""
    rows: list[tuple[int, int, int, int, int, int]] = []
    end = 0
    for (tensor, offset), (whole, a, b) in zip(plan.tensors, cuts, strict=True):
        if offset > end:
            rows.append((0, 0, payload_offset + end, 0, offset - end, 1))
        batch, heads, count, width = (int(n) for n in whole.shape)
        line = width * whole.itemsize  # one row of one head, in bytes
        run = (b - a) * line
        rows.append(
            (
                addresses[index[id(whole)]] + a * line,
                count * line,
                payload_offset + offset,
                run,
                run,
                batch * heads,
            )
        )
        end = offset + int(tensor.nbytes)
    if plan.payload_nbytes > end:
        rows.append((0, 0, payload_offset + end, 0, plan.payload_nbytes - end, 1))
    table = np.empty(1 + len(rows) * SEGMENT_WORDS, np.uint64)
    table[0] = len(rows)
    if rows:
        table[1:] = np.array(rows, np.uint64).reshape(-1)
    return table


def row_copies(params: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """The segments of ``params`` (as :func:`segments` makes them) one row at a time:
    ``(source address, or 0 for zeros; offset into the slot; bytes)``, the copies a
    host stand-in for the copy engine makes (tests, the CPU profile tools)."""
    words = params[1:].reshape(int(params[0]), SEGMENT_WORDS).tolist()
    for src, src_pitch, offset, pitch, width, height in words:
        for r in range(height):
            yield (src + r * src_pitch if src else 0), offset + r * pitch, width
