"""Codecs of caches whose rows grow without bound: ``kv:plain`` and ``kv:quant``.

The cache holds positions ``[0, offset)`` at buffer rows ``[0, offset)``
(capacity padding beyond). A snapshot of ``[start, stop)`` is those rows; a
restore concatenates ranges that start at 0 and follow each other.

A restore sizes the buffer for the prompt it serves (:func:`room_for`), not only for
the rows it restores: mlx-lm's caches grow a buffer whose rows are not a multiple of
their ``step`` by cutting it to its rows and appending ``step`` multiples, so a prompt's
rest run through a buffer sized for the restored rows alone copies the whole cache
(llama-8B shape, 4069 restored + 66 on the CI VM: 225-240 ms, against 8-11 ms written
in place: ``tools/bench/restore_rest.py``) and leaves it a size no fresh prefill makes
(4325 rows; on MLX's CUDA backend each new buffer size a decode step meets builds a
cuDNN graph). The room is the prompt's rows rounded up to the step, the buffer a cold
prefill of that prompt leaves: the restored session's steps then run over the sizes a
cold one's do (a step more, 4352 rows for a 4096-token prompt, cost G1's first token a
cuDNN graph of its own on an H100: 63 ms against 10-15). ``mlx_lm.server``'s batching
copies a request's cache into a buffer of its own anyway (``BatchKVCache.merge``): there
the room saves nothing.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from kvstore.abc.codec import Snapshot
from kvstore.caches import KVCache, QuantizedKVCache
from kvstore.caches.base import UnwrittenRoom, stored_buffers
from kvstore.caches.plain import PLAIN_FAMILY
from kvstore.caches.quantized import QUANT_FAMILY
from kvstore.codecs.plans import CachePlan, RowsJoin, run_plans
from kvstore.codecs.rows import (
    AffineRowCodec,
    RawRowCodec,
    RowCodec,
    growth_capacity,
    slice_rows,
)
from kvstore.errors import CapabilityError

__all__ = ["GrowingKVCodec", "PlainKVCodec", "QuantizedKVCodec", "restore_capacity", "room_for"]

#: The tokens a restore's caller will hold once the rest of its prompt has run.
_ROOM: ContextVar[int] = ContextVar("kvstore_restore_room", default=0)


@contextmanager
def room_for(tokens: int) -> Iterator[None]:
    """Growing caches restored in this context (on this thread) get room for ``tokens``
    (a lookup's ``prompt_tokens``) rounded up to their ``step``, however few rows they
    restore; one that restores all ``tokens`` gets room for one more (as without)."""
    reset = _ROOM.set(tokens)
    try:
        yield
    finally:
        _ROOM.reset(reset)


def restore_capacity(rows: int, room: int, step: int) -> int:
    """The buffer rows of a growing cache restoring ``rows`` for a prompt of ``room``
    tokens: the prompt's rows rounded up to ``step`` (what its cold prefill leaves),
    or, where the prompt runs no further, room for the next token."""
    if room <= rows:
        return growth_capacity(rows, step)
    return -(-room // step) * step


class GrowingKVCodec(RowCodec):
    """Snapshot/restore of a growing cache; a family adds its row encoding and cache class."""

    @abstractmethod
    def make_cache(self, meta: Mapping[str, Any]) -> Any:
        """An empty live cache of this codec's signature."""

    def snapshot(self, cache: Any, start: int = 0, stop: int | None = None) -> Snapshot:
        self.check_cache(cache)
        offset = int(cache.offset)
        start, stop = self.check_range(start, stop, offset)
        buffers = stored_buffers(cache)  # rows below offset only
        keys, values = slice_rows(buffers[0], start, stop), slice_rows(buffers[1], start, stop)
        meta = {"dtype": self.meta_dtype(cache, keys), "offset": offset}
        return Snapshot(self.signature, start, stop, self.tensors_from_rows(keys, values), meta)

    def slice(self, snapshot: Snapshot, start: int, stop: int) -> Snapshot:
        """Rows ``[start, stop)`` of a growing cache's snapshot (views; meta as taken)."""
        if not snapshot.start <= start <= stop <= snapshot.stop:
            raise ValueError(
                f"[{type(self).__name__}.slice] [{start}, {stop}) is not inside the "
                f"snapshot's [{snapshot.start}, {snapshot.stop})."
            )
        a, b = start - snapshot.start, stop - snapshot.start
        rows = {
            name: snapshot.tensors[name][:, :, a:b]
            for name in self.tensor_names()
            if name in snapshot.tensors
        }
        return self.sliced(snapshot, start, stop, rows)

    def sliced(
        self, snapshot: Snapshot, start: int, stop: int, rows: Mapping[str, Any]
    ) -> Snapshot:
        """The range snapshot given its cut rows (a family adds its side tensors)."""
        return Snapshot(self.signature, start, stop, dict(rows), dict(snapshot.meta))

    def restore(self, snapshots: Snapshot | Sequence[Snapshot]) -> Any:
        return run_plans([self.plan_restore(snapshots)])[0]

    def plan_restore(self, snapshots: Snapshot | Sequence[Snapshot]) -> CachePlan:
        snaps = self.as_snapshots(snapshots)
        expected = 0
        for snap in snaps:
            if snap.start != expected:
                raise CapabilityError(
                    f"[{type(self).__name__}.restore] A growing cache is rebuilt from ranges "
                    f"that start at 0 and follow each other; expected a range starting at "
                    f"{expected}, received [{snap.start}, {snap.stop}).",
                    expected=expected,
                    ranges=[(s.start, s.stop) for s in snaps],
                )
            self.check_compatible(snaps[0], snap, ("dtype",))
            expected = snap.stop
        meta = snaps[-1].meta
        probe = self.make_cache(meta)
        capacity = restore_capacity(expected, _ROOM.get(), probe.step)
        rows = [self.rows_from_tensors(s.tensors) for s in snaps]

        def build(trees: list[Any]) -> Any:
            cache = self.make_cache(meta)  # a new one each call: the plan is reusable
            cache.keys, cache.values = trees
            cache.offset = expected
            return cache

        joins = [RowsJoin([r[side] for r in rows], capacity) for side in (0, 1)]
        room_unwritten = isinstance(probe, UnwrittenRoom)
        return CachePlan(joins, build, reusable=True, room_unwritten=room_unwritten)


class PlainKVCodec(RawRowCodec, GrowingKVCodec):
    """``kv:plain``: raw rows (``keys``, ``values``)."""

    family = PLAIN_FAMILY

    def make_cache(self, meta: Mapping[str, Any]) -> KVCache:
        return KVCache()


class QuantizedKVCodec(AffineRowCodec, GrowingKVCodec):
    """``kv:quant:{bits}:{group}``: affine rows (``keys.q``, ``keys.scales``,
    ``keys.biases``, same for ``values``), stored as they are."""

    family = QUANT_FAMILY

    def make_cache(self, meta: Mapping[str, Any]) -> QuantizedKVCache:
        return QuantizedKVCache(self.group_size, self.bits)
