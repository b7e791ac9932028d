"""Row pieces that lie in device buffers joined into arrays of their own, many to a kernel.

A lossy restore on a CUDA GPU decodes every layer's rows at once, into one array per
tensor name (:func:`~kvstore.codecs.transcode.transcode_stacked`); each layer's piece
is a slice of it. A cache must own its buffer, with room past its rows for the next
steps (an update of a shared buffer copies the whole array every step), so each
joined array is written anew: the pieces in order, zeros to capacity. As a
concatenation and a zero fill per array that was ~128 nodes of the CUDA graph a fresh
process instantiates for a 32-layer restore; here it is one kernel per
:data:`~kvstore.codecs.cuda.GATHER_OUTPUTS` arrays
(:meth:`~kvstore.codecs.cuda.Transport.assemble_many`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from kvstore.codecs import cuda
from kvstore.codecs.arrays import MLX_DTYPES, byte_view
from kvstore.codecs.fill import LeafSpec

__all__ = ["Placed", "joined"]

#: A row piece ``[B, H, rows, ...]``, the contiguous device array it lies in, and the
#: byte of that array where it starts (its rows one after another from there).
Placed = tuple[mx.array, mx.array, int]


#: One segment as it is planned: the buffer it reads (``None``: zeros) and the byte there,
#: then ``src_pitch, dst_offset, dst_pitch, width, height`` as the kernel reads them.
_Planned = tuple["mx.array | None", int, int, int, int, int, int]


def joined(specs: Sequence[LeafSpec], columns: Sequence[Sequence[Placed]]) -> list[mx.array] | None:
    """Lazy device arrays of ``specs`` (``[B, H, capacity, ...]``), array ``i`` the pieces
    of ``columns[i]`` one after another along axis 2, zeros after them; ``None`` (nothing
    made) where a piece's batch, heads, trailing shape or dtype is not its array's, the
    pieces hold more rows than it has room for, or one array reads more buffers than a
    kernel takes."""
    tables = []
    for (shape, name), pieces in zip(specs, columns, strict=True):
        table = _segments(shape, name, pieces)
        if table is None:
            return None
        tables.append(table)
    made: list[mx.array] = []
    first = 0
    while first < len(specs):
        last, buffers = _batch(columns, first)
        if last == first:
            return None
        number = {id(buffer): n for n, buffer in enumerate(buffers)}
        words: list[int] = []
        for output in range(first, last):
            for buffer, at, src_pitch, offset, pitch, width, height in tables[output]:
                # The buffer's number + 1 above the offset into it; the output's above
                # the offset into that.
                src = (
                    0
                    if buffer is None
                    else (number[id(buffer)] + 1) << cuda.ASSEMBLE_OFFSET_BITS | at
                )
                dst = (output - first) << cuda.OUTPUT_OFFSET_BITS | offset
                words += [src, src_pitch, dst, pitch, width, height]
        params = np.array([len(words) // cuda.SEGMENT_WORDS, *words], np.uint64)
        sizes = [cuda.nbytes_of(spec) for spec in specs[first:last]]
        flat = [byte_view(buffer) for buffer in buffers]
        made.extend(cuda.transport().assemble_many(params, flat, sizes))
        first = last
    return [
        array.view(MLX_DTYPES[name]).reshape(shape)
        for array, (shape, name) in zip(made, specs, strict=True)
    ]


def _segments(shape: tuple[int, ...], name: str, pieces: Sequence[Placed]) -> list[_Planned] | None:
    """The segments that write one array: each piece's rows, then zeros to capacity."""
    if len(shape) < 3:
        return None
    heads = shape[0] * shape[1]
    dtype = MLX_DTYPES[name]
    row_bytes = math.prod(shape[3:]) * dtype.size
    pitch = shape[2] * row_bytes
    lead, trail = tuple(shape[:2]), tuple(shape[3:])
    table: list[_Planned] = []
    rows = 0
    for piece, buffer, start in pieces:
        # Each piece's shape read once, its dtype compared as an object: a lossy restore
        # plans 64 such arrays after its gather (0.8 ms of its thread on the H200).
        got = tuple(piece.shape)
        if len(got) != len(shape) or got[:2] != lead or got[3:] != trail or piece.dtype != dtype:
            return None
        width = got[2] * row_bytes
        if start + heads * width > buffer.nbytes:  # the piece's bytes: heads x width
            return None
        if width:
            table.append((buffer, start, width, rows * row_bytes, pitch, width, heads))
        rows += got[2]
    if rows > shape[2]:
        return None
    if rows < shape[2]:
        table.append((None, 0, 0, rows * row_bytes, pitch, pitch - rows * row_bytes, heads))
    return table


def _batch(columns: Sequence[Sequence[Placed]], first: int) -> tuple[int, list[mx.array]]:
    """Where the kernel that starts at array ``first`` stops (at most
    :data:`~kvstore.codecs.cuda.GATHER_OUTPUTS` arrays, reading at most
    :data:`~kvstore.codecs.cuda.ASSEMBLE_INPUTS` buffers), and the buffers it reads."""
    buffers: dict[int, mx.array] = {}
    last = first
    while last < len(columns) and last - first < cuda.GATHER_OUTPUTS:
        new = {id(b): b for _, b, _ in columns[last] if id(b) not in buffers}
        if len(buffers) + len(new) > cuda.ASSEMBLE_INPUTS:
            break
        buffers.update(new)
        last += 1
    return last, list(buffers.values())
