"""A lossless restore on the host, planned from the records' headers alone.

In the common case -- a model without sliding windows, every layer of every record
stored as its cache holds it (``kv:plain``, ``kv:quant``) -- each cache's arrays are
known from the headers: one per (layer, tensor name), every record's rows one after
another. So no snapshot, numpy view or row piece is made per (record, layer): the
arrays are allocated from the headers (:func:`~kvstore.codecs.fill.filled_arrays`),
and written one record at a time, a few copies per record where its tensors lie at
an even step and the arrays they go to too (a strided view over each), each record
hashed a chunk behind its copies for the store's checks
(:mod:`~kvstore.codecs.copied_sums`).

The general way (``restore._plans``, :func:`~kvstore.codecs.plans.run_plans`) made a
snapshot per (record, layer) and a numpy view and a Python step per row piece: 768
snapshots and 1536 pieces for an 8192-token qwen-0.5B restore, whose pieces of
64 KiB each are too small to copy and hash one by one
(:data:`~kvstore.codecs.record_copies.PIECE_MIN_BYTES`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kvstore.abc.codec import Snapshot
from kvstore.codecs.arrays import numpy_dtype
from kvstore.codecs.copied_sums import Claims
from kvstore.codecs.fill import common_alignment, filled_arrays
from kvstore.codecs.growing import GrowingKVCodec
from kvstore.codecs.header import LayerEntry, TensorEntry
from kvstore.codecs.payload_tensors import Payload, entries_by_name, numpy_view
from kvstore.codecs.plans import CachePlan, rooms_unwritten, write_rows
from kvstore.codecs.record_copies import RecordUnits

__all__ = ["restored_alike"]

#: The most bytes of a record one strided copy reads, and so the most hashed at once
#: behind it: still in the CPU's cache when hashed, and few Python steps a record.
#: An 8192-token qwen-0.5B restore (32 records of 48 tensors of 64 KiB) took 15.1-16.2
#: ms in runs of 256 KiB, 14.1 in runs of 1 MiB or 4 MiB, 17.3-18.0 in runs of 128 KiB;
#: a 2048-token llama-8B one (512 KiB tensors) 26.5-27.1 ms from 512 KiB to 2 MiB
#: (``python -m tools.bench.restore_python --cpu-route``).
RUN_MAX_BYTES = 1 << 20

#: What a placeholder piece views: nothing (zero strides).
_NOTHING = np.zeros(16, np.uint8)


def restored_alike(
    codec: GrowingKVCodec,
    layers: Sequence[Sequence[LayerEntry | None]],
    payloads: Sequence[Payload],
    rows: Sequence[int],
    claims: Claims | None,
) -> list[Any] | None:
    """One cache of ``codec`` per layer, from records whose headers' layers are
    ``layers`` (``layers[r][l]``: record ``r``'s layer ``l``, every one stored in
    ``codec``'s signature) and whose payloads are ``payloads``, restoring the first
    ``rows[r]`` rows of record ``r`` (a match cut inside its last block), the records
    one after another from token 0. ``None`` (nothing done) where they are not so:
    a layer missing, records that do not follow each other, tensors whose names,
    dtypes or shapes differ between records. ``claims``: the records' claims
    (their order is ``payloads``'), those claimed hashed as they are copied."""
    first = layers[0]
    width = len(first)
    starts, at = [], 0
    for entries, count in zip(layers, rows, strict=True):
        if len(entries) != width:
            return None
        for layer in entries:
            if layer is None or layer.start != at or layer.stop - layer.start < count:
                return None
        starts.append(at)
        at += count
    total = at
    shapes: dict[tuple[int, int], bool] = {}
    wants = [_entry(layer).tensors for layer in first]
    if not all(_alike(want, _entry(layer), shapes) for want, layer in zip(wants, first)):
        return None
    for entries in layers:
        for want, layer in zip(wants, entries, strict=True):
            tensors = _entry(layer).tensors
            # One header template's records share their layers' tuples: the same layout.
            if tensors is not want and not _alike(want, _entry(layer), shapes):
                return None
    found = _plans(codec, first, layers[-1], total)
    if found is None:
        return None
    plans, named = found
    specs = [leaf for plan in plans for leaf in plan.leaves]
    records = [(p.view, n, at) for p, n, at in zip(payloads, rows, starts, strict=True)]
    # The room past the rows is zeroed here only for caches that cannot take it unwritten.
    rooms = rooms_unwritten(plans)
    tails = [(k, total) for k, (shape, _) in enumerate(specs) if shape[2] > total and not rooms[k]]
    writes = _AlikeWrites(named, layers, records, tails, claims)

    def fill(k: int, target: np.ndarray) -> None:
        i, name = named[k]
        pieces = [
            numpy_view(p.view, entries_by_name(_entry(e[i]).tensors)[name])[:, :, :n]
            for e, p, n in zip(layers, payloads, rows, strict=True)
        ]
        write_rows(pieces, target)

    writes.claim()
    align = common_alignment(p.address for p in payloads)
    arrays = filled_arrays(specs, fill, units=writes, align=align)
    if claims is not None:
        claims.drop()
    caches, at = [], 0
    for plan in plans:
        n = len(plan.leaves)
        caches.append(plan.assemble(arrays[at : at + n], room_left=True))
        at += n
    return caches


def _plans(
    codec: GrowingKVCodec,
    first: Sequence[LayerEntry | None],
    last: Sequence[LayerEntry | None],
    total: int,
) -> tuple[list[CachePlan], list[tuple[int, str]]] | None:
    """The plan of each layer (:func:`_plan`; one reusable plan for the layers laid out
    alike, of the same meta: a plan is ~11 us, 0.27 ms of a 24-layer qwen-0.5B
    restore), and each array's layer and tensor name; ``None`` where a layer cannot be
    planned so. ``first``/``last``: the first and last records' layers."""
    plans: list[CachePlan] = []
    named: list[tuple[int, str]] = []
    reusable: list[tuple[Any, Any, CachePlan, list[str]]] = []  # (layout, meta, plan, names)
    for i, layer in enumerate(first):
        entry, meta = _entry(layer), _entry(last[i]).meta
        layout = (
            entry.signature,
            [(t.name, t.dtype, t.shape[:2], t.shape[3:]) for t in entry.tensors],
        )
        same = next((r for r in reusable if r[0] == layout and r[1] == meta), None)
        if same is not None:
            plan, names = same[2], same[3]
        else:
            made, names = _plan(codec, entry, meta, total)
            if made is None:
                return None
            plan = made
            if plan.reusable:
                reusable.append((layout, meta, plan, names))
        plans.append(plan)
        named += [(i, name) for name in names]
    return plans, named


def _entry(layer: LayerEntry | None) -> LayerEntry:
    assert layer is not None  # restored_alike checked every layer first
    return layer


def _alike(
    want: Sequence[TensorEntry], layer: LayerEntry, checked: dict[tuple[int, int], bool]
) -> bool:
    """Whether ``layer``'s tensors are ``want``'s (names, dtypes, shapes but the rows,
    in order), each holding the layer's rows; asked once per pair of tuples (the
    records of one header template share them)."""
    tensors = layer.tensors
    key = (id(want), id(tensors))
    found = checked.get(key)
    if found is None:
        stored = layer.stop - layer.start
        found = checked[key] = len(tensors) == len(want) and all(
            t.name == w.name
            and t.dtype == w.dtype
            and len(t.shape) == len(w.shape) > 2
            and t.shape[:2] == w.shape[:2]
            and t.shape[3:] == w.shape[3:]
            and t.shape[2] == stored
            for t, w in zip(tensors, want, strict=False)
        )
    return found


def _plan(
    codec: GrowingKVCodec, layer: LayerEntry, meta: Any, total: int
) -> tuple[CachePlan | None, list[str]]:
    """``codec``'s plan of a layer of ``total`` rows laid out as ``layer``'s tensors,
    of ``meta`` (the last record's layer's, as a restore of its snapshots reads it),
    made from a snapshot of placeholders; and the tensor name of each of its arrays,
    in order. The plan depends on nothing else: a reusable one serves every layer
    laid out alike, of the same meta."""
    placeholders: dict[int, str] = {}
    tensors = {}
    for t in layer.tensors:
        shape = (*t.shape[:2], total, *t.shape[3:])
        piece = np.ndarray(shape, numpy_dtype(t.dtype), _NOTHING, 0, (0,) * len(shape))
        placeholders[id(piece)] = t.name
        tensors[t.name] = piece
    plan = codec.plan_restore(Snapshot(layer.signature, 0, total, tensors, meta))
    names = []
    for join, column in plan.columns():
        pieces = join.columns[column]
        if len(pieces) != 1 or id(pieces[0]) not in placeholders:
            return None, []
        names.append(placeholders[id(pieces[0])])
    return plan, names


# One strided copy of a record: its first array and how many, the byte step between
# their tensors in the payload, and a writable view over their arrays ([count, *shape]).
_Run = tuple[int, int, int, np.ndarray]


class _AlikeWrites(RecordUnits):
    """Record ``k`` copied by a few strided copies per header template, and hashed
    behind them when claimed (:class:`~kvstore.codecs.record_copies.RecordUnits`)."""

    def __init__(
        self,
        named: Sequence[tuple[int, str]],
        layers: Sequence[Sequence[LayerEntry | None]],
        records: Sequence[tuple[memoryview, int, int]],
        tails: Sequence[tuple[int, int]],
        claims: Claims | None,
    ) -> None:
        super().__init__(claims, len(records), tails)
        #: Each array's layer and tensor name; each record's layers; each record's
        #: payload, rows and first row.
        self._named, self._layers, self._records = named, layers, records
        self._layouts: dict[tuple[int, ...], tuple[list[TensorEntry], list[_Run]]] = {}
        self._lock = threading.Lock()

    def _copy(self, k: int, targets: Sequence[np.ndarray]) -> None:
        entries, runs = self._layout(k, targets)
        payload, count, start = self._records[k]
        hasher = self._hasher(k)
        done = 0  # bytes of the payload hashed
        for first, many, step, target in runs:
            entry = entries[first]
            shape = (*entry.shape[:2], count, *entry.shape[3:])
            dtype = numpy_dtype(entry.dtype)
            strides = _strides(entry.shape, dtype.itemsize)
            source = np.ndarray((many, *shape), dtype, payload, entry.offset, (step, *strides))
            target[:, :, :, start : start + count] = source
            end = entries[first + many - 1].offset + entries[first + many - 1].nbytes
            if hasher is not None and end - done >= RUN_MAX_BYTES:
                hasher.update(payload[done:end])  # just copied: still in the cache
                done = end
        self._resolve(k, hasher, payload[done:])

    def _layout(
        self, record: int, targets: Sequence[np.ndarray]
    ) -> tuple[list[TensorEntry], list[_Run]]:
        """Record ``record``'s tensor of each array, and its strided copies: found once
        per header template (whose records share their layers' tuples of tensors)."""
        layers = self._layers[record]
        key = tuple(id(_entry(layer).tensors) for layer in layers)
        found = self._layouts.get(key)
        if found is None:
            with self._lock:
                found = self._layouts.get(key)
                if found is None:
                    entries = [
                        entries_by_name(_entry(layers[i]).tensors)[name] for i, name in self._named
                    ]
                    found = self._layouts[key] = (entries, _runs(entries, targets))
        return found


def _strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """A contiguous array's strides."""
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def _runs(entries: list[TensorEntry], targets: Sequence[np.ndarray]) -> list[_Run]:
    """``entries`` (array ``k``'s tensor in a record) cut into runs in payload order:
    arrays whose tensors follow at one byte step in the payload, alike, going to arrays
    alike at one step in memory; each run at most :data:`RUN_MAX_BYTES` (one array at
    least), so its bytes are still in the cache when hashed."""
    order = sorted(range(len(entries)), key=lambda k: entries[k].offset)
    addresses = [int(t.ctypes.data) for t in targets]
    runs: list[_Run] = []
    i = 0
    while i < len(order):
        k = order[i]
        entry, target = entries[k], targets[k]
        limit = max(1, RUN_MAX_BYTES // max(1, entry.nbytes))
        j = i + 1
        step = entries[order[j]].offset - entry.offset if j < len(order) else 0
        gap = addresses[order[j]] - addresses[k] if j < len(order) else 0
        while j < len(order) and j - i < limit and step > 0 and gap > 0:
            other = entries[order[j]]
            there = targets[order[j]]
            if not (
                order[j] == k + (j - i)
                and other.offset - entry.offset == (j - i) * step
                and addresses[order[j]] - addresses[k] == (j - i) * gap
                and other.shape == entry.shape
                and other.dtype == entry.dtype
                and there.shape == target.shape
                and there.strides == target.strides
                and there.dtype == target.dtype
            ):
                break
            j += 1
        many = j - i
        view = as_strided(
            target,
            (many, *target.shape),
            (gap if many > 1 else 0, *target.strides),
            writeable=True,
        )
        runs.append((k, many, step if many > 1 else 0, view))
        i = j
    return runs
