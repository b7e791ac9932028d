"""Codecs of sliding-window rings: ``kv:rotating-plain`` and ``kv:rotating-quant``.

How a ring (mlx-lm ``RotatingKVCache`` arithmetic) holds its tokens, with
``offset`` N tokens seen, ``keep`` sink tokens and room for ``max_size``:

* In *temporal order* (``keep`` sinks first, then oldest to newest) a ring
  holds either every position ``[0, N)``, or the sinks ``[0, keep)`` plus
  the newest ``T - keep`` positions, where T is its temporal length. After
  a multi-token update T may reach ``max_size + S - 1``; otherwise T is at
  most ``max_size``.
* Canonical form: the sinks plus the last ``max_size - keep`` positions
  (all of ``[0, N)`` when ``N <= max_size``). A ring restored in canonical
  form (buffer of ``max_size`` rows, ``_idx = max_size``; or the N rows with
  ``_idx = N``) continues exactly like the original under single- and
  multi-token updates: the first update trims the original down to the
  same rows in the same order.
* After single-token updates past the window the ring is *rotated*: the
  newest rows sit at ``[keep, _idx)``. The order of rows is the order
  attention sums them in, so a snapshot records ``ring_idx`` and a restore
  of a ring taken at its latest position rebuilds the same rotation --
  logits then match bit for bit, not just to rounding.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kvstore.abc.codec import Snapshot
from kvstore.caches import RotatingKVCache, RotatingQuantizedKVCache
from kvstore.caches.base import Tree, UnwrittenRoom, stored_buffers, tree_length
from kvstore.caches.rotating import ROTATING_PLAIN_FAMILY, ROTATING_QUANT_FAMILY
from kvstore.codecs.plans import CachePlan, RowsJoin, run_plans
from kvstore.codecs.rows import (
    AffineRowCodec,
    RawRowCodec,
    RowCodec,
    growth_capacity,
    slice_rows,
)
from kvstore.codecs.snapshot_meta import MAX_WINDOW
from kvstore.errors import CapabilityError

__all__ = [
    "RingView",
    "RingKVCodec",
    "RotatingKVCodec",
    "RotatingQuantizedKVCodec",
    "window_positions",
]

Interval = tuple[int, int]


def window_positions(n: int, max_size: int, keep: int) -> list[Interval]:
    """The positions a ring at position ``n`` attends to, in temporal order."""
    if n <= max_size:
        return [(0, n)]
    return [iv for iv in ((0, keep), (n - (max_size - keep), n)) if iv[1] > iv[0]]


def _spans(intervals: Sequence[Interval]) -> str:
    return ", ".join(f"[{a}, {b})" for a, b in intervals) or "nothing"


@dataclass(frozen=True)
class RingView:
    """Which absolute positions a ring holds and where its rows are.

    Reads only ``keys``, ``offset``, ``keep``, ``max_size`` and ``_idx``,
    so it serves our rings and mlx-lm's ``RotatingKVCache`` alike.
    """

    length: int  # buffer rows
    idx: int  # mlx-lm's _idx: the next write position
    offset: int
    keep: int
    max_size: int

    @classmethod
    def of(cls, cache: Any) -> RingView:
        return cls(
            tree_length(stored_buffers(cache)[0]),  # its length: no row of it read
            int(cache._idx),
            int(cache.offset),
            int(cache.keep),
            int(cache.max_size),
        )

    @property
    def rotated(self) -> bool:
        """True when the newest rows sit at ``[keep, idx)`` (mlx-lm ``_temporal_order``)."""
        return self.idx != self.length and self.idx < self.offset

    @property
    def temporal_length(self) -> int:
        return self.length if self.rotated or self.idx == self.length else self.idx

    def held(self) -> list[Interval]:
        """The absolute positions the ring holds, as at most two intervals."""
        t = self.temporal_length
        if t >= self.offset:
            return [(0, self.offset)]
        sinks = min(self.keep, self.offset)
        return [
            iv for iv in ((0, sinks), (self.offset - (t - self.keep), self.offset)) if iv[1] > iv[0]
        ]

    def needed(self) -> list[Interval]:
        """The positions the ring will still attend to (its canonical form):
        everything up to ``max_size`` tokens, then the sinks and the last
        ``max_size - keep`` positions. Always a subset of :meth:`held`."""
        return window_positions(self.offset, self.max_size, self.keep)

    def missing(self, start: int, stop: int) -> list[Interval]:
        """The parts of ``[start, stop)`` the ring does not hold."""
        gaps, pos = [], start
        for a, b in self.held():
            if a > pos and pos < stop:
                gaps.append((pos, min(a, stop)))
            pos = max(pos, b)
        if pos < stop:
            gaps.append((pos, stop))
        return gaps

    def rows(self, tree: Tree, start: int, stop: int) -> Tree:
        """Rows of held positions ``[start, stop)`` in temporal order (views
        unless the range straddles the rotation point)."""
        t = self.temporal_length
        t0 = start if start < self.keep or t >= self.offset else start - self.offset + t
        t1 = t0 + (stop - start)
        pieces = [(0, self.keep), (self.idx, self.length), (self.keep, self.idx)]
        segments, base = [], 0
        for a, b in pieces if self.rotated else [(0, t)]:
            lo, hi = max(t0, base), min(t1, base + b - a)
            if lo < hi:
                segments.append((a + lo - base, a + hi - base))
            base += b - a
        if len(segments) <= 1:
            return slice_rows(tree, *(segments[0] if segments else (0, 0)))
        parts = [slice_rows(tree, a, b) for a, b in segments]
        if isinstance(tree, (tuple, list)):
            return tuple(mx.concatenate([p[i] for p in parts], axis=2) for i in range(len(tree)))
        return mx.concatenate(parts, axis=2)


class RingKVCodec(RowCodec):
    """Snapshot/restore of a sliding-window ring; a family adds its row
    encoding and cache class."""

    @abstractmethod
    def make_cache(self, meta: Mapping[str, Any]) -> Any:
        """An empty ring of this codec's signature with ``meta``'s ``max_size`` and ``keep``."""

    def snapshot(self, cache: Any, start: int = 0, stop: int | None = None) -> Snapshot:
        self.check_cache(cache)
        ring = RingView.of(cache)
        start, stop = self.check_range(start, stop, ring.offset)
        gone = ring.missing(start, stop)
        if gone:
            raise CapabilityError(
                f"[{type(self).__name__}.snapshot] The ring no longer holds positions "
                f"{_spans(gone)} of [{start}, {stop}); it holds {_spans(ring.held())} "
                f"(window {ring.max_size}, keep {ring.keep}, offset {ring.offset}). "
                f"Snapshot a range while the window still covers it.",
                missing=gone,
                held=ring.held(),
            )
        buffers = stored_buffers(cache)  # rows the ring holds only: none of its room
        keys, values = ring.rows(buffers[0], start, stop), ring.rows(buffers[1], start, stop)
        meta: dict[str, Any] = {
            "dtype": self.meta_dtype(cache, keys),
            "offset": ring.offset,
            "max_size": ring.max_size,
            "keep": ring.keep,
        }
        if ring.rotated:
            meta["ring_idx"] = ring.idx
        return Snapshot(self.signature, start, stop, self.tensors_from_rows(keys, values), meta)

    def snapshot_held(self, cache: Any) -> list[Snapshot]:
        """Snapshots of the positions the ring will still attend to: its sink
        range and its window (rows a multi-token update left beyond the
        window are dropped; the next update would trim them)."""
        self.check_cache(cache)
        return [self.snapshot(cache, a, b) for a, b in RingView.of(cache).needed()]

    def _snapshot_problem(self, snap: Snapshot) -> str | None:
        problem = super()._snapshot_problem(snap)
        if problem:
            return problem
        state = {k: snap.meta.get(k) for k in ("max_size", "keep")}
        max_size, keep = state.values()
        if not (type(max_size) is int and type(keep) is int):
            return f"meta max_size/keep must be ints; received {state}"
        if not 0 < max_size <= MAX_WINDOW:
            return f"meta max_size {max_size} is outside [1, {MAX_WINDOW}]"
        if not 0 <= keep < max_size:
            return f"meta keep {keep} is outside [0, max_size {max_size})"
        idx = snap.meta.get("ring_idx")
        if idx is not None and not (type(idx) is int and keep <= idx < max_size):
            return f"meta ring_idx {idx!r} is outside [keep, max_size)"
        return None

    def restore(self, snapshots: Snapshot | Sequence[Snapshot]) -> Any:
        """A ring rebuilt from snapshots sorted by start, not overlapping, that
        cover the sinks and the window of the last position (or everything).

        Raises:
            CapabilityError: the ranges overlap, are unsorted, or leave out
                positions the ring needs (the message lists them).
            CorruptEntryError: the snapshots are malformed or of different rings.
        """
        return run_plans([self.plan_restore(snapshots)])[0]

    def plan_restore(self, snapshots: Snapshot | Sequence[Snapshot]) -> CachePlan:
        """:meth:`restore`, checked and laid out (see :mod:`kvstore.codecs.plans`).

        Raises:
            CapabilityError: the ranges overlap, are unsorted, or leave out
                positions the ring needs (the message lists them).
            CorruptEntryError: the snapshots are malformed or of different rings.
        """
        snaps = self.as_snapshots(snapshots)
        for prev, snap in zip(snaps, snaps[1:], strict=False):
            self.check_compatible(snaps[0], snap, ("dtype", "max_size", "keep"))
            if snap.start < prev.stop:
                raise CapabilityError(
                    f"[{type(self).__name__}.restore] Ranges must be sorted by start and "
                    f"must not overlap; received {_spans([(s.start, s.stop) for s in snaps])}.",
                    ranges=[(s.start, s.stop) for s in snaps],
                )
        last = snaps[-1]
        n, max_size, keep = last.stop, int(last.meta["max_size"]), int(last.meta["keep"])
        order, idx = self._layout(n, max_size, keep, last)
        pieces, gone = [], []
        for a, b in order:
            got, gaps = _gather(self, snaps, a, b)
            pieces.extend(got)
            gone.extend(gaps)
        if gone:
            raise CapabilityError(
                f"[{type(self).__name__}.restore] A ring at position {n} (window {max_size}, "
                f"keep {keep}) needs positions {_spans(sorted(order))}; the snapshots leave "
                f"out {_spans(sorted(gone))}. Pass the blocks that cover the keep tokens "
                f"and the window.",
                missing=sorted(gone),
            )
        if not pieces:  # n == 0: the snapshot's zero rows still carry the shapes
            pieces = [self.rows_from_tensors(last.tensors)]
        cache = self.make_cache(last.meta)
        capacity = min(growth_capacity(n, cache.step), max_size) if n < max_size else max_size

        def build(trees: list[Any]) -> Any:
            cache.keys, cache.values = trees
            cache.offset, cache._idx = n, idx
            return cache

        joins = [RowsJoin([p[side] for p in pieces], capacity) for side in (0, 1)]
        # A ring not yet full (capacity past n) may take its room unwritten.
        return CachePlan(joins, build, room_unwritten=isinstance(cache, UnwrittenRoom))

    @staticmethod
    def _layout(n: int, max_size: int, keep: int, last: Snapshot) -> tuple[list[Interval], int]:
        """The absolute positions of the restored buffer's rows in buffer
        order, and the ring's ``_idx``."""
        order = window_positions(n, max_size, keep)
        if n <= max_size:
            return order, n
        # Rebuild the rotation only from a snapshot taken at the ring's latest position.
        idx = last.meta.get("ring_idx") if last.meta["offset"] == n else None
        if idx is None:
            return order, max_size
        *sinks, (start, _) = order
        split = start + max_size - idx
        return [*sinks, *((a, b) for a, b in ((split, n), (start, split)) if b > a)], idx


def _gather(
    codec: RowCodec, snaps: Sequence[Snapshot], a: int, b: int
) -> tuple[list[tuple[Tree, Tree]], list[Interval]]:
    """Row pieces for positions ``[a, b)`` from sorted snapshots, and the gaps."""
    pieces, gaps, pos = [], [], a
    for snap in snaps:
        lo, hi = max(pos, snap.start), min(b, snap.stop)
        if lo >= hi:
            continue
        if lo > pos:
            gaps.append((pos, lo))
        keys, values = codec.rows_from_tensors(snap.tensors)
        pieces.append(
            (
                slice_rows(keys, lo - snap.start, hi - snap.start),
                slice_rows(values, lo - snap.start, hi - snap.start),
            )
        )
        pos = hi
    if pos < b:
        gaps.append((pos, b))
    return pieces, gaps


class RotatingKVCodec(RawRowCodec, RingKVCodec):
    """``kv:rotating-plain``: a window of raw rows (``keys``, ``values``)."""

    family = ROTATING_PLAIN_FAMILY

    def make_cache(self, meta: Mapping[str, Any]) -> RotatingKVCache:
        return RotatingKVCache(int(meta["max_size"]), keep=int(meta["keep"]))


class RotatingQuantizedKVCodec(AffineRowCodec, RingKVCodec):
    """``kv:rotating-quant:{bits}:{group}``: a window of affine rows, stored as they are."""

    family = ROTATING_QUANT_FAMILY

    def make_cache(self, meta: Mapping[str, Any]) -> RotatingQuantizedKVCache:
        return RotatingQuantizedKVCache(
            int(meta["max_size"]),
            keep=int(meta["keep"]),
            group_size=self.group_size,
            bits=self.bits,
        )
