"""Codecs of recurrent state: a *checkpoint* -- the state at one token position.

A recurrent layer keeps no row per token, so there is no token range to
snapshot: a snapshot of ``rec:gated-delta`` or ``rec:arrays:{slots}`` is the
layer's state after ``p`` tokens, with ``start == stop == p`` (zero rows).
It restores to a cache at offset ``p``; it cannot be cut to an earlier
position, and ranges do not concatenate (the last checkpoint is the state).

Tensors (layer-free names, any shape, stored as they are -- restore is
bit-exact):

* ``rec:gated-delta``: ``conv`` (``[B, K - 1, conv_dim]``, the model's dtype)
  and ``state`` (``[B, Hv, Dv, Dk]``, float32);
* ``rec:arrays:{slots}``: ``slot.{i}`` for every slot that holds an array
  (``meta["present"]`` says which).

``meta``: ``dtype`` (of the first array), ``offset`` (the position).

A stock mlx-lm ``ArraysCache`` keeps no offset, so its position is the
caller's to say (``snapshot(cache, p, p)``: the prefix store passes the
position of the model's KV layers); our caches keep one, and a snapshot at
another position than theirs raises.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvstore.abc.codec import KVCodec, Snapshot
from kvstore.caches.recurrent import ARRAYS_FAMILY, GATED_DELTA_FAMILY, ArraysCache, GatedDeltaCache
from kvstore.codecs.arrays import as_mlx, dtype_name
from kvstore.codecs.registry import reported_signature
from kvstore.errors import CapabilityError, CorruptEntryError

__all__ = ["CheckpointCodec", "GatedDeltaCodec", "ArraysCodec", "checkpoint_position"]


def checkpoint_position(cache: Any) -> int | None:
    """The position ``cache``'s state is at: its ``offset``; ``None`` for a cache that
    keeps none (mlx-lm's ``ArraysCache``)."""
    offset = getattr(cache, "offset", None)
    return offset if isinstance(offset, int) else None


class CheckpointCodec(KVCodec):
    """A recurrent family's codec: snapshots of one position, restored to it."""

    def arrays(self, cache: Any) -> dict[str, Any]:
        """The tensors of a checkpoint of ``cache`` (non-empty)."""
        raise NotImplementedError

    def make_cache(self, tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> Any:
        """A live cache holding ``tensors`` (owned MLX arrays) at ``meta["offset"]``."""
        raise NotImplementedError

    def snapshot(self, cache: Any, start: int = 0, stop: int | None = None) -> Snapshot:
        """The state of ``cache`` at position ``stop`` (default: its offset).

        Raises:
            CapabilityError: not a cache of this signature, empty, or its state is
                not at ``stop`` (a recurrent state is at one position only).
            ValueError: ``start`` is neither 0 nor ``stop``.
        """
        found = reported_signature(cache) or "unknown"
        if found != self.signature:
            raise CapabilityError(
                f"[{type(self).__name__}.snapshot] This codec snapshots '{self.signature}' "
                f"caches; received a cache with signature '{found}'. Use codec_for(cache).",
                signature=found,
            )
        held = checkpoint_position(cache)
        position = held if stop is None else stop
        if position is None:
            raise CapabilityError(
                f"[{type(self).__name__}.snapshot] This cache keeps no offset (mlx-lm's "
                f"ArraysCache): say where its state is, snapshot(cache, p, p).",
                signature=found,
            )
        if not (isinstance(position, int) and position >= 0 and start in (0, position)):
            raise ValueError(
                f"[{type(self).__name__}.snapshot] A checkpoint is the state at one position: "
                f"start must be 0 or equal stop; received start={start!r}, stop={stop!r}."
            )
        if held is not None and position != held:
            raise CapabilityError(
                f"[{type(self).__name__}.snapshot] The state is at position {held}, not "
                f"{position}: a recurrent state cannot be cut to another position.",
                offset=held,
                position=position,
            )
        tensors = self.arrays(cache)
        if not tensors:
            raise CapabilityError(
                f"[{type(self).__name__}.snapshot] The cache is empty: nothing to checkpoint.",
                signature=found,
            )
        meta = {"dtype": dtype_name(next(iter(tensors.values()))), "offset": position}
        meta.update(self.extra_meta(cache))
        return Snapshot(self.signature, position, position, tensors, meta)

    def extra_meta(self, cache: Any) -> dict[str, Any]:
        return {}

    def restore(self, snapshots: Snapshot | Sequence[Snapshot]) -> Any:
        """A live cache at the checkpoint's position (the last one of ``snapshots``).

        Raises:
            CorruptEntryError: not a checkpoint of this signature, or malformed.
        """
        snaps = [snapshots] if isinstance(snapshots, Snapshot) else list(snapshots)
        if not snaps:
            raise ValueError(f"[{type(self).__name__}.restore] Nothing to restore: no snapshots.")
        snap = snaps[-1]
        problem = self.problem(snap)
        if problem:
            raise CorruptEntryError(
                f"[{type(self).__name__}.restore] {problem}; the checkpoint cannot be restored.",
                signature=snap.signature,
            )
        owned = {name: as_mlx(a) for name, a in snap.tensors.items()}
        # A copy, never a view of the store's page (mx.array of numpy copies; an
        # mx.array from an earlier restore is immutable, so sharing it is safe).
        return self.make_cache(owned, snap.meta)

    def problem(self, snap: Snapshot) -> str | None:
        if snap.signature != self.signature:
            return f"signature '{snap.signature}' is not '{self.signature}'"
        if snap.start != snap.stop:
            return f"a checkpoint covers no rows; received [{snap.start}, {snap.stop})"
        if snap.meta.get("offset") != snap.stop:
            return f"meta offset {snap.meta.get('offset')!r} is not the position {snap.stop}"
        return None


class GatedDeltaCodec(CheckpointCodec):
    """``rec:gated-delta``: ``conv`` and ``state``."""

    family = GATED_DELTA_FAMILY

    def arrays(self, cache: Any) -> dict[str, Any]:
        conv, state = cache[0], cache[1]
        if conv is None or state is None:
            return {}
        return {"conv": conv, "state": state}

    def problem(self, snap: Snapshot) -> str | None:
        problem = super().problem(snap)
        if problem is None and set(snap.tensors) != {"conv", "state"}:
            problem = f"tensors {sorted(snap.tensors)} are not ['conv', 'state']"
        if problem is None:
            conv, state = snap.tensors["conv"], snap.tensors["state"]
            if len(conv.shape) != 3 or len(state.shape) != 4 or conv.shape[0] != state.shape[0]:
                problem = (
                    f"shapes conv {tuple(conv.shape)} and state {tuple(state.shape)} are not "
                    f"[B, K - 1, C] and [B, Hv, Dv, Dk]"
                )
        return problem

    def make_cache(self, tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> GatedDeltaCache:
        return GatedDeltaCache.from_state((tensors["conv"], tensors["state"]), int(meta["offset"]))


class ArraysCodec(CheckpointCodec):
    """``rec:arrays:{slots}``: ``slot.{i}`` for the slots that hold an array."""

    family = ARRAYS_FAMILY

    @property
    def slots(self) -> int:
        return int(self.signature.rsplit(":", 1)[1])

    def arrays(self, cache: Any) -> dict[str, Any]:
        if (
            getattr(cache, "lengths", None) is not None
            or getattr(cache, "left_padding", None) is not None
        ):
            raise CapabilityError(
                f"[{type(self).__name__}.snapshot] A batch being prepared (lengths or left "
                f"padding set) has no single position; checkpoint a finalized cache.",
                signature=self.signature,
            )
        return {f"slot.{i}": a for i, a in enumerate(cache.cache) if a is not None}

    def extra_meta(self, cache: Any) -> dict[str, Any]:
        return {"present": [a is not None for a in cache.cache]}

    def problem(self, snap: Snapshot) -> str | None:
        problem = super().problem(snap)
        present = snap.meta.get("present")
        if problem is None and not (
            isinstance(present, list)
            and len(present) == self.slots
            and all(isinstance(p, bool) for p in present)
        ):
            problem = f"meta 'present' {present!r} does not list {self.slots} slots"
        if problem is None:
            names = {f"slot.{i}" for i, p in enumerate(present) if p}  # type: ignore[arg-type]
            if set(snap.tensors) != names:
                problem = f"tensors {sorted(snap.tensors)} are not {sorted(names)}"
        return problem

    def make_cache(self, tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> ArraysCache:
        cache = ArraysCache(self.slots)
        cache.cache = [tensors.get(f"slot.{i}") for i in range(self.slots)]
        cache.offset = int(meta["offset"])
        return cache
