"""A lossy restore's decode on the CPU: a block's layers converted in one go.

A restore under a lossy storage policy converts every stored layer of every block
into its cache's family (``kv:quant:8:64`` -> ``kv:plain``: ``mx.dequantize``). One
by one, that is a few MLX operations per (block, layer) piece, and MLX's CPU backend
spends tens of microseconds on each operation it schedules whatever its size: a
2048-token qwen-0.5B restore (8 blocks x 24 layers of 64 KiB pieces) spent ~75 ms
in them for 24 MiB of rows. So, as a GPU restore stacks its layers
(:func:`~kvstore.codecs.transcode.transcode_stacked`), a CPU restore stacks each
block's layers of one kind: their stored tensors copied into one array per name (the
stored bytes, smaller than the rows), converted by one decode, each layer's rows a
slice of it. A packed family's block decodes are built on the CPU's streams in turn
(:func:`~kvstore.cpu_streams.spread`), so that the restore's one evaluation runs them
on every core (TurboQuant's decode spreads its own waves). The conversion is
elementwise over the batch axis, so every layer's rows are the same bits as converted
alone.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TypeGuard

import numpy as np

from kvstore.abc.codec import Snapshot
from kvstore.codecs.arrays import as_mlx
from kvstore.codecs.transcode import transcode, transcode_stacked
from kvstore.cpu_streams import spread
from kvstore.signature import parse_signature

__all__ = ["MAX_VECTORS", "converted_by_block", "packed", "spread_packed"]

#: The most vectors (batch x heads x rows of a row tensor) one decode holds, so that
#: its float32 intermediates stay bounded (as the GPU's stacks:
#: ``restore.STACKED_DECODE_VECTORS``): ~512 MiB at head_dim 128.
MAX_VECTORS = 1 << 20


def converted_by_block(
    layers: list[list[Snapshot]], wanted: Callable[[int], str], recoded: Sequence[int]
) -> list[int]:
    """Layers of ``recoded`` (``layers[i]``: layer ``i``'s snapshot of each block, its
    tensors on the host) converted to family ``wanted(i)`` a block at a time, every
    layer of one kind (stored and wanted signature, and count of blocks) in one
    conversion per block, in place; the layers it could not convert so (returned, in
    order) are left as they were.

    Each block's decode goes to a CPU stream of its own only for a packed family (rows
    ``mx.quantize`` made, decoded by one ``mx.dequantize`` a tensor): TurboQuant's decode
    walks its rows in cache-sized waves over the streams itself. Stacked so, a
    2048-token restore under ``kv:turboquant`` took 641-692 ms against 660-744 one piece
    at a time (llama-8B, 4/4) and 81-87 against 114-133 (qwen-0.5B, 3/3)."""
    kinds: dict[tuple[str, str, int], list[int]] = {}
    for i in recoded:
        if layers[i]:
            kinds.setdefault((layers[i][0].signature, wanted(i), len(layers[i])), []).append(i)
    done: set[int] = set()
    for (stored, to_signature, blocks), which in kinds.items():
        if len(which) < 2:
            continue
        converted: list[list[Snapshot]] = []  # per block, the layers of `which` in order
        for k in range(blocks):
            with spread_packed(stored, k):
                got = _converted_block([layers[i][k] for i in which], to_signature)
            if got is None:
                break
            converted.append(got)
        else:
            for at, i in enumerate(which):
                layers[i] = [converted[k][at] for k in range(blocks)]
            done.update(which)
    return [i for i in recoded if i not in done]


def spread_packed(signature: str, index: int) -> AbstractContextManager[None]:
    """:func:`~kvstore.cpu_streams.spread` of ``index`` for the encode or decode of a
    packed family (:func:`packed`), on this thread; nothing for any other, whose work
    (TurboQuant's waves) spreads itself: spread again, a 2048-token save under
    ``kv:turboquant:4:4`` took longer (651-689 -> ~860 ms here)."""
    return spread(index) if packed(signature) else contextlib.nullcontext()


def packed(signature: str) -> bool:
    """Whether ``signature``'s family stores rows packed by ``mx.quantize`` (whose CPU
    encode and decode are one operation a tensor on one core: what is worth spreading
    over the CPU's streams, at a save too)."""
    return parse_signature(signature).family.attention != "dense"


def _converted_block(snaps: Sequence[Snapshot], to_signature: str) -> list[Snapshot] | None:
    """``snaps`` (one block's layers, alike) converted to ``to_signature``, in runs of
    at most :data:`MAX_VECTORS` vectors; ``None`` where they do not stack."""
    first = next(iter(snaps[0].tensors.values()), None)
    if not isinstance(first, np.ndarray) or first.ndim < 3:
        return None
    per_layer = max(1, math.prod(first.shape[:3]))
    run = max(1, MAX_VECTORS // per_layer)
    out: list[Snapshot] = []
    for at in range(0, len(snaps), run):
        part = snaps[at : at + run]
        if len(part) < 2:  # a last layer alone (a first one: nothing stacks)
            return out + [transcode(s, to_signature) for s in part] if out else None
        got = _stacked(part, to_signature)
        if got is None:
            return None
        out += got
    return out


def _stacked(snaps: Sequence[Snapshot], to_signature: str) -> list[Snapshot] | None:
    """``snaps`` converted by one :func:`transcode_stacked` over their tensors copied
    into one MLX array per name; ``None`` where their tensors are not host arrays of the
    first's names, shapes and dtypes (or :func:`transcode_stacked` finds them unlike)."""
    first = snaps[0]
    if any(s.tensors.keys() != first.tensors.keys() for s in snaps):
        return None
    wholes = {}
    for name, array in first.tensors.items():
        parts = [p for s in snaps if _alike(p := s.tensors.get(name), array)]
        if len(parts) != len(snaps):
            return None
        host = np.empty((len(parts) * array.shape[0], *array.shape[1:]), array.dtype)
        np.concatenate(parts, axis=0, out=host)
        wholes[name] = as_mlx(host)  # one copy into MLX's memory; the layers slice it
    batches = {name: array.shape[0] for name, array in first.tensors.items()}
    on_device = [
        Snapshot(
            s.signature,
            s.start,
            s.stop,
            {name: w[at * batches[name] : (at + 1) * batches[name]] for name, w in wholes.items()},
            s.meta,
        )
        for at, s in enumerate(snaps)
    ]
    return transcode_stacked(on_device, to_signature, wholes)


def _alike(part: object, array: np.ndarray) -> TypeGuard[np.ndarray]:
    """Whether ``part`` is a host array of ``array``'s shape and dtype (its tag too:
    bfloat16 words)."""
    return (
        isinstance(part, np.ndarray)
        and part.shape == array.shape
        and part.dtype == array.dtype
        and part.dtype.metadata == array.dtype.metadata
    )
