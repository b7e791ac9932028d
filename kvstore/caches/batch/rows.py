"""What every row-batched cache shares: per-row offsets and left padding, tree helpers,
and packed rows encoded as the rows' family but reported as ``batch:`` it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_map

from kvstore.caches.base import BaseKVCache, Tree, row_leaves, tree_length
from kvstore.caches.packed import PackedRows, quantize_rows
from kvstore.errors import CapabilityError
from kvstore.family import BATCH_STATE, Family, Quantization
from kvstore.signature import parse_signature

__all__ = ["BATCH_FAMILY", "BatchRows", "BatchPacked", "check_same_family"]

#: The ``batch`` wrapper: ``batch:<the rows' signature>``. Its state is several
#: sequences' rows, not one's keys and values, so predicates fail closed on it.
BATCH_FAMILY = Family(
    kind="batch",
    description="rows of several sequences in one cache (mlx-lm's batch protocol)",
    wraps=True,
    state=BATCH_STATE,
)


def dynamic_roll(tree: Tree, shifts: mx.array) -> Tree:
    """Roll each row of every leaf right by its own shift along tokens (mlx-lm's)."""

    def roll(x: mx.array) -> mx.array:
        n = x.shape[2]
        idx = (mx.arange(n)[None, None, :, None] - shifts[:, None, None, None]) % n
        return mx.take_along_axis(x, mx.broadcast_to(idx, x.shape), axis=2)

    return tree_map(roll, tree)


def ints(a: mx.array) -> list[int]:
    """A 1-D integer array's values."""
    return [int(x) for x in cast(list[Any], a.tolist())]


def empty_rows(like: Tree, batch: int) -> Tree:
    """Rows of no tokens for ``batch`` rows, shaped like ``like``'s leaves."""
    return tree_map(lambda a: mx.zeros((batch, a.shape[1], 0, a.shape[3]), a.dtype), like)


def pad_rows(tree: Tree, left: int, right: int) -> Tree:
    return tree_map(lambda a: mx.pad(a, [(0, 0), (0, 0), (left, right), (0, 0)]), tree)


def cat(trees: Sequence[Tree], axis: int) -> Tree:
    return tree_map(lambda *leaves: mx.concatenate(list(leaves), axis=axis), *trees)


class BatchRows(BaseKVCache):
    """What every batch cache shares: per-row ``offset`` and ``left_padding`` arrays."""

    left_padding: mx.array
    offset: mx.array  # type: ignore[assignment]  # per row, unlike a single cache's int
    _idx: int
    single: type  # the single-sequence class of the rows' family
    rows_family: Family  # the family of the rows (what extract gives back)

    def signature(self) -> str:
        return f"{BATCH_FAMILY.kind}:{self.inner_signature()}"

    def inner_signature(self) -> str:
        return self.rows_family.kind

    def new_single(self) -> Any:
        """An empty single-sequence cache of the rows' family (same parameters)."""
        return self.single()

    @classmethod
    def empty_batch(cls, template: Any, left_padding: list[int]) -> BatchRows:
        """An empty batch cache for rows of ``template``'s family."""
        return cls(left_padding)  # type: ignore[call-arg]  # each family's own __init__

    def _init_rows(self, left_padding: Sequence[int]) -> None:
        self.keys = None
        self.values = None
        self.left_padding = mx.array(list(left_padding))
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0

    def _pad_left(self, left_padding: Sequence[int]) -> None:
        """More left padding for each row of a batch that holds nothing yet (``prepare``)."""
        if self.keys is not None:
            raise ValueError("[batch cache] Left padding can only be added to an empty batch.")
        pad = mx.array(list(left_padding))
        self.left_padding = self.left_padding + pad
        self.offset = self.offset - pad

    def _fill(self, pieces: Sequence[tuple[Tree | None, Tree | None, int]], length: int) -> None:
        """Rows ``pieces`` (keys, values, tokens) right-justified in ``length`` tokens."""
        ref = next((k, v) for k, v, n in pieces if k is not None and n > 0)
        batch = len(pieces)
        keys = tree_map(
            lambda a: mx.zeros((batch, a.shape[1], length, a.shape[3]), a.dtype), ref[0]
        )
        values = tree_map(
            lambda a: mx.zeros((batch, a.shape[1], length, a.shape[3]), a.dtype), ref[1]
        )
        for i, (k, v, n) in enumerate(pieces):
            if k is None or n == 0:
                continue
            p = length - n
            for buf, rows in zip(row_leaves((keys, values)), row_leaves((k, v))):
                buf[i : i + 1, :, p : p + n] = rows
        self.keys, self.values = keys, values

    def extend(self, other: BatchRows) -> None:
        """Append ``other``'s rows (in place), both right-justified at the same index."""
        check_same_family(self, other)
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        self._align_with(other)
        top = max(self._idx, other._idx)
        size = max(tree_length(c.keys) for c in (self, other) if c.keys is not None)
        ref = self if self.keys is not None else other

        def pad(c: BatchRows) -> tuple[Tree, Tree, mx.array, mx.array]:
            k, v = c.keys, c.values
            if k is None:
                rows = int(c.offset.shape[0])
                k, v = empty_rows(ref.keys, rows), empty_rows(ref.values, rows)
            left = top - c._idx
            right = size - tree_length(k) - left
            if right < 0:
                k, v = tree_map(lambda a: a[..., :right, :], (k, v))
                right = 0
            if left or right:
                k, v = pad_rows(k, left, right), pad_rows(v, left, right)
            return k, v, c.offset, c.left_padding + left

        a, b = pad(self), pad(other)
        self.keys, self.values = cat([a[0], b[0]], 0), cat([a[1], b[1]], 0)
        self.offset = mx.concatenate([a[2], b[2]])
        self.left_padding = mx.concatenate([a[3], b[3]])
        self._idx = top

    def _align_with(self, other: BatchRows) -> None:
        """What ``extend`` does to both before it pads their rows alike (nothing here)."""

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(leaf.nbytes for leaf in row_leaves((self.keys, self.values)))

    def empty(self) -> bool:
        return self.keys is None


class BatchPacked(PackedRows):
    """Packed rows in a batch: encoded as the rows' family, reported as ``batch:`` it."""

    def signature(self) -> str:
        return f"{BATCH_FAMILY.kind}:{PackedRows.signature(self)}"

    def inner_signature(self) -> str:
        return PackedRows.signature(self)

    def quantization(self) -> Quantization:
        q = self.family.quantization(parse_signature(self.inner_signature()))
        assert q is not None
        return q

    def _encode(self, x: mx.array) -> tuple[mx.array, ...]:
        return quantize_rows(x, parse_signature(self.inner_signature()))


def check_same_family(a: BatchRows, b: BatchRows) -> None:
    if type(a) is not type(b) or a.signature() != b.signature():
        raise CapabilityError(
            f"[batch cache] Cannot extend a {a.signature()} batch with a {b.signature()} one.",
            found=b.signature(),
        )
