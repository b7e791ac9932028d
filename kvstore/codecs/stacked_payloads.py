"""A save's record payloads built on the device in a few kernels, not a few per piece.

:func:`~kvstore.codecs.record.device_payload` builds one record's payload on its own: a
copy per tensor piece (a strided slice made flat) and a concatenation. A 4096-token
llama-8B save has 16 records of 64 pieces: ~2000 kernel launches, which held the
saving thread 35-39 ms on an H100, and the decode step overlapping them ran ~3x its
usual time (``tools/bench/results/gpu/``, save-stall files).

A save's blocks are cut alike from the same whole-range snapshots: record ``r``'s
tensor ``j`` is rows ``[a + r n, a + (r + 1) n)`` (axis 2) of one whole tensor
``W_j``. Here each ``W_j``'s rows for every record of such a run are copied once into
record order (``[R, bytes_j]``), and one concatenation lays all the run's payloads
out, zero padding included: record ``r``'s payload is row ``r`` (a contiguous view).
Where every piece has one shape in bytes and they lie back to back (a lossless model's
keys and values), each whole tensor's rows go straight into place instead, one copy of
every byte, not two. The bytes are those :func:`device_payload` makes, piece for piece.

Where the one copy does it, the default (``KVSTORE_CUDA_SAVE_PAYLOADS=auto``,
:mod:`kvstore.store.kv.save`); with two copies a G3 save took 9-11 % longer on an H100
(``results/gpu/ffbfa55-h100/``), so the other layouts stack only under ``stacked``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from kvstore.codecs.record import RecordPlan

__all__ = ["Cut", "stacked_payloads"]

#: What a record's tensor was cut from: the whole tensor (4-D, rows on axis 2) and the
#: rows ``[a, b)`` of it, or ``None`` where it was not cut so (or is not known to be).
Cut = tuple[mx.array, int, int]


#: The most payload bytes one run stacks into one device array: a 16384-token llama-8B
#: save is 2 GiB, and one array of it would be one allocation the size of the save;
#: runs of this size are arrays MLX's buffer cache keeps for the next save (on an H100,
#: 32 MiB runs and 256 MiB runs saved alike: ``results/gpu/4ac01ae-h100/``).
RUN_BYTES = 256 << 20


def stacked_payloads(
    plans: Sequence[RecordPlan],
    cut_of: Callable[[Any], Cut | None],
    *,
    one_copy_only: bool = False,
) -> list[mx.array | None]:
    """Each plan's payload (lazy uint8, as ``device_payload`` makes it) where it belongs
    to a run of at least two records cut alike from the same whole tensors, block after
    block (at most :data:`RUN_BYTES` a run); ``None`` for the others (built one by one).
    With ``one_copy_only``, only runs whose pieces take one copy (:func:`_same_pieces`)."""
    out: list[mx.array | None] = [None] * len(plans)
    i = 0
    while i < len(plans):
        cuts = _cuts(plans[i], cut_of)
        most = max(1, RUN_BYTES // max(1, plans[i].payload_nbytes))
        end = i + 1
        while (
            cuts is not None
            and end - i < most
            and end < len(plans)
            and _follows(plans[end], plans[i], cuts, end - i, cut_of)
        ):
            end += 1
        if cuts is not None and end - i >= 2:
            built = _stacked(plans[i], cuts, end - i, one_copy_only=one_copy_only)
            if built is not None:
                out[i:end] = built
        i = end
    return out


def _cuts(plan: RecordPlan, cut_of: Callable[[Any], Cut | None]) -> list[Cut] | None:
    """Where each of ``plan``'s tensors was cut from, if all were cut from 4-D MLX tensors
    of their dtype along axis 2; else ``None``."""
    cuts = []
    for tensor, _ in plan.tensors:
        cut = cut_of(tensor) if type(tensor) is mx.array else None
        if cut is None:
            return None
        whole, a, b = cut
        if whole.ndim != 4 or whole.dtype != tensor.dtype:
            return None
        batch, heads, _, width = whole.shape
        if tuple(tensor.shape) != (batch, heads, b - a, width):
            return None
        cuts.append(cut)
    return cuts or None


def _follows(
    plan: RecordPlan,
    first: RecordPlan,
    cuts: list[Cut],
    r: int,
    cut_of: Callable[[Any], Cut | None],
) -> bool:
    """Whether ``plan`` is record ``r`` of the run ``first`` starts: the same layout, each
    tensor the next ``n`` rows of the same whole tensor."""
    if plan.payload_nbytes != first.payload_nbytes or len(plan.tensors) != len(first.tensors):
        return False
    for (tensor, offset), (_, first_offset), (whole, a, b) in zip(
        plan.tensors, first.tensors, cuts, strict=True
    ):
        cut = cut_of(tensor) if type(tensor) is mx.array and offset == first_offset else None
        n = b - a
        if cut is None or cut[0] is not whole or cut[1] != a + r * n or cut[2] != a + (r + 1) * n:
            return False
    return True


def _stacked(
    first: RecordPlan, cuts: list[Cut], count: int, *, one_copy_only: bool
) -> list[mx.array] | None:
    same = _same_pieces(first, cuts)
    if same is not None:
        return same(count)
    if one_copy_only:
        return None
    pieces: list[mx.array] = []
    end = 0
    for (tensor, offset), (whole, a, b) in zip(first.tensors, cuts, strict=True):
        if offset > end:
            pieces.append(mx.zeros((count, offset - end), mx.uint8))
        n = b - a
        batch, heads, _, width = whole.shape
        rows = whole[:, :, a : a + count * n].reshape(batch, heads, count, n, width)
        # Record order: [count, batch, heads, n, width], each record's rows C-ordered.
        flat = mx.moveaxis(rows, 2, 0).reshape(count, -1)
        pieces.append(flat.view(mx.uint8))
        end = offset + tensor.nbytes
    if first.payload_nbytes > end:
        pieces.append(mx.zeros((count, first.payload_nbytes - end), mx.uint8))
    stacked = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=1)
    return [stacked[r] for r in range(count)]


def _same_pieces(first: RecordPlan, cuts: list[Cut]) -> Callable[[int], list[mx.array]] | None:
    """Where every piece of a record has the same shape in bytes and they lie back to
    back (a lossless model's keys and values): one copy of each whole tensor's rows
    straight into place (:func:`mx.stack` of their record-order views), where the
    general route copies them into record order and then again into place. On the CI
    VM's CPU, a 2048-token 32-layer llama-8B's 8 blocks: 256-349 ms against 616-712
    with two copies, and 256-385 record by record."""
    shapes = [
        (whole.shape[0], whole.shape[1], b - a, whole.shape[3] * whole.dtype.size)
        for whole, a, b in cuts
    ]
    piece = math.prod(shapes[0])
    back_to_back = all(offset == j * piece for j, (_, offset) in enumerate(first.tensors))
    if len(set(shapes)) != 1 or not back_to_back or first.payload_nbytes != piece * len(shapes):
        return None

    def build(count: int) -> list[mx.array]:
        views = []
        for (whole, a, _), (batch, heads, n, width) in zip(cuts, shapes, strict=True):
            rows = whole.view(mx.uint8)[:, :, a : a + count * n]
            views.append(mx.moveaxis(rows.reshape(batch, heads, count, n, width), 2, 0))
        stacked = mx.stack(views, axis=1).reshape(count, -1)
        return [stacked[r] for r in range(count)]

    return build
