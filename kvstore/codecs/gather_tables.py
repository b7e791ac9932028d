"""The segment tables a gather kernel reads: which host bytes land where in device memory.

A restore's arrays are each joined from pieces: the rows of one tensor in each of a
layer's records, ``[B, H, rows, ...]`` in C order, in the store's pages. The gather
kernels (:mod:`kvstore.codecs.cuda_pages`) copy them by a table of segments, one per
piece and batch row (``src, src_pitch, dst_offset, dst_pitch, width, height``:
``height`` runs of ``width`` bytes, :data:`~kvstore.codecs.cuda.SEGMENT_WORDS`), then
one per array short of its capacity writing its zeros. This module makes those tables,
with numpy for every piece at once, and says when pieces do not fit a gather (another
dtype, other leading or trailing dims, rows that are not contiguous): the caller then
stages the plain way. It touches no device: what a table says is tested on any machine.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvstore.codecs.arrays import dtype_name, numpy_dtype
from kvstore.codecs.cuda import SEGMENT_WORDS, LeafSpec
from kvstore.codecs.one_buffer import buffer_starts, padded_nbytes

__all__ = [
    "AlikeRows",
    "RowsLayout",
    "StackedRows",
    "alike_layout",
    "alike_table",
    "host_layout",
    "segment_table",
    "segment_tables",
    "stacked_table",
    "stored_layout",
]


@dataclass
class RowsLayout:
    """One array's pieces as a gather reads them: each piece's address, batch and head
    strides and rows (appended by :func:`host_layout`), and the array's batch, heads,
    capacity (rows) and row bytes."""

    addresses: list[int]
    batch_strides: list[int]
    head_strides: list[int]
    counts: list[int]
    batch: int
    heads: int
    capacity: int
    row_bytes: int


def stored_layout(
    addresses: Sequence[int],
    shapes: Sequence[tuple[int, ...]],
    counts: Sequence[int],
    dtypes: Sequence[str],
    shape: tuple[int, ...],
    name: str,
) -> RowsLayout | None:
    """:func:`host_layout` of C-ordered tensors described, not viewed: each at host
    ``addresses[i]``, stored as ``shapes[i]`` of dtype ``dtypes[i]``, its first
    ``counts[i]`` rows read (a record's header entries:
    :class:`~kvstore.codecs.payload_tensors.PayloadTensors`); ``None`` when they do not
    fit a gather into a ``shape`` array of ``name``."""
    if set(dtypes) != {name}:
        return None
    for piece_shape in set(shapes):
        if len(piece_shape) != len(shape) or piece_shape[:2] != shape[:2]:
            return None
        if piece_shape[3:] != shape[3:]:
            return None
    row_bytes = math.prod(shape[3:]) * numpy_dtype(name).itemsize
    # One pass over the pieces: a q8 restore's 192 layouts of 16 pieces took 1.86 ms here
    # as a comprehension per list, 1.20 ms so (with _StoredRows.layout's one pass).
    kept: list[int] = []
    batch_strides: list[int] = []
    head_strides: list[int] = []
    kept_counts: list[int] = []
    for address, piece, rows in zip(addresses, shapes, counts, strict=True):
        if not 0 <= rows <= piece[2]:
            return None
        if rows:
            head = piece[2] * row_bytes  # C order: batch, heads, rows
            kept.append(address)
            batch_strides.append(piece[1] * head)
            head_strides.append(head)
            kept_counts.append(rows)
    if sum(kept_counts) > shape[2]:
        return None
    return RowsLayout(
        kept, batch_strides, head_strides, kept_counts, shape[0], shape[1], shape[2], row_bytes
    )


def alike_layout(
    addresses: Sequence[int],
    piece_shape: tuple[int, ...],
    counts: Sequence[int],
    dtype: str,
    shape: tuple[int, ...],
    name: str,
) -> RowsLayout | None:
    """:func:`stored_layout` of pieces laid out alike (one header template's: one
    ``piece_shape`` and ``dtype``), checked once, not per piece: a lossy restore's 128
    joins of 16 records each."""
    if dtype != name or len(piece_shape) != len(shape) or piece_shape[:2] != shape[:2]:
        return None
    if piece_shape[3:] != shape[3:] or sum(counts) > shape[2]:
        return None
    if min(counts) < 0 or max(counts) > piece_shape[2]:
        return None
    row_bytes = math.prod(shape[3:]) * numpy_dtype(name).itemsize
    head = piece_shape[2] * row_bytes  # C order: batch, heads, rows
    if 0 in counts:
        kept = [(a, c) for a, c in zip(addresses, counts, strict=True) if c]
        addresses, counts = [a for a, _ in kept], [c for _, c in kept]
    n = len(counts)
    return RowsLayout(
        list(addresses),
        [piece_shape[1] * head] * n,
        [head] * n,
        list(counts),
        shape[0],
        shape[1],
        shape[2],
        row_bytes,
    )


@dataclass(frozen=True)
class AlikeRows:
    """Arrays each joined from one tensor of the same records, laid out alike: array
    ``j``'s piece in record ``r`` lies at ``bases[r] + offsets[j]``, stored as
    ``shapes[j]`` of ``dtypes[j]``, its first ``counts[j][r]`` rows read (a lossy
    restore's joins: every layer's tensors from the same records of one header
    template). :func:`alike_table` makes their gather's segments in one go."""

    bases: Sequence[int]
    offsets: Sequence[int]
    shapes: Sequence[tuple[int, ...]]
    dtypes: Sequence[str]
    counts: Sequence[Sequence[int]]


def alike_table(rows: AlikeRows, specs: Sequence[LeafSpec]) -> np.ndarray | None:
    """The one-buffer gather's segment table of ``rows`` into arrays ``specs`` (each at
    its :func:`buffer_starts`): what :func:`segment_table` makes of their
    :func:`alike_layout` s, made by numpy for every array at once (a lossy restore's 128
    to 192 layouts and their table took 2.2-2.3 ms of the restoring thread's CPU on the
    H200, ``results/gpu/8e1beb9/ab-cpu.txt``); ``None`` where one does not fit its
    array (:func:`alike_layout`'s checks)."""
    u64 = np.uint64
    # alike_layout's checks, once per kind of array (a restore has a few) ...
    for piece, dtype, spec in set(zip(rows.shapes, rows.dtypes, specs, strict=True)):
        if not _fits_alike(piece, dtype, spec):
            return None
    shapes = [shape for shape, _ in specs]
    arrays = _Arrays(
        np.array([s[0] for s in shapes], u64),
        np.array([s[1] for s in shapes], u64),
        np.array([s[2] for s in shapes], u64),
        np.array(
            [math.prod(s[3:]) * numpy_dtype(name).itemsize for s, (_, name) in zip(shapes, specs)],
            u64,
        ),
        np.array(buffer_starts(specs)[: len(specs)], u64),
    )
    stored = np.array([piece[2] for piece in rows.shapes], u64)
    signed = np.array(rows.counts, np.int64).reshape(len(specs), len(rows.bases))
    offsets = np.array(rows.offsets, u64)
    return _alike_table_of(arrays, stored, signed, offsets, np.array(rows.bases, u64))


@dataclass(frozen=True)
class StackedRows:
    """:class:`AlikeRows` of ``layers`` arrays of each of a few kinds, kind by kind and
    layer by layer (a lossy restore's joins of every layer, one kind per tensor name:
    :mod:`~kvstore.codecs.alike_joins`): kind ``k``'s array of layer ``i`` reads each
    record ``r``'s piece at ``bases[r] + offsets[k][i]``, stored as ``shapes[k]`` of
    ``dtypes[k]``, its first ``counts[k][r]`` rows."""

    bases: Sequence[int]
    offsets: Sequence[Sequence[int]]
    shapes: Sequence[tuple[int, ...]]
    dtypes: Sequence[str]
    counts: Sequence[Sequence[int]]


def stacked_table(rows: StackedRows, specs: Sequence[LeafSpec]) -> np.ndarray | None:
    """:func:`alike_table` of ``rows`` into arrays of ``specs`` (one per kind, each
    ``layers`` times over, at their :func:`buffer_starts`), made from what each kind
    shares rather than per array: a TurboQuant restore of llama-8B has 4 kinds of 32."""
    u64 = np.uint64
    for piece, dtype, spec in zip(rows.shapes, rows.dtypes, specs, strict=True):
        if not _fits_alike(piece, dtype, spec):
            return None
    layers = len(rows.offsets[0]) if rows.offsets else 0
    if any(len(offsets) != layers for offsets in rows.offsets):
        return None
    shapes = [shape for shape, _ in specs]
    row_bytes = [
        math.prod(s[3:]) * numpy_dtype(name).itemsize for s, (_, name) in zip(shapes, specs)
    ]
    padded = np.array([padded_nbytes(spec) for spec in specs], u64)
    begins = np.concatenate([np.zeros(1, u64), np.cumsum(padded * u64(layers))[:-1]])
    within = np.arange(layers, dtype=u64)

    def each(values: Sequence[int]) -> np.ndarray:  # a kind's value for each of its arrays
        return np.repeat(np.array(values, u64), layers)

    arrays = _Arrays(
        each([s[0] for s in shapes]),
        each([s[1] for s in shapes]),
        each([s[2] for s in shapes]),
        each(row_bytes),
        (begins[:, None] + padded[:, None] * within[None, :]).reshape(-1),
    )
    signed = np.repeat(np.array(rows.counts, np.int64).reshape(len(specs), -1), layers, axis=0)
    return _alike_table_of(
        arrays,
        each([piece[2] for piece in rows.shapes]),
        signed,
        np.array(rows.offsets, u64).reshape(-1),
        np.array(rows.bases, u64),
    )


def _fits_alike(piece: tuple[int, ...], dtype: str, spec: LeafSpec) -> bool:
    """:func:`alike_layout`'s checks of a kind of piece against its array's ``spec``."""
    shape, name = spec
    return (
        dtype == name
        and len(piece) == len(shape)
        and piece[:2] == shape[:2]
        and piece[3:] == shape[3:]
    )


def _alike_table_of(
    arrays: _Arrays,
    stored: np.ndarray,
    signed: np.ndarray,
    offsets: np.ndarray,
    bases: np.ndarray,
) -> np.ndarray | None:
    """The table of :func:`alike_table` and :func:`stacked_table`: ``arrays``, each
    array's pieces ``stored`` rows deep, ``signed[j, r]`` rows of record ``r`` read into
    array ``j`` from ``bases[r] + offsets[j]``; ``None`` where the rows read are fewer
    than none, more than stored, or more than an array holds."""
    head_stride = stored * arrays.row_bytes  # C order: batch, heads, rows
    batch_stride = arrays.heads * head_stride
    if signed.size and (signed.min() < 0 or np.any(signed > stored[:, None].astype(np.int64))):
        return None
    counts = signed.astype(np.uint64)
    if np.any(counts.sum(axis=1) > arrays.capacity):
        return None
    address = offsets[:, None] + bases[None, :]
    array, record = np.nonzero(counts)  # the pieces with rows, array by array, in order
    pieces = _Pieces(
        array,
        address[array, record],
        batch_stride[array],
        head_stride[array],
        counts[array, record],
    )
    return _table_of(pieces, arrays)[0]


def host_layout(
    pieces: Sequence[np.ndarray], shape: tuple[int, ...], name: str
) -> RowsLayout | None:
    """What :func:`segment_table` needs of the gather of ``pieces`` (``[B, H, rows,
    ...]`` host arrays, joined along rows) into a C-ordered ``shape`` array, zeros past
    their rows; ``None`` when they are not laid out for one (another dtype, other
    leading or trailing dims, rows that are not contiguous). Only what numpy cannot do for every
    piece at once is done per piece here (a lossy restore gathers 3,072 of them)."""
    itemsize = numpy_dtype(name).itemsize
    capacity = shape[2]
    row_bytes = math.prod(shape[3:]) * itemsize
    if any(type(piece) is not np.ndarray for piece in pieces):
        return None
    # A restore's pieces share a few layouts (one per tensor kind): each checked once
    # (:data:`_FITS`), one piece of each kind (dtypes by identity: equality ignores a
    # bfloat16 tag). Then comprehensions over all pieces, not a loop of statements per
    # piece: a lossy restore's 3,072 took 5.15 -> 4.6 ms here, most of it ``ctypes.data``.
    kinds = {(piece.shape, piece.strides, id(piece.dtype)): piece for piece in pieces}
    for piece in kinds.values():
        dtype = piece.dtype
        tag = dtype.metadata.get("dtype") if dtype.metadata else None
        key = (piece.shape, piece.strides, dtype, tag, shape, name)
        fits = _FITS.get(key)
        if fits is None:
            if len(_FITS) > 4096:  # bounded in a long process
                _FITS.clear()
            fits = _FITS[key] = _fits(piece, shape, name, itemsize)
        if not fits:
            return None
    kept = [piece for piece in pieces if piece.shape[2]]
    counts = [piece.shape[2] for piece in kept]
    if sum(counts) > capacity:
        return None
    return RowsLayout(
        [piece.ctypes.data for piece in kept],
        [piece.strides[0] for piece in kept],
        [piece.strides[1] for piece in kept],
        counts,
        shape[0],
        shape[1],
        capacity,
        row_bytes,
    )


def segment_table(layouts: Sequence[RowsLayout], offsets: Sequence[int]) -> np.ndarray:
    """The segments of every one of ``layouts``, array ``i`` written ``offsets[i]``
    bytes into the output: each piece's ``batch`` runs of ``heads`` rows, then each
    array's zeros past its rows (:func:`segment_tables` splits them by array)."""
    return segment_tables(layouts, offsets)[0]


def segment_tables(
    layouts: Sequence[RowsLayout], offsets: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`segment_table`, and which array each segment writes. Built by numpy for
    every piece at once: with the addresses turned by :class:`_DeviceTable`, a lossy
    restore's 3,072 pieces take 15.8 ms here against 20.9 ms built and turned one by
    one (1,024 lossless pieces: 9.2 against 11.1 ms); what is left is mostly reading
    each piece's address (``ctypes.data``, 2.8 us)."""
    u64 = np.uint64
    per = np.array([len(layout.counts) for layout in layouts], np.intp)  # pieces per array

    def column(values: Iterable[int]) -> np.ndarray:
        return np.fromiter(values, u64)

    def of_pieces(name: str) -> np.ndarray:  # every piece's own, in order
        return column(itertools.chain.from_iterable(getattr(lay, name) for lay in layouts))

    arrays = _Arrays(
        column(lay.batch for lay in layouts),
        column(lay.heads for lay in layouts),
        column(lay.capacity for lay in layouts),
        column(lay.row_bytes for lay in layouts),
        column(offsets[: len(layouts)]),  # a running sum's last (the end) may follow
    )
    pieces = _Pieces(
        np.repeat(np.arange(len(layouts)), per),
        of_pieces("addresses"),
        of_pieces("batch_strides"),
        of_pieces("head_strides"),
        of_pieces("counts"),
    )
    return _table_of(pieces, arrays)


class _Pieces(NamedTuple):
    """Every piece of a gather, grouped by array in order (uint64 but ``array``)."""

    array: np.ndarray  # which array the piece is joined into (ascending)
    address: np.ndarray
    batch_stride: np.ndarray
    head_stride: np.ndarray
    rows: np.ndarray  # rows it holds


class _Arrays(NamedTuple):
    """Every array of a gather (uint64): its shape's batch, heads and capacity, its row
    bytes, and where it is written in the output."""

    batch: np.ndarray
    heads: np.ndarray
    capacity: np.ndarray
    row_bytes: np.ndarray
    offset: np.ndarray


def _table_of(pieces: _Pieces, arrays: _Arrays) -> tuple[np.ndarray, np.ndarray]:
    """The segments that gather ``pieces`` into ``arrays`` (the kernel's layout: each
    piece's ``batch`` runs of ``heads`` rows, then each array's zeros past its rows), and
    which array each writes: the one home of that layout (:func:`segment_tables`,
    :func:`alike_table`)."""
    u64 = np.uint64
    per = np.bincount(pieces.array, minlength=len(arrays.batch))  # pieces per array
    ends = np.cumsum(per)
    before = np.concatenate([np.zeros(1, u64), np.cumsum(pieces.rows)])  # rows before each
    firsts = before[:-1] - np.repeat(before[ends - per], per)  # ... in its array
    # One segment per piece and batch row.
    times = arrays.batch[pieces.array].astype(np.intp)  # segments per piece
    which = np.repeat(np.arange(len(pieces.rows)), times)
    b = np.arange(len(which), dtype=u64) - np.repeat(np.cumsum(times) - times, times).astype(u64)
    j = pieces.array[which]
    row_bytes, heads = arrays.row_bytes[j], arrays.heads[j]
    rows_bytes = arrays.capacity[j] * row_bytes
    table = np.empty((len(which), SEGMENT_WORDS), u64)
    table[:, 0] = pieces.address[which] + b * pieces.batch_stride[which]
    table[:, 1] = pieces.head_stride[which]
    table[:, 2] = arrays.offset[j] + b * heads * rows_bytes + firsts[which] * row_bytes
    table[:, 3] = rows_bytes
    table[:, 4] = pieces.rows[which] * row_bytes
    table[:, 5] = heads
    # The zeros up to capacity, every (batch, head) row of them, of each array short of it.
    filled = before[ends] - before[ends - per]
    short = np.flatnonzero(filled < arrays.capacity)
    zeros = np.zeros((len(short), SEGMENT_WORDS), u64)
    zeros[:, 2] = (arrays.offset + filled * arrays.row_bytes)[short]
    zeros[:, 3] = (arrays.capacity * arrays.row_bytes)[short]
    zeros[:, 4] = ((arrays.capacity - filled) * arrays.row_bytes)[short]
    zeros[:, 5] = (arrays.batch * arrays.heads)[short]
    table = np.concatenate([table, zeros])
    single = table[:, 5] == 1  # one run: no pitch (which would cost the 16-byte copies)
    table[single, 1] = table[single, 3] = 0
    return table, np.concatenate([j, short])


#: Whether a piece of a layout (its shape, strides and dtype) fits a gather into
#: an array of a shape and dtype: :func:`_fits`, remembered.
_FITS: dict[tuple[Any, ...], bool] = {}


def _fits(piece: np.ndarray, shape: tuple[int, ...], name: str, itemsize: int) -> bool:
    """Whether ``piece``'s rows can be gathered into a ``shape`` array of ``name``."""
    return (
        piece.ndim == len(shape)
        and piece.shape[:2] == tuple(shape[:2])
        and piece.shape[3:] == tuple(shape[3:])
        and piece.itemsize == itemsize
        and dtype_name(piece) == name
        and _rows_contiguous(piece)
    )


def _rows_contiguous(piece: np.ndarray) -> bool:
    """Whether each (batch, head) run of ``piece``'s rows is one contiguous span."""
    step = piece.itemsize
    for axis in range(piece.ndim - 1, 1, -1):
        if piece.shape[axis] > 1 and piece.strides[axis] != step:
            return False
        step *= piece.shape[axis]
    return all(s >= 0 for s in piece.strides)
