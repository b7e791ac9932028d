"""Restores in two steps: plan every layer, then allocate all arrays at once and fill them.

An MLX evaluation is a round trip to the stream's worker thread, tens of
microseconds on a busy CPU: allocating each layer's arrays with its own
evaluation costs more than copying a small model's rows. So a codec first
*plans* a restore (:meth:`~kvstore.abc.codec.KVCodec.plan_restore`: checks the
snapshots, lays out the rows, names the arrays it needs), then
:func:`run_plans` allocates the arrays of every plan in one evaluation and
each plan copies its rows in and builds its cache.

Rows in host memory (store pages) are written once into the arrays
(:func:`~kvstore.codecs.fill.filled_arrays`: straight into MLX's buffers on
the CPU, through pinned staging on a CUDA GPU), or, on a CUDA GPU, read by
the GPU out of the store's pages (:mod:`~kvstore.codecs.cuda_pages`). Rows that are already MLX
arrays on a GPU (decoded there from a lossy record) are joined there, by one
concatenation per array: bringing them to the host would cost two trips over
the bus.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import numpy as np

from kvstore.abc.codec import RestorePlan, Snapshot
from kvstore.caches.base import Tree
from kvstore.codecs import cuda, cuda_pages, device_joins, gather_tables, one_buffer
from kvstore.codecs.arrays import MLX_DTYPES, as_numpy_all, dtype_name, owned_arrays
from kvstore.codecs.copied_sums import Claims
from kvstore.codecs.fill import LeafSpec, filled_arrays
from kvstore.codecs.header import TensorEntry
from kvstore.codecs.payload_tensors import PayloadTensors, same_entries, stored
from kvstore.codecs.record_copies import record_writes

__all__ = [
    "Tree",
    "LeafSpec",
    "row_leaves_of",
    "RowsJoin",
    "CachePlan",
    "as_device",
    "rooms_unwritten",
    "run_plans",
    "join_runs",
    "Stack",
    "members_of",
    "alike_row_names",
    "rows_read",
]


def row_leaves_of(tree: Tree) -> tuple[Any, ...]:
    """The arrays of a row tree (a bare array or a tuple of them)."""
    return tuple(tree) if isinstance(tree, (tuple, list)) else (tree,)


class RowsJoin:
    """Row pieces to concatenate along tokens into fresh arrays of ``capacity`` rows.

    Each leaf of the result is allocated once (zero-filled past the pieces)
    and every piece is copied straight into it: one copy from wherever the
    pieces live (numpy views into store pages, or MLX arrays).

    Raises:
        ValueError: the pieces hold more rows than ``capacity``.
    """

    def __init__(self, pieces: Sequence[Tree], capacity: int) -> None:
        self.is_tuple = isinstance(pieces[0], tuple)
        #: One list per leaf (``keys`` or ``q``/``scales``/``biases``): its pieces in order.
        if any(isinstance(piece, (tuple, list)) for piece in pieces):
            leaves = zip(*map(row_leaves_of, pieces), strict=True)
            self.columns = [list(column) for column in leaves]
        else:  # bare arrays (a lossy restore's 3,072 pieces): one column, no tuples made
            self.columns = [list(pieces)]
        rows = sum(int(p.shape[2]) for p in self.columns[0])
        if rows > capacity:
            raise ValueError(f"[join_rows] {rows} rows do not fit a capacity of {capacity}.")
        self.capacity = capacity
        #: The rows the pieces hold (the rest of ``capacity`` is room).
        self.rows = rows
        self._leaves: list[LeafSpec] | None = None
        #: Each column's pieces that are MLX arrays, found once (a lossy restore asks
        #: :meth:`lazy` and :meth:`holds_mlx` of 192 joins of 16 pieces).
        self._mlx = [[p for p in column if isinstance(p, mx.array)] for column in self.columns]

    def leaves(self) -> list[LeafSpec]:
        if self._leaves is None:
            self._leaves = [
                ((*c[0].shape[:2], self.capacity, *c[0].shape[3:]), _joined_dtype(c))
                for c in self.columns
            ]
        return self._leaves

    def lazy(self) -> list[mx.array]:
        """Pieces that are unevaluated MLX arrays (to evaluate before :meth:`fill`)."""
        return [leaf for column in self._mlx for leaf in column]

    def holds_mlx(self, column: int) -> bool:
        """Whether any piece of leaf ``column`` is an MLX array (not host memory)."""
        return bool(self._mlx[column])

    def join_on_device(self, column: int) -> mx.array:
        """Leaf ``column`` as one lazy MLX array: the pieces concatenated, zeros to
        capacity (the rows never leave the device the pieces are on)."""
        shape, name = self.leaves()[column]
        dtype = MLX_DTYPES[name]
        pieces = [as_device(piece).astype(dtype) for piece in self.columns[column]]
        rows = sum(int(p.shape[2]) for p in pieces)
        # Zeros to capacity, and a concatenation even when they are no rows: a lone
        # piece may be a view into a record's device buffer, and the cache must own
        # its buffer (an update of a shared one copies the whole array every step).
        pieces.append(mx.zeros((*shape[:2], self.capacity - rows, *shape[3:]), dtype))
        return mx.concatenate(pieces, axis=2)

    def fill_leaf(self, column: int, target: np.ndarray) -> None:
        """Write leaf ``column`` into ``target`` (uninitialised memory of
        :meth:`leaves`' shape): the pieces in order, then zeros up to capacity."""
        write_rows(self.host_views(column), target)

    def host_views(self, column: int) -> list[np.ndarray]:
        """Numpy views of leaf ``column``'s pieces (MLX ones evaluated here)."""
        return as_numpy_all(self.columns[column])

    def tree(self, arrays: Sequence[mx.array]) -> Tree:
        """The joined row tree, given the filled arrays of :meth:`leaves`."""
        return tuple(arrays) if self.is_tuple else arrays[0]

    def fill(self, buffers: Sequence[tuple[mx.array, np.ndarray]]) -> Tree:
        """Copy the pieces into ``buffers`` (from :func:`owned_arrays` of :meth:`leaves`)."""
        for column, (_, target) in enumerate(buffers):
            self.fill_leaf(column, target)
        return self.tree([array for array, _ in buffers])


def _joined_dtype(column: Sequence[Any]) -> str:
    """The dtype a column's pieces join into: theirs, or float32 for float16 + float32.

    Raises:
        ValueError: pieces of dtypes that do not widen into one another.
    """
    first = column[0].dtype
    if all(piece.dtype is first for piece in column):  # one dtype object: one name
        return dtype_name(column[0])
    names = {dtype_name(piece) for piece in column}
    if len(names) == 1:
        return names.pop()
    if names == {"float16", "float32"}:
        return "float32"
    raise ValueError(f"[join_rows] Row pieces of dtypes {sorted(names)} do not join.")


@dataclass(frozen=True)
class CachePlan:
    """A restore checked and laid out: the joins of its rows and how to build the cache.

    Attributes:
        joins: the row trees to assemble (keys, values...).
        build: ``build(trees)`` -> the live cache, given each join's result.
        reusable: ``build`` makes a new cache each call, from nothing but ``trees``
            and what the plan's snapshots described: one plan then assembles every
            layer whose snapshots it would plan alike
            (:mod:`~kvstore.codecs.host_alike`).
        room_unwritten: ``build``'s cache can take its buffers' rows past the joined
            ones unwritten (:class:`~kvstore.caches.base.UnwrittenRoom`: a growing cache,
            a ring not yet full).
    """

    joins: Sequence[RowsJoin]
    build: Callable[[list[Tree]], Any]
    reusable: bool = False
    room_unwritten: bool = False

    @property
    def leaves(self) -> list[LeafSpec]:
        return [leaf for join in self.joins for leaf in join.leaves()]

    def lazy(self) -> list[mx.array]:
        return [a for join in self.joins for a in join.lazy()]

    def columns(self) -> list[tuple[RowsJoin, int]]:
        """``(join, column)`` of each array of :attr:`leaves`, in order."""
        return [(join, column) for join in self.joins for column in range(len(join.columns))]

    def assemble(self, arrays: Sequence[mx.array], room_left: bool = False) -> Any:
        """The cache, given the filled arrays of :attr:`leaves`, in order. ``room_left``:
        the writes left the rows past the joined ones unwritten where the plan's cache
        takes them so (:attr:`room_unwritten`, :func:`rooms_unwritten`)."""
        trees, at = [], 0
        for join in self.joins:
            n = len(join.columns)
            trees.append(join.tree(arrays[at : at + n]))
            at += n
        cache = self.build(trees)
        if room_left and self.room_unwritten:
            cache.leave_unwritten(self.joins[0].rows)
        return cache

    def finish(self, buffers: Sequence[tuple[mx.array, np.ndarray]]) -> Any:
        for (join, column), (_, target) in zip(self.columns(), buffers, strict=True):
            join.fill_leaf(column, target)
        return self.assemble([array for array, _ in buffers])


def rooms_unwritten(plans: Sequence[Any]) -> list[bool]:
    """For each leaf of ``plans``' :class:`CachePlan` ones, in order: whether its cache
    takes the rows past the joined ones unwritten (a host restore then skips their
    zeros)."""
    return [
        plan.room_unwritten for plan in plans if isinstance(plan, CachePlan) for _ in plan.columns()
    ]


def as_device(piece: Any) -> mx.array:
    """A row piece as an MLX array on the default device (host pieces uploaded once)."""
    if isinstance(piece, mx.array):
        return piece
    if cuda.available():
        view = np.ascontiguousarray(piece)
        name = dtype_name(view)
        spec = [(tuple(view.shape), name)]
        return cuda.upload(spec, lambda _, target: np.copyto(target, view))[0]
    from kvstore.codecs.arrays import as_mlx

    return as_mlx(piece)


def run_plans(
    plans: Sequence[RestorePlan],
    pages: cuda_pages.PinnedPages | None = None,
    stacks: Sequence[Stack] = (),
    claims: Claims | None = None,
) -> list[Any]:
    """The caches of ``plans``: every array of every plan allocated and filled in one go.

    A :class:`CachePlan`'s arrays are written once, straight from the row
    pieces into MLX's memory (:func:`~kvstore.codecs.fill.filled_arrays`), or,
    on a CUDA GPU, read by the GPU from the host pages the pieces are in
    (:func:`~kvstore.codecs.cuda_pages.gathered`; ``pages``: those pages, pinned
    already), or joined on the device when their pieces are MLX arrays already;
    any other plan gets zero-filled buffers of its ``leaves``.

    ``stacks``: arrays on the device whose members are pieces of the plans (a lossy
    restore's rows, decoded for all layers at once); arrays whose every piece is such a
    member are written by one kernel per 64 of them (:mod:`~kvstore.codecs.device_joins`).

    ``claims``: the records the pieces lie in (on the CPU), those claimed hashed as their
    rows are copied (:mod:`~kvstore.codecs.record_copies`); claims not resolved by
    then are dropped before this returns.
    """
    on_gpu = cuda.available()
    # On a GPU every lazy piece is joined there, in the one evaluation below (with the
    # decode of a lossy restore and the gather it reads); on the CPU they are filled
    # from host memory, evaluated first.
    if not on_gpu:
        mx.eval([a for plan in plans if isinstance(plan, CachePlan) for a in plan.lazy()])
    columns = [c for plan in plans if isinstance(plan, CachePlan) for c in plan.columns()]
    joined = (
        _joined_on_device([(i, c) for i, c in enumerate(columns) if c[0].holds_mlx(c[1])], stacks)
        if on_gpu
        else {}
    )
    writers = [(i, c) for i, c in enumerate(columns) if i not in joined]
    specs = [join.leaves()[column] for _, (join, column) in writers]
    # On a GPU every writer's pieces are host arrays here (the MLX ones were joined).
    pieces = [join.columns[column] for _, (join, column) in writers]
    filled = cuda_pages.gathered(specs, pieces, pages) if on_gpu else None
    units = None
    if filled is None:
        # The pieces' views made here: the writes run on several threads, and MLX (a
        # bfloat16 piece's view) is asked only from this one.
        views = [join.host_views(column) for _, (join, column) in writers]
        rooms = rooms_unwritten(plans)
        units = (
            record_writes(specs, views, claims, [rooms[i] for i, _ in writers])
            if claims is not None
            else None
        )
        if units is not None:
            units.claim()
        elif claims is not None:
            claims.drop()  # the checks hash the records, beside the copies
        filled = filled_arrays(
            specs,
            lambda k, target: write_rows(views[k], target),
            units=units,
            align=units.align if units is not None else None,
        )
    if claims is not None:
        claims.drop()
    arrays: list[mx.array] = [None] * len(columns)  # type: ignore[list-item]
    for (i, _), array in zip(writers, filled, strict=True):
        arrays[i] = array
    for i, array in joined.items():
        arrays[i] = array
    mx.eval(list(joined.values()))
    caches, at = [], 0
    for plan in plans:
        if not isinstance(plan, CachePlan):
            caches.append(plan.finish(owned_arrays(list(plan.leaves))))
            continue
        n = len(plan.leaves)
        # The record writes leave the room unwritten (write_rows zeroes it).
        caches.append(plan.assemble(arrays[at : at + n], room_left=units is not None))
        at += n
    return caches


def _joined_on_device(
    columns: Sequence[tuple[int, tuple[RowsJoin, int]]], stacks: Sequence[Stack]
) -> dict[int, mx.array]:
    """Each of ``columns`` (numbered, with its join and leaf) joined on the device: those
    whose every piece is a member of one of ``stacks`` by one kernel per 64, the rest
    by a concatenation each."""
    place = members_of(stacks)
    # Each column whose every piece is a member: its leaf and where its pieces lie.
    placed: dict[int, tuple[LeafSpec, list[device_joins.Placed]]] = {}
    for i, (join, col) in columns if place else ():
        found: list[device_joins.Placed] = []
        for piece in join.columns[col]:
            member = place.get(id(piece))
            if member is None:
                break
            stack, at = member
            found.append((piece, stack.whole, at * piece.nbytes))
        else:
            placed[i] = (join.leaves()[col], found)
    specs = [spec for spec, _ in placed.values()]
    pieces = [found for _, found in placed.values()]
    made = device_joins.joined(specs, pieces) if placed and cuda_pages.joins_proven() else None
    joined = dict(zip(placed, made, strict=True)) if made is not None else {}
    for i, (join, col) in columns:
        if i not in joined:
            joined[i] = join.join_on_device(col)
    return joined


@dataclass(frozen=True)
class Stack:
    """Row tensors of one name that lie one after another along the batch axis of one
    device array, ``whole``, from its start. Two kinds on a CUDA GPU: the joins of a
    lossy restore's records in one gather's output (:func:`join_runs`), so a decode of
    them all (:func:`~kvstore.codecs.transcode.transcode_stacked`) needs no
    concatenation (on an H200 a q8 restore's stacking was 192 copy kernels, each a node
    of the CUDA graph a fresh process instantiates); and each layer's rows of that decode,
    which :func:`run_plans` copies into the caches' own arrays by one kernel."""

    whole: mx.array
    #: The tensors, in order: ``whole``'s parts, each a view of its own.
    members: tuple[mx.array, ...]


def members_of(stacks: Sequence[Stack]) -> dict[int, tuple[Stack, int]]:
    """Each member of ``stacks``, by its ``id()``: its stack and its place there (the
    members are alive in the stacks, so their ids are theirs alone)."""
    return {id(m): (stack, at) for stack in stacks for at, m in enumerate(stack.members)}


def join_runs(
    layers: Sequence[Sequence[Snapshot]],
    pages: cuda_pages.PinnedPages | None = None,
    stacks: list[Stack] | None = None,
) -> list[list[Snapshot]]:
    """Each layer's snapshots with every run of consecutive ones (``stop`` of one is
    ``start`` of the next) joined into one snapshot of MLX arrays.

    What a restore does before decoding a lossy record: one decode over a run of
    a layer's rows, on the device the arrays land on, instead of one per block.
    Every join of every layer is written in one go (:func:`filled_arrays`).
    A run's row tensors (``[B, H, tokens, ...]`` in every snapshot of it) are
    joined; its other tensors (a rotation carried by the first block, say) are
    the first snapshot's, and its meta is the last one's, as a restore of the
    run reads them. A run of one-token snapshots stays as it is (rows and
    per-snapshot tensors cannot be told apart there).

    On a CUDA GPU the joins of each tensor name are gathered one after another, in
    layer order, and where they stack as a view each such run is added to ``stacks``.
    """
    runs: list[list[list[Snapshot]]] = []
    for snaps in layers:
        grouped: list[list[Snapshot]] = []
        for snap in snaps:
            if grouped and grouped[-1][-1].stop == snap.start:
                grouped[-1].append(snap)
            else:
                grouped.append([snap])
        runs.append(grouped)
    joins: list[tuple[int, str, RowsJoin | _StoredRows]] = []
    # Runs of one header template reading the same payloads (every layer of a lossy
    # restore): their bases found once, and whether rows of a depth fit their cuts.
    shared: dict[tuple[tuple[int, ...], tuple[tuple[int | None, int], ...]], _Bases] = {}
    fits: dict[tuple[tuple[int | None, int], ...], dict[int, bool]] = {}
    for grouped in runs:
        for run in grouped:
            described = [stored(s.tensors) for s in run]
            every = cast(list[PayloadTensors], described) if all(described) else None
            bases = None
            if every is not None and same_entries(every):
                # Laid out alike (one header template): each payload's address, for
                # every name; the names from the entries (no shapes made per snapshot).
                cuts = tuple((t.rows, s.tokens) for t, s in zip(every, run, strict=True))
                read = (tuple(id(t.payload) for t in every), cuts)
                bases = shared.get(read)
                if bases is None:
                    bases = shared[read] = _Bases(every)
                names = alike_row_names(every[0].entries, cuts, fits.setdefault(cuts, {}))
            else:
                names = _row_names(run)
            if not names:
                continue
            rows = run[-1].stop - run[0].start  # consecutive: each starts where one stops
            for name in names:
                join = _StoredRows.of(every, name, rows, bases) if every else None
                joins.append(
                    (id(run), name, join or RowsJoin([s.tensors[name] for s in run], rows))
                )
    rows_joins = {i: join for i, (_, _, join) in enumerate(joins) if isinstance(join, RowsJoin)}
    mx.eval([a for join in rows_joins.values() for a in join.lazy()])
    # Rows already on the device (records decoded there) are joined there.
    on_device = {i: join for i, join in rows_joins.items() if join.holds_mlx(0)}
    hosted = [i for i in range(len(joins)) if i not in on_device]

    def fill(k: int, target: np.ndarray) -> None:
        joins[hosted[k]][2].fill_leaf(0, target)

    arrays: dict[int, mx.array] = {i: join.join_on_device(0) for i, join in on_device.items()}
    on_gpu = bool(hosted) and cuda.available()
    if on_gpu:  # each name's joins adjacent, in layer order: they stack as a view
        hosted.sort(key=lambda i: (joins[i][1], i))
    specs = [joins[i][2].leaves()[0] for i in hosted]
    # On a CUDA GPU the host rows are read by the GPU from the store's pages (pinned:
    # ``pages``), every joined array in one kernel; rows of described tensors (lossy
    # layers on pinned pages) from where their headers say they lie: where every join
    # reads the same records laid out alike, its segments made for all at once.
    flat = None
    if on_gpu:
        alike = _alike_rows([joins[i][2] for i in hosted]) if pages is not None else None
        table = gather_tables.alike_table(alike, specs) if alike is not None else None
        flat = cuda_pages.gathered_flat(
            specs,
            table if table is not None else [_gathered_from(joins[i][2]) for i in hosted],
            pages,
            lazy=True,
        )
    if flat is not None:
        filled = one_buffer.views_in(flat, specs)
        if stacks is not None:
            stacks.extend(_stacks(flat, specs, [joins[i][1] for i in hosted], filled))
    else:
        filled = filled_arrays(specs, fill)
    arrays.update(zip(hosted, filled, strict=True))
    joined: dict[int, dict[str, mx.array]] = {}
    for i, (run_id, name, _) in enumerate(joins):
        joined.setdefault(run_id, {})[name] = arrays[i]
    out = []
    for grouped in runs:
        layer = []
        for run in grouped:
            cut = joined.get(id(run))
            if cut is None:
                layer.extend(run)
                continue
            # The first snapshot's other tensors (a described one's views made now;
            # the views of its rows never are).
            tensors = {n: cut[n] if n in cut else run[0].tensors[n] for n in run[0].tensors}
            first, last = run[0], run[-1]
            layer.append(Snapshot(first.signature, first.start, last.stop, tensors, last.meta))
        out.append(layer)
    return out


def _stacks(
    flat: mx.array, specs: Sequence[LeafSpec], names: Sequence[str], views: Sequence[mx.array]
) -> list[Stack]:
    """The runs of ``specs`` (gathered one after another into ``flat``, ``views`` of
    each) of one name that stack as a view (:func:`one_buffer.stacked_view`)."""
    out, first = [], 0
    for _, run in itertools.groupby(names):
        count = len(list(run))
        whole = one_buffer.stacked_view(flat, specs, first, count) if count > 1 else None
        if whole is not None:
            out.append(Stack(whole, tuple(views[first : first + count])))
        first += count
    return out


class _Bases:
    """A run's payloads laid out alike (one header template): where each lies, and the
    rows each piece of a tensor of so many stored rows holds (a match's cut, where it
    ends inside the block), found once for the joins of every run that reads those
    payloads with those cuts (a lossy restore's layers all do)."""

    def __init__(self, tensors: list[PayloadTensors]) -> None:
        self.tensors = tensors
        self.addresses = [t.payload.address for t in tensors]
        self._counts: dict[int, list[int]] = {}

    def counts(self, full: int) -> list[int]:
        found = self._counts.get(full)
        if found is None:
            found = self._counts[full] = rows_read([t.rows for t in self.tensors], full)
        return found


def rows_read(cuts: Sequence[int | None], depth: int) -> list[int]:
    """The rows each piece of a tensor stored ``depth`` rows deep gives, its record cut
    to ``cuts[i]`` rows (a match ending inside the block; ``None``: not cut)."""
    return [depth if c is None or c > depth else c for c in cuts]


class _StoredRows:
    """Tensor ``name`` of a run whose snapshots all lie in records' payloads
    (:class:`PayloadTensors`): joined by a gather reading it where it lies, from what
    the headers say (no view of any piece made); where no gather runs, joined from
    views as a :class:`RowsJoin`."""

    def __init__(
        self, tensors: list[PayloadTensors], name: str, spec: LeafSpec, bases: _Bases | None
    ) -> None:
        self.tensors, self.name, self.spec = tensors, name, spec
        #: Where the payloads are, when every piece is laid out alike (:func:`same_entries`).
        self.bases = bases
        self._join: RowsJoin | None = None

    @classmethod
    def of(
        cls, tensors: list[PayloadTensors], name: str, capacity: int, bases: _Bases | None = None
    ) -> _StoredRows | None:
        """The join of ``tensors[i][name]`` into ``capacity`` rows; ``None`` when its pieces
        differ in dtype (a widening join: :class:`RowsJoin`). ``bases``: every piece is
        laid out as the first (:func:`same_entries`), nothing to compare."""
        first = tensors[0].entries[name]
        if len(first.shape) < 3:
            return None
        if bases is None and any(t.entries[name].dtype != first.dtype for t in tensors):
            return None
        spec = ((*first.shape[:2], capacity, *first.shape[3:]), first.dtype)
        return cls(tensors, name, spec, bases)

    def leaves(self) -> list[LeafSpec]:
        return [self.spec]

    def layout(self) -> gather_tables.RowsLayout | None:
        """Where a gather reads the rows (:func:`gather_tables.stored_layout`)."""
        name = self.name
        if self.bases is not None:  # one header template: one entry, each payload's address
            entry = self.tensors[0].entries[name]
            offset = entry.offset
            addresses = [base + offset for base in self.bases.addresses]
            counts = self.bases.counts(entry.shape[2])
            return gather_tables.alike_layout(
                addresses, entry.shape, counts, entry.dtype, *self.spec
            )
        addresses, shapes, counts, dtypes = [], [], [], []
        for t in self.tensors:  # one pass (192 joins of 16 in a lossy restore)
            e = t.entries[name]
            addresses.append(t.payload.address + e.offset)
            shapes.append(e.shape)
            counts.append(t.shape(name)[2])  # a match's cut, where it ends inside the block
            dtypes.append(e.dtype)
        return gather_tables.stored_layout(addresses, shapes, counts, dtypes, *self.spec)

    def rows_join(self) -> RowsJoin:
        if self._join is None:
            self._join = RowsJoin([t[self.name] for t in self.tensors], self.spec[0][2])
        return self._join

    def fill_leaf(self, column: int, target: np.ndarray) -> None:
        self.rows_join().fill_leaf(column, target)

    def host_views(self, column: int) -> list[np.ndarray]:
        return self.rows_join().host_views(column)


def write_rows(views: Sequence[np.ndarray], target: np.ndarray) -> None:
    """Write row pieces ``views`` into ``target`` along its row axis, in order, and zeros
    past them. One call writes every piece (numpy's loop, not a Python copy per piece:
    a qwen-0.5B restore of 8192 tokens has 32 a leaf, 32.3 -> 30.0 ms). "safe": pieces
    of one leaf differ only by widening (float16 TurboQuant scales next to float32
    ones); anything else raises."""
    rows = sum(int(view.shape[2]) for view in views)
    np.concatenate(views, axis=2, out=target[:, :, :rows], casting="safe")
    target[:, :, rows:] = 0


def _alike_rows(joins: Sequence[RowsJoin | _StoredRows]) -> gather_tables.AlikeRows | None:
    """``joins`` as one :class:`~kvstore.codecs.gather_tables.AlikeRows` when each is a
    :class:`_StoredRows` of pieces laid out alike in the same records (a lossy restore of
    a model whose every layer reads every block); else ``None``."""
    first: _Bases | None = None
    offsets, shapes, dtypes, counts = [], [], [], []
    for join in joins:
        if not isinstance(join, _StoredRows) or join.bases is None:
            return None
        bases = join.bases
        if first is None:
            first = bases
        elif bases is not first and bases.addresses != first.addresses:
            return None
        entry = join.tensors[0].entries[join.name]
        offsets.append(entry.offset)
        shapes.append(entry.shape)
        dtypes.append(entry.dtype)
        counts.append(bases.counts(entry.shape[2]))
    if first is None:
        return None
    return gather_tables.AlikeRows(first.addresses, offsets, shapes, dtypes, counts)


def _gathered_from(join: RowsJoin | _StoredRows) -> Sequence[Any] | gather_tables.RowsLayout:
    """What a gather of ``join``'s rows reads: where they lie, or their views."""
    if isinstance(join, _StoredRows):
        return join.layout() or join.rows_join().columns[0]
    return join.columns[0]


def _row_names(run: Sequence[Snapshot]) -> list[str]:
    """The row tensors of a run worth joining (none for a run of one MLX-array snapshot,
    already where a decode wants it, or of one-token snapshots). Runs laid out alike
    are named by :func:`alike_row_names`."""
    sized = [(_shapes(s.tensors), s.tokens) for s in run]
    if any(tokens < 2 for _, tokens in sized):
        return []
    if len(run) == 1 and all(isinstance(t, mx.array) for t in run[0].tensors.values()):
        return []
    return [
        name
        for name in run[0].tensors
        if all(
            name in shapes and len(shape := shapes[name]) >= 3 and int(shape[2]) == tokens
            for shapes, tokens in sized
        )
    ]


def alike_row_names(
    entries: Mapping[str, TensorEntry],
    cuts: Sequence[tuple[int | None, int]],
    fits: dict[int, bool],
) -> list[str]:
    """:func:`_row_names` of a run of described snapshots laid out alike (one header
    template: ``entries``), each ``(rows cut, tokens)``: no shapes made per snapshot.
    ``fits``: whether a tensor of so many stored rows holds each snapshot's tokens under
    these ``cuts``, remembered across calls with the same cuts (a lossy restore's 32
    layers ask it of the same few depths)."""
    if any(tokens < 2 for _, tokens in cuts):
        return []
    names = []
    for name, entry in entries.items():
        shape = entry.shape
        if len(shape) < 3:
            continue
        depth = shape[2]
        fit = fits.get(depth)
        if fit is None:
            fit = fits[depth] = all(
                (depth if rows is None else min(rows, depth)) == tokens for rows, tokens in cuts
            )
        if fit:
            names.append(name)
    return names


def _shapes(tensors: Mapping[str, Any]) -> Mapping[str, tuple[int, ...]]:
    """Each tensor's shape (a described one's from its header entry: no view made)."""
    described = stored(tensors)
    if described is not None:
        return {name: described.shape(name) for name in described.entries}
    return {name: tuple(array.shape) for name, array in tensors.items()}
