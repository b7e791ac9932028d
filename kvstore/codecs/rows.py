"""Row trees <-> snapshot tensors, and the row encodings codecs share.

A cache stores keys and values as *row trees* shaped ``[B, H, T, width]``
(see :mod:`kvstore.caches.base`): a bare array for raw rows, a
``(q, scales, biases)`` tuple for MLX affine rows, ``(q, scales)`` for MLX
microscaling rows. A snapshot names each leaf: ``keys``/``values`` for raw
rows, ``keys.q``/``keys.scales``/``keys.biases`` (and the same for
``values``) for affine rows, ``keys.q``/``keys.scales`` for microscaling rows.

An *encoding* mixin (:class:`RawRowCodec`, :class:`AffineRowCodec`,
:class:`MicroscalingRowCodec`) tells a codec those names and how its rows
convert to and from dense float rows; a *layout* base
(:mod:`kvstore.codecs.growing`, :mod:`kvstore.codecs.ring`) says how rows sit
in the cache. A codec is one of each, plus the family it serves.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import mlx.core as mx

from kvstore.abc.codec import KVCodec, Snapshot
from kvstore.caches.base import Tree, stored_buffers
from kvstore.caches.packed import quantize_rows
from kvstore.codecs.arrays import MLX_DTYPES, as_mlx, dtype_name, owned_arrays
from kvstore.codecs.plans import RowsJoin, row_leaves_of
from kvstore.codecs.registry import reported_signature
from kvstore.codecs.snapshot_meta import checked_by, decoded_alike, position_problem
from kvstore.errors import CapabilityError, CorruptEntryError
from kvstore.family import Quantization
from kvstore.signature import parse_signature

__all__ = [
    "Tree",
    "RowCodec",
    "RawRowCodec",
    "PackedRowCodec",
    "AffineRowCodec",
    "MicroscalingRowCodec",
    "growth_capacity",
    "slice_rows",
    "join_rows",
]


def growth_capacity(tokens: int, step: int) -> int:
    """Capacity for ``tokens`` rows rounded up to ``step`` with room for one
    more token, so the next decode step writes in place."""
    return (tokens // step + 1) * step


def slice_rows(tree: Tree, start: int, stop: int) -> Tree:
    """Rows ``[start, stop)`` (axis 2) of every leaf; views, not copies."""
    if isinstance(tree, (tuple, list)):  # mlx-lm's to_quantized leaves lists
        return tuple(leaf[:, :, start:stop] for leaf in tree)
    return tree[:, :, start:stop]


def join_rows(pieces: Sequence[Tree], capacity: int) -> Tree:
    """The pieces concatenated along tokens into owned MLX arrays of
    ``capacity`` rows, zero-padded after the last piece (one copy of each piece;
    see :class:`~kvstore.codecs.plans.RowsJoin`)."""
    join = RowsJoin(pieces, capacity)
    mx.eval(join.lazy())
    return join.fill(owned_arrays(join.leaves()))


@functools.cache
def _names(parts: tuple[str, ...]) -> tuple[str, ...]:
    """A row codec's tensor names, keys' then values' (one tuple per ``parts``: a
    restore checks each of its snapshots' names, 512 of them at 4096 tokens)."""
    return tuple(f"{side}{part}" for side in ("keys", "values") for part in parts)


@functools.cache
def _sorted_names(parts: tuple[str, ...]) -> list[str]:
    return sorted(_names(parts))  # compared, never handed out


class RowCodec(KVCodec):
    """How a family's rows are named in a snapshot and turned into dense rows."""

    #: Suffixes of the leaves of one row tree ("" for a bare array).
    parts: ClassVar[tuple[str, ...]]

    # -- names -----------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        return list(_names(tuple(self.parts)))

    def tensors_from_rows(self, keys: Tree, values: Tree) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for side, tree in (("keys", keys), ("values", values)):
            leaves = row_leaves_of(tree)
            for part, leaf in zip(self.parts, leaves, strict=True):
                out[f"{side}{part}"] = leaf
        return out

    def rows_from_tensors(self, tensors: Mapping[str, Any]) -> tuple[Tree, Tree]:
        names = _names(tuple(self.parts))
        half = len(names) // 2
        if half == 1:
            return tensors[names[0]], tensors[names[1]]
        return tuple(tensors[n] for n in names[:half]), tuple(tensors[n] for n in names[half:])

    def rows_dtype(self, keys: Tree) -> str:
        """The float dtype of the rows (raw rows, or affine scales)."""
        leaves = row_leaves_of(keys)
        return dtype_name(leaves[-1])

    def meta_dtype(self, cache: Any, keys: Tree) -> str:
        """The ``dtype`` a snapshot of ``cache`` records: the float dtype of its rows."""
        return self.rows_dtype(keys)

    # -- validation --------------------------------------------------------------
    def check_range(self, start: int, stop: int | None, offset: int) -> tuple[int, int]:
        """``(start, stop)`` with ``stop`` defaulted to ``offset``.

        Raises:
            ValueError: not ints, negative, or ``start > stop``.
            CapabilityError: ``stop`` is past the cache's ``offset``.
        """
        stop = offset if stop is None else stop
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop):
            raise ValueError(
                f"[{type(self).__name__}.snapshot] A token range needs ints 0 <= start <= stop; "
                f"received start={start!r}, stop={stop!r}."
            )
        if stop > offset:
            raise CapabilityError(
                f"[{type(self).__name__}.snapshot] The cache holds {offset} tokens; "
                f"positions [{max(start, offset)}, {stop}) of [{start}, {stop}) do not exist yet.",
                start=start,
                stop=stop,
                offset=offset,
            )
        return start, stop

    def check_cache(self, cache: Any) -> None:
        """Raise ``CapabilityError`` unless ``cache`` is a non-empty cache of this signature."""
        found = reported_signature(cache) or "unknown"
        if found != self.signature:
            raise CapabilityError(
                f"[{type(self).__name__}.snapshot] This codec snapshots '{self.signature}' "
                f"caches; received a cache with signature '{found}'. Use codec_for(cache).",
                signature=found,
            )
        if stored_buffers(cache)[0] is None:
            raise CapabilityError(
                f"[{type(self).__name__}.snapshot] The cache is empty: nothing to snapshot "
                f"(not even its shapes). Snapshot after the first update.",
                signature=found,
            )

    def as_snapshots(self, snapshots: Snapshot | Sequence[Snapshot]) -> list[Snapshot]:
        """The snapshots as a non-empty list, each checked against the codec."""
        snaps = [snapshots] if isinstance(snapshots, Snapshot) else list(snapshots)
        if not snaps:
            raise ValueError(f"[{type(self).__name__}.restore] Nothing to restore: no snapshots.")
        # A snapshot decoded as its header described it, which this codec's description
        # check passed at the header's parse, is not checked again when that check is
        # the whole of this one (TurboQuant's checks less: its carried matrices).
        trusted = (
            type(self) if type(self).description_problem is RowCodec.description_problem else None
        )
        for snap in snaps:
            if (
                trusted is None
                or checked_by(snap) is not trusted
                or snap.signature != self.signature
            ):
                self.check_snapshot(snap)
        return snaps

    def check_snapshot(self, snap: Snapshot) -> None:
        """Raise ``CorruptEntryError`` unless ``snap`` is a well-formed
        snapshot of this codec's signature."""
        problem = self._snapshot_problem(snap)
        if problem:
            raise CorruptEntryError(
                f"[{type(self).__name__}.restore] {problem}; the snapshot cannot be restored.",
                signature=snap.signature,
            )

    def description_problem(self, snapshot: Snapshot) -> str | None:
        # The checks of restore: they read shapes, dtypes and meta only.
        return self._snapshot_problem(snapshot)

    def _snapshot_problem(self, snap: Snapshot) -> str | None:
        if snap.signature != self.signature:
            return f"snapshot of '{snap.signature}' given to the '{self.signature}' codec"
        names = _names(tuple(self.parts))
        if sorted(snap.tensors) != _sorted_names(tuple(self.parts)):
            return f"tensors {sorted(snap.tensors)} where {list(names)} belong"
        dtype = snap.meta.get("dtype")
        if not isinstance(dtype, str) or dtype not in MLX_DTYPES:
            return f"meta dtype {snap.meta.get('dtype')!r} is not a known dtype"
        offset = position_problem(snap.meta, "offset", snap.stop)  # abc.codec: always there
        if offset:
            return offset
        lead = None
        for name in names:
            shape = tuple(snap.tensors[name].shape)
            if len(shape) < 3 or shape[2] != snap.stop - snap.start:
                return f"tensor '{name}' has shape {shape}, not [B, H, {snap.tokens}, ...]"
            if lead is None:
                lead = shape[:2]
            elif shape[:2] != lead:
                return f"tensor '{name}' has batch/heads {shape[:2]}, not {lead}"
        return self._rows_dtype_problem(snap)

    def _rows_dtype_problem(self, snap: Snapshot) -> str | None:
        """What is wrong with the dtypes of ``snap``'s rows against its meta ``dtype``."""
        keys, _ = self.rows_from_tensors(snap.tensors)
        if self.rows_dtype(keys) != snap.meta["dtype"]:
            return f"rows of dtype {self.rows_dtype(keys)} but meta dtype {snap.meta['dtype']}"
        return None

    def check_compatible(self, first: Snapshot, other: Snapshot, keys: Sequence[str]) -> None:
        """Raise ``CorruptEntryError`` unless ``other`` can be joined with ``first``."""
        if first is other or decoded_alike(first, other):
            return  # equal metas and tensor shapes, rows included
        for key in keys:
            if first.meta.get(key) != other.meta.get(key):
                raise CorruptEntryError(
                    f"[{type(self).__name__}.restore] snapshots disagree on {key}: "
                    f"{first.meta.get(key)!r} for [{first.start}, {first.stop}) and "
                    f"{other.meta.get(key)!r} for [{other.start}, {other.stop}).",
                    signature=self.signature,
                )
        for name in _names(tuple(self.parts)):
            a, b = tuple(first.tensors[name].shape), tuple(other.tensors[name].shape)
            if a[:2] + a[3:] != b[:2] + b[3:]:
                raise CorruptEntryError(
                    f"[{type(self).__name__}.restore] tensor '{name}' is {tuple(a)} in "
                    f"[{first.start}, {first.stop}) but {tuple(b)} in "
                    f"[{other.start}, {other.stop}); the ranges are not of one cache.",
                    signature=self.signature,
                )


class RawRowCodec(RowCodec):
    """Rows stored as they come: float16, bfloat16 or float32."""

    parts = ("",)

    def to_dense(self, snapshot: Snapshot) -> tuple[mx.array, mx.array]:
        self.check_snapshot(snapshot)
        keys, values = self.rows_from_tensors(snapshot.tensors)
        return as_mlx(keys), as_mlx(values)

    def from_dense(
        self, keys: Any, values: Any, *, start: int, stop: int, meta: Mapping[str, Any]
    ) -> Snapshot:
        dtype = MLX_DTYPES[meta["dtype"]]
        keys, values = as_mlx(keys).astype(dtype), as_mlx(values).astype(dtype)
        return Snapshot(
            self.signature, start, stop, self.tensors_from_rows(keys, values), dict(meta)
        )


class PackedRowCodec(RowCodec):
    """Rows packed by ``mx.quantize`` in the family's mode (:mod:`kvstore.caches.packed`):
    packed uint32 words ``.q`` and per-group ``.scales`` (and affine ``.biases``)."""

    @functools.cached_property
    def quantization(self) -> Quantization:
        """How this codec's signature's rows are packed (mode, bits, group size)."""
        q = self.family.quantization(parse_signature(self.signature))
        assert q is not None, f"{self.kind} has no quantized attention"
        return q

    @property
    def bits(self) -> int:
        return self.quantization.bits

    @property
    def group_size(self) -> int:
        return self.quantization.group_size

    def _snapshot_problem(self, snap: Snapshot) -> str | None:
        problem = super()._snapshot_problem(snap)
        if problem:
            return problem
        for side in ("keys", "values"):
            q, scales = snap.tensors[f"{side}.q"], snap.tensors[f"{side}.scales"]
            head_dim = int(scales.shape[3]) * self.group_size
            if int(q.shape[3]) * 32 != head_dim * self.bits:
                return (
                    f"{side}.q has {q.shape[3]} words per row, which does not hold "
                    f"{head_dim} dims of {self.bits} bits"
                )
            if dtype_name(q) != "uint32":
                return f"{side}.q has dtype {dtype_name(q)}, not uint32"
        return None

    def dequantize(self, tree: Tree, dtype: str) -> mx.array:
        """Float rows of ``dtype`` from one packed row tree."""
        q = self.quantization
        packed, scales, *biases = (as_mlx(a) for a in row_leaves_of(tree))
        return mx.dequantize(
            packed,
            scales,
            biases[0] if biases else None,
            group_size=q.group_size,
            bits=q.bits,
            mode=q.mode,
            dtype=MLX_DTYPES[dtype],
        )

    def to_dense(self, snapshot: Snapshot) -> tuple[mx.array, mx.array]:
        self.check_snapshot(snapshot)
        keys, values = self.rows_from_tensors(snapshot.tensors)
        dtype = snapshot.meta["dtype"]
        return self.dequantize(keys, dtype), self.dequantize(values, dtype)

    def from_dense(
        self, keys: Any, values: Any, *, start: int, stop: int, meta: Mapping[str, Any]
    ) -> Snapshot:
        dtype = MLX_DTYPES[meta["dtype"]]
        # The caches' own encoder: same kernel, same CapabilityError when no group fits.
        sig = parse_signature(self.signature)
        trees = [quantize_rows(as_mlx(x).astype(dtype), sig) for x in (keys, values)]
        return Snapshot(self.signature, start, stop, self.tensors_from_rows(*trees), dict(meta))


class AffineRowCodec(PackedRowCodec):
    """MLX affine rows ``(q, scales, biases)``: packed uint32 words and
    per-group scales/biases in the model's float dtype."""

    parts = (".q", ".scales", ".biases")

    def dequantize(self, tree: Tree, dtype: str) -> mx.array:
        # Scales carry the dtype; the output is theirs (as before microscaling: same bytes).
        q, scales, biases = (as_mlx(a) for a in tree)
        return mx.dequantize(q, scales, biases, group_size=self.group_size, bits=self.bits)


class MicroscalingRowCodec(PackedRowCodec):
    """MLX microscaling rows ``(q, scales)`` (``mxfp8``/``mxfp4``/``nvfp4``): packed
    uint32 words and one uint8 scale per group, no biases. The scales say nothing
    of the model's dtype, so the cache remembers it (``dtype_name``) and
    snapshots record it as ``meta["dtype"]``."""

    parts = (".q", ".scales")

    def meta_dtype(self, cache: Any, keys: Tree) -> str:
        return str(cache.dtype_name)

    def _rows_dtype_problem(self, snap: Snapshot) -> str | None:
        if snap.meta["dtype"] not in _FLOAT_DTYPES:
            return f"meta dtype {snap.meta['dtype']} is not a float dtype {_FLOAT_DTYPES}"
        for side in ("keys", "values"):
            scales = snap.tensors[f"{side}.scales"]
            if dtype_name(scales) != "uint8":
                return f"{side}.scales has dtype {dtype_name(scales)}, not uint8"
        return None


_FLOAT_DTYPES = ("float16", "bfloat16", "float32")
