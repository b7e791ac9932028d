"""A lossy restore's joins when every layer reads the same records laid out alike: made
per tensor name, not per (layer, name).

A restore on a CUDA GPU joins each lossy layer's rows across its records before decoding
them (:func:`~kvstore.codecs.plans.join_runs`). In the common case -- a model without
sliding windows, its records written by one save, so one header template -- every layer
is one run over the same records, each layer's tensors at their own offsets but of the
same names, shapes and dtypes. Then the joins of one name in every layer are one array
stacked along the batch axis (``[layers x B, H, rows, ...]``), the very array the stacked
decode reads (:func:`~kvstore.codecs.transcode.transcode_stacked`), and they are made as
that: one spec per name, one segment table for all of them, each layer's join a slice of
its name's stack. ``join_runs`` made a join object, a spec, a layout row, a view and a
stack entry per (layer, name) -- 128 of each for TurboQuant on llama-8B -- and compared
each layer's records on their own: 1.44 ms of the restoring thread on the CI VM for
4096 tokens (``python -m tools.bench.restore_python --policy kv:turboquant:4:4
--session --no-checks``), where the restoring thread's Python is what G2 measures on the
H200.

Two ways in, the same joins:

* :func:`joined_records` from the records' headers alone, when every layer of every
  record is there and lossy: no snapshot per (record, layer) is made at all (512 of
  them, and their tensor mappings, in that restore);
* :func:`joined_alike` from each layer's snapshots (a model whose other layers are
  stored as they are), returning what ``join_runs`` would.

Each returns ``None`` (nothing done) where the layers are not all so, and the caller
joins them as they are; and always with ``KVSTORE_ALIKE_JOINS=0`` (:data:`ALIKE_JOINS`:
the route before it, for an A/B on the device).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any, cast

import mlx.core as mx

from kvstore.abc.codec import Snapshot
from kvstore.codecs import cuda, cuda_pages, gather_tables, one_buffer
from kvstore.codecs.arrays import MLX_DTYPES
from kvstore.codecs.fill import LeafSpec
from kvstore.codecs.header import LayerEntry, TensorEntry
from kvstore.codecs.payload_tensors import Payload, PayloadTensors, entries_by_name
from kvstore.codecs.plans import Stack, alike_row_names, rows_read
from kvstore.knobs import switch_from_env

__all__ = ["joined_alike", "joined_records"]

#: Whether the joins are made per tensor name where they can be (the default), or always
#: per (layer, name) by :func:`~kvstore.codecs.plans.join_runs` (``KVSTORE_ALIKE_JOINS=0``).
ALIKE_JOINS = switch_from_env("KVSTORE_ALIKE_JOINS")

_TENSORS = attrgetter("tensors")
_PAYLOAD = attrgetter("payload")
_ROWS = attrgetter("rows")
_ENTRIES = attrgetter("entries")
_START = attrgetter("start")
_STOP = attrgetter("stop")
_META = attrgetter("meta")
_SIGNATURE = attrgetter("signature")


def joined_records(
    layers: Sequence[Sequence[LayerEntry | None]],
    payloads: Sequence[Payload],
    cuts: Sequence[int | None],
    pages: cuda_pages.PinnedPages | None,
    stacks: list[Stack],
) -> list[list[Snapshot]] | None:
    """Each layer's rows of every record joined into one snapshot, from the records'
    headers: ``layers[r]`` record ``r``'s header's layers, its payload ``payloads[r]``,
    its first ``cuts[r]`` rows read (``None``: all), the records one after another. As
    :func:`joined_alike` of the snapshots a decode of them would make (a layer's
    signature its first record's, its meta its last's), when every layer of every
    record is there, all layers of a record cover one range, and each layer is
    described alike (tensors, meta, signature) in every record; else ``None``."""
    if not ALIKE_JOINS or pages is None or not layers or not cuda.available():
        return None
    first = layers[0]
    if not first or any(entry is None for entry in first):
        return None
    entries = cast(Sequence[LayerEntry], first)
    tensors, metas = list(map(_TENSORS, entries)), list(map(_META, entries))
    signatures = list(map(_SIGNATURE, entries))
    starts, stops = [], []
    for record in layers:  # each a few C loops over its layers, no loop per (record, layer)
        if len(record) != len(entries) or None in record:
            return None
        start, stop = record[0].start, record[0].stop  # type: ignore[union-attr]
        count = len(record)
        if (
            list(map(_TENSORS, record)) != tensors
            or list(map(_META, record)) != metas
            or list(map(_SIGNATURE, record)) != signatures
            or list(map(_START, record)) != [start] * count
            or list(map(_STOP, record)) != [stop] * count
        ):
            return None
        starts.append(start)
        stops.append(stop)
    # The rows each record gives: a cut one ends where its cut does.
    ends = [
        stop if c is None else min(start + c, stop)
        for start, stop, c in zip(starts, stops, cuts, strict=True)
    ]
    if starts[1:] != ends[:-1]:  # not one run
        return None
    by_name = [entries_by_name(t) for t in tensors]
    joined = _joined(by_name, payloads, cuts, starts, ends, pages, stacks)
    if joined is None:
        return None
    out = []
    for i, cut in enumerate(joined):
        made: Mapping[str, Any] = cut
        if len(cut) < len(by_name[i]):  # the first record's other tensors, as a decode has them
            head = PayloadTensors(payloads[0], tensors[i], cuts[0])
            made = {n: cut[n] if n in cut else head[n] for n in head}
        out.append([Snapshot(signatures[i], starts[0], ends[-1], made, metas[i])])
    return out


def joined_alike(
    layers: Sequence[Sequence[Snapshot]],
    pages: cuda_pages.PinnedPages | None,
    stacks: list[Stack],
) -> list[list[Snapshot]] | None:
    """Each layer's snapshots joined into one, as :func:`~kvstore.codecs.plans.join_runs`
    joins them, when every layer is one run of consecutive snapshots described in the
    same records (:class:`~kvstore.codecs.payload_tensors.PayloadTensors` of the same
    payloads, the same cuts and ranges), each layer laid out alike across them (one
    header template) and its row tensors of the same names, shapes and dtypes as every
    other layer's; their rows gathered by the GPU from ``pages`` in one go. ``stacks``
    gets each name's stack of every layer's join (where they lie one after another with
    nothing between). ``None`` (nothing done) otherwise."""
    if not ALIKE_JOINS or pages is None or not layers or not cuda.available():
        return None
    first = layers[0]
    found = list(map(_TENSORS, first))
    if not found or any(type(t) is not PayloadTensors for t in found):
        return None
    described = cast(list[PayloadTensors], found)
    payloads, cuts = list(map(_PAYLOAD, described)), list(map(_ROWS, described))
    starts, stops = list(map(_START, first)), list(map(_STOP, first))
    if starts[1:] != stops[:-1]:  # not one run
        return None
    entries: list[Mapping[str, TensorEntry]] = []
    for layer in layers:
        tensors = described if layer is first else _same_records(layer, payloads, cuts, starts)
        if tensors is None:
            return None
        each = list(map(_ENTRIES, tensors))
        if each.count(each[0]) != len(each):  # compared by identity first
            return None
        entries.append(each[0])
    joined = _joined(entries, payloads, cuts, starts, stops, pages, stacks)
    if joined is None:
        return None
    out = []
    for layer, cut in zip(layers, joined, strict=True):
        head, last = layer[0], layer[-1]
        # The first snapshot's other tensors (a rotation carried by it, say): its views.
        made = {n: cut[n] if n in cut else head.tensors[n] for n in head.tensors}
        out.append([Snapshot(head.signature, head.start, last.stop, made, last.meta)])
    return out


def _joined(
    entries: Sequence[Mapping[str, TensorEntry]],
    payloads: Sequence[Payload],
    cuts: Sequence[int | None],
    starts: Sequence[int],
    stops: Sequence[int],
    pages: cuda_pages.PinnedPages,
    stacks: list[Stack],
) -> list[dict[str, mx.array]] | None:
    """Each layer's row tensors joined across the records, by name: layer ``i`` laid out
    as ``entries[i]`` in every one of ``payloads``, record ``r`` read up to ``cuts[r]``
    rows over ``[starts[r], stops[r])``. ``None`` where a layer's row tensors differ in
    names, shapes or dtypes from the first's, or the GPU cannot gather them. ``stacks``
    gets each name's stack of every layer's join where they lie with nothing between."""
    ranges = tuple(zip(cuts, (b - a for a, b in zip(starts, stops, strict=True)), strict=True))
    names = alike_row_names(entries[0], ranges, {})
    if not names:
        return None
    kinds = [(entries[0][n].shape, entries[0][n].dtype) for n in names]
    for laid_out in entries[1:]:  # every layer's row tensors of the same kinds
        if [n for n in names if n in laid_out] != names:
            return None
        if [(laid_out[n].shape, laid_out[n].dtype) for n in names] != kinds:
            return None
    flat_made = _gathered(entries, names, kinds, payloads, cuts, stops[-1] - starts[0], pages)
    if flat_made is None:
        return None
    flat, specs, begins = flat_made
    count = len(entries)
    joined: list[dict[str, mx.array]] = [{} for _ in entries]
    for name, (shape, dtype), begin in zip(names, specs, begins, strict=True):
        nbytes = cuda.nbytes_of((shape, dtype))
        mlx_dtype = MLX_DTYPES[dtype]
        if nbytes % 16 == 0:  # one after another: the stack, and each layer's join of it
            whole = flat[begin : begin + count * nbytes].view(mlx_dtype)
            whole = whole.reshape((count * shape[0], *shape[1:]))
            batch = shape[0]
            members = [whole[i * batch : (i + 1) * batch] for i in range(count)]
            if count > 1:
                stacks.append(Stack(whole, tuple(members)))
        else:  # padding between them: a view each, no stack
            step = one_buffer.padded_nbytes((shape, dtype))
            members = [
                flat[at : at + nbytes].view(mlx_dtype).reshape(shape)
                for at in range(begin, begin + count * step, step)
            ]
        for cut, member in zip(joined, members, strict=True):
            cut[name] = member
    return joined


def _same_records(
    layer: Sequence[Snapshot],
    payloads: list[Payload],
    cuts: list[int | None],
    starts: list[int],
) -> list[PayloadTensors] | None:
    """``layer``'s snapshots' tensors when they are described in ``payloads``, cut to
    ``cuts``, over the ranges starting at ``starts`` (the first layer's); else ``None``."""
    tensors = list(map(_TENSORS, layer))
    if len(tensors) != len(payloads) or any(type(t) is not PayloadTensors for t in tensors):
        return None
    if (
        list(map(_PAYLOAD, tensors)) == payloads
        and list(map(_ROWS, tensors)) == cuts
        and list(map(_START, layer)) == starts
    ):
        return cast(list[PayloadTensors], tensors)
    return None


def _gathered(
    entries: Sequence[Mapping[str, TensorEntry]],
    names: Sequence[str],
    kinds: Sequence[tuple[tuple[int, ...], str]],
    payloads: Sequence[Payload],
    cuts: Sequence[int | None],
    capacity: int,
    pages: cuda_pages.PinnedPages,
) -> tuple[mx.array, list[LeafSpec], list[int]] | None:
    """Every layer's join of each of ``names`` gathered into one lazy uint8 device array:
    name by name, layer by layer (``capacity`` rows each); with each name's spec (one
    layer's join) and where its first layer's lies. ``None`` where the gather cannot."""
    count = len(entries)
    specs: list[LeafSpec] = [((*s[:2], capacity, *s[3:]), dtype) for s, dtype in kinds]
    rows = gather_tables.StackedRows(
        [p.address for p in payloads],
        [[laid_out[n].offset for laid_out in entries] for n in names],
        [s for s, _ in kinds],
        [dtype for _, dtype in kinds],
        [rows_read(cuts, s[2]) for s, _ in kinds],
    )
    table = gather_tables.stacked_table(rows, specs)
    if table is None:
        return None
    # The gather sizes its output from its arrays' specs: a kind's arrays as one stack
    # where they lie with nothing between them (the same bytes; 4 specs, not 128).
    sized = [
        spec_
        for spec in specs
        for spec_ in (
            [((count * spec[0][0], *spec[0][1:]), spec[1])]
            if cuda.nbytes_of(spec) % 16 == 0
            else [spec] * count
        )
    ]
    flat = cuda_pages.gathered_flat(sized, table, pages, lazy=True)
    if flat is None:
        return None
    steps = [one_buffer.padded_nbytes(spec) * count for spec in specs]
    return flat, specs, list(itertools.accumulate(steps, initial=0))[:-1]
