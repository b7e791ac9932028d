"""Restores in two steps: plan every layer, then allocate all arrays at once and fill them.

An MLX evaluation is a round trip to the stream's worker thread, tens of
microseconds on a busy CPU: allocating each layer's arrays with its own
evaluation costs more than copying a small model's rows. So a codec first
*plans* a restore (:meth:`~kvstore.abc.codec.KVCodec.plan_restore`: checks the
snapshots, lays out the rows, names the arrays it needs), then
:func:`run_plans` allocates the arrays of every plan in one evaluation and
each plan copies its rows in and builds its cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kvstore.abc.codec import RestorePlan
from kvstore.caches.base import Tree
from kvstore.codecs.arrays import as_numpy_all, dtype_name, owned_arrays
from kvstore.codecs.fill import LeafSpec, filled_arrays

__all__ = ["Tree", "LeafSpec", "row_leaves_of", "RowsJoin", "CachePlan", "run_plans"]


def row_leaves_of(tree: Tree) -> tuple[Any, ...]:
    """The arrays of a row tree (a bare array or a tuple of them)."""
    return tree if isinstance(tree, tuple) else (tree,)


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
        self.columns = [list(column) for column in zip(*map(row_leaves_of, pieces), strict=True)]
        rows = sum(int(p.shape[2]) for p in self.columns[0])
        if rows > capacity:
            raise ValueError(f"[join_rows] {rows} rows do not fit a capacity of {capacity}.")
        self.capacity = capacity
        self._leaves: list[LeafSpec] | None = None

    def leaves(self) -> list[LeafSpec]:
        if self._leaves is None:
            self._leaves = [
                ((*c[0].shape[:2], self.capacity, *c[0].shape[3:]), _joined_dtype(c))
                for c in self.columns
            ]
        return self._leaves

    def lazy(self) -> list[mx.array]:
        """Pieces that are unevaluated MLX arrays (to evaluate before :meth:`fill`)."""
        return [leaf for column in self.columns for leaf in column if isinstance(leaf, mx.array)]

    def fill_leaf(self, column: int, target: np.ndarray) -> None:
        """Write leaf ``column`` into ``target`` (uninitialised memory of
        :meth:`leaves`' shape): the pieces in order, then zeros up to capacity."""
        pos = 0
        for view in as_numpy_all(self.columns[column]):
            rows = int(view.shape[2])
            # "safe": pieces of one column differ only by widening (float16
            # TurboQuant scales next to float32 ones); anything else raises.
            np.copyto(target[:, :, pos : pos + rows], view, casting="safe")
            pos += rows
        target[:, :, pos:] = 0

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
    """

    joins: Sequence[RowsJoin]
    build: Callable[[list[Tree]], Any]

    @property
    def leaves(self) -> list[LeafSpec]:
        return [leaf for join in self.joins for leaf in join.leaves()]

    def lazy(self) -> list[mx.array]:
        return [a for join in self.joins for a in join.lazy()]

    def columns(self) -> list[tuple[RowsJoin, int]]:
        """``(join, column)`` of each array of :attr:`leaves`, in order."""
        return [(join, column) for join in self.joins for column in range(len(join.columns))]

    def assemble(self, arrays: Sequence[mx.array]) -> Any:
        """The cache, given the filled arrays of :attr:`leaves`, in order."""
        trees, at = [], 0
        for join in self.joins:
            n = len(join.columns)
            trees.append(join.tree(arrays[at : at + n]))
            at += n
        return self.build(trees)

    def finish(self, buffers: Sequence[tuple[mx.array, np.ndarray]]) -> Any:
        for (join, column), (_, target) in zip(self.columns(), buffers, strict=True):
            join.fill_leaf(column, target)
        return self.assemble([array for array, _ in buffers])


def run_plans(plans: Sequence[RestorePlan]) -> list[Any]:
    """The caches of ``plans``: every array of every plan allocated and filled in one go.

    A :class:`CachePlan`'s arrays are written once, straight from the row
    pieces into MLX's memory (:func:`~kvstore.codecs.fill.filled_arrays`);
    any other plan gets zero-filled buffers of its ``leaves``.
    """
    mx.eval([a for plan in plans if isinstance(plan, CachePlan) for a in plan.lazy()])
    writers = [w for plan in plans if isinstance(plan, CachePlan) for w in plan.columns()]

    def fill(i: int, target: np.ndarray) -> None:
        join, column = writers[i]
        join.fill_leaf(column, target)

    arrays = filled_arrays([join.leaves()[column] for join, column in writers], fill)
    caches, at = [], 0
    for plan in plans:
        if not isinstance(plan, CachePlan):
            caches.append(plan.finish(owned_arrays(list(plan.leaves))))
            continue
        n = len(plan.leaves)
        caches.append(plan.assemble(arrays[at : at + n]))
        at += n
    return caches
