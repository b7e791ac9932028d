"""Codecs of the TurboQuant caches: ``kv:turboquant`` and ``kv:rotating-turboquant``.

Rows are stored as the cache holds them (spec ``specs/turboquant.md``):
``keys.codes`` (uint32 ``[B, H, T, ceil(D*b/32)]``, MLX affine bit order) and
``keys.scales`` (float16, or float32 when the encoder needed it, ``[B, H, T]``),
the same for ``values``. Nothing is re-encoded: a restored cache holds the
same codes and scales and decodes them into the same rows. How they were
encoded -- codebook, rotation, scale modes, seed, key mean -- is described in
``meta["tq"]`` and side tensors, and checked on every read
(:mod:`kvstore.codecs.turboquant_params` says what is stored and why).

Encoding is deterministic: the same rows with the same parameters give
byte-identical snapshots and records. ``from_dense`` encodes with the spec's
defaults (seed 0, keys ``matched``, values ``ls``, one RHT round).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

import mlx.core as mx

from kvstore.abc.codec import Snapshot
from kvstore.caches import RotatingTurboQuantKVCache, TurboQuantKVCache
from kvstore.caches.base import Tree
from kvstore.caches.turboquant import (
    ROTATING_TURBOQUANT_FAMILY,
    TURBOQUANT_FAMILY,
    stored_rows,
)
from kvstore.codecs.arrays import MLX_DTYPES, as_mlx, dtype_name
from kvstore.codecs.growing import GrowingKVCodec
from kvstore.codecs.plans import CachePlan
from kvstore.codecs.ring import RingKVCodec
from kvstore.codecs.rows import RowCodec
from kvstore.codecs.turboquant_params import (
    SIDES,
    TurboQuantParams,
    Unreadable,
    check_described,
    read_params,
)
from kvstore.errors import CorruptEntryError
from kvstore.signature import parse_signature
from kvstore.turboquant.quantizer import decode_many, encode_many

__all__ = ["TurboQuantRowCodec", "TurboQuantKVCodec", "RotatingTurboQuantKVCodec"]

_SCALE_DTYPES = ("float16", "float32")
_ROW_DTYPES = ("float16", "bfloat16", "float32")


class TurboQuantRowCodec(RowCodec):
    """TurboQuant rows ``(codes, scales)`` and their description; a layout base
    (growing or ring) says where the rows sit in the cache."""

    parts = (".codes", ".scales")
    own_meta = ("tq",)

    @abstractmethod
    def make_cache(self, meta: Mapping[str, Any]) -> Any:
        """An empty cache of this codec's signature, configured from ``meta["tq"]``."""

    @property
    def kbits(self) -> int:
        return parse_signature(self.signature).kbits

    @property
    def vbits(self) -> int:
        return parse_signature(self.signature).vbits

    # -- rows <-> tensors ----------------------------------------------------------------
    def tensors_from_rows(self, keys: Tree, values: Tree) -> dict[str, Any]:
        # A cache's row tree also holds the decoded working copy; only codes and scales are stored.
        return super().tensors_from_rows(stored_rows(keys), stored_rows(values))

    def snapshot(self, cache: Any, start: int = 0, stop: int | None = None) -> Snapshot:
        snap = super().snapshot(cache, start, stop)  # type: ignore[safe-super]
        tq, side = TurboQuantParams.of_cache(cache).describe(snap.start)
        return replace(snap, tensors={**snap.tensors, **side}, meta={**snap.meta, "tq": tq})

    def sliced(
        self, snapshot: Snapshot, start: int, stop: int, rows: Mapping[str, Any]
    ) -> Snapshot:
        # The side tensors of a range are its own (the dense rotation rides the block at 0).
        _, side = self.params(snapshot).describe(start)
        return Snapshot(self.signature, start, stop, {**rows, **side}, dict(snapshot.meta))

    # -- validation -------------------------------------------------------------------------
    def _snapshot_problem(self, snap: Snapshot) -> str | None:
        rows = {n: snap.tensors[n] for n in self.tensor_names() if n in snap.tensors}
        problem = super()._snapshot_problem(replace(snap, tensors=rows))
        if problem:
            return problem
        try:
            read_params(snap, self.kbits, self.vbits)
        except Unreadable as exc:
            return str(exc)
        return None

    def description_problem(self, snapshot: Snapshot) -> str | None:
        # As on restore, but a dense rotation's matrix and the key mean's values are
        # checked when restored (a described snapshot has no values).
        rows = {n: snapshot.tensors[n] for n in self.tensor_names() if n in snapshot.tensors}
        problem = super()._snapshot_problem(replace(snapshot, tensors=rows))
        if problem:
            return problem
        try:
            check_described(snapshot, self.kbits, self.vbits)
        except Unreadable as exc:
            return str(exc)
        return None

    def _rows_dtype_problem(self, snap: Snapshot) -> str | None:
        if snap.meta["dtype"] not in _ROW_DTYPES:
            return f"meta dtype {snap.meta['dtype']} is not a float dtype {_ROW_DTYPES}"
        for name, _ in SIDES:
            codes, scales = snap.tensors[f"{name}.codes"], snap.tensors[f"{name}.scales"]
            if dtype_name(codes) != "uint32":
                return f"{name}.codes has dtype {dtype_name(codes)}, not uint32"
            if dtype_name(scales) not in _SCALE_DTYPES:
                return f"{name}.scales has dtype {dtype_name(scales)}, not one of {_SCALE_DTYPES}"
        return None

    def check_compatible(self, first: Snapshot, other: Snapshot, keys: Sequence[str]) -> None:
        # Rows encoded with other parameters (seed, modes, rotation, key mean) never join.
        super().check_compatible(first, other, (*keys, "tq"))
        a, b = first.tensors.get("keys.mu"), other.tensors.get("keys.mu")
        if a is not None and b is not None and not mx.array_equal(as_mlx(a), as_mlx(b)).item():
            raise self._corrupt(
                f"snapshots [{first.start}, {first.stop}) and [{other.start}, {other.stop}) "
                f"centre keys on different means; the ranges are not of one cache"
            )

    def _corrupt(self, problem: str) -> CorruptEntryError:
        return CorruptEntryError(
            f"[{type(self).__name__}.restore] {problem}.", signature=self.signature
        )

    def params(self, snap: Snapshot) -> TurboQuantParams:
        """The checked parameters of one of this codec's snapshots.

        Raises:
            CorruptEntryError: they do not match their ids, or this host cannot
                obtain the snapshot's dense rotation.
        """
        try:
            return read_params(snap, self.kbits, self.vbits)
        except Unreadable as exc:
            raise self._corrupt(str(exc)) from exc

    # -- restore ----------------------------------------------------------------------------
    def plan_restore(self, snapshots: Snapshot | Sequence[Snapshot]) -> CachePlan:
        """The layout base's plan, whose cache then adopts the codes: the store
        restores through plans, so the decode must happen in the plan's build."""
        snaps = self.as_snapshots(snapshots)  # checks each; remembers carried matrices
        params = self.params(snaps[0])
        plan = cast(CachePlan, super().plan_restore(snaps))  # type: ignore[safe-super]

        def build(trees: list[Any]) -> Any:
            cache = plan.build(trees)
            cache.load_encoded(
                cache.keys,
                cache.values,
                dtype_name=snaps[0].meta["dtype"],
                head_dim=params.head_dim,
                mu=params.mu,
                rotations=(params.keys.rotation, params.values.rotation),
                rows=self.filled_rows(cache),
            )
            mx.eval(cache.keys, cache.values)
            return cache

        return CachePlan(plan.joins, build, reusable=plan.reusable)

    def filled_rows(self, cache: Any) -> int:
        """Buffer rows of a restored cache that hold tokens (the rest is capacity)."""
        return int(cache.offset)

    # -- dense ------------------------------------------------------------------------------
    def to_dense(self, snapshot: Snapshot) -> tuple[mx.array, mx.array]:
        self.check_snapshot(snapshot)
        params = self.params(snapshot)
        dtype = MLX_DTYPES[snapshot.meta["dtype"]]
        kq, vq = params.quantizers()
        (kc, ks), (vc, vs) = self.rows_from_tensors(snapshot.tensors)
        # Together: on a CUDA GPU one launch for both (a restore's stacked layers too).
        keys, values = decode_many(
            [
                (kq, as_mlx(kc), as_mlx(ks), dtype, params.key_mean()),
                (vq, as_mlx(vc), as_mlx(vs), dtype, None),
            ]
        )
        return keys, values

    def from_dense(
        self, keys: Any, values: Any, *, start: int, stop: int, meta: Mapping[str, Any]
    ) -> Snapshot:
        dtype = MLX_DTYPES[meta["dtype"]]
        keys, values = as_mlx(keys).astype(dtype), as_mlx(values).astype(dtype)
        params = TurboQuantParams.defaults(self.kbits, self.vbits, int(keys.shape[-1]))
        kq, vq = params.quantizers()
        tensors: dict[str, Any] = {}
        encoded = encode_many([(kq, keys, None), (vq, values, None)])
        for (name, _), (codes, scales) in zip(SIDES, encoded, strict=True):
            tensors[f"{name}.codes"], tensors[f"{name}.scales"] = codes, scales
        tq, side = params.describe(start)
        return Snapshot(self.signature, start, stop, {**tensors, **side}, {**meta, "tq": tq})


class TurboQuantKVCodec(TurboQuantRowCodec, GrowingKVCodec):
    """``kv:turboquant:{kbits}:{vbits}``: growing TurboQuant rows, stored as they are."""

    family = TURBOQUANT_FAMILY

    def make_cache(self, meta: Mapping[str, Any]) -> TurboQuantKVCache:
        return TurboQuantKVCache(self.kbits, self.vbits, **_cache_options(meta))


class RotatingTurboQuantKVCodec(TurboQuantRowCodec, RingKVCodec):
    """``kv:rotating-turboquant:{kbits}:{vbits}``: a window of TurboQuant rows."""

    family = ROTATING_TURBOQUANT_FAMILY

    def make_cache(self, meta: Mapping[str, Any]) -> RotatingTurboQuantKVCache:
        return RotatingTurboQuantKVCache(
            int(meta["max_size"]),
            keep=int(meta["keep"]),
            kbits=self.kbits,
            vbits=self.vbits,
            **_cache_options(meta),
        )

    def filled_rows(self, cache: Any) -> int:
        return min(int(cache.offset), int(cache.max_size))


def _cache_options(meta: Mapping[str, Any]) -> dict[str, Any]:
    """Cache arguments from a checked snapshot's ``meta["tq"]``."""
    tq = meta["tq"]
    signs = tq["k"]["rotation"].get("signs", [None])
    return {
        "seed": tq["seed"],
        "key_scale_mode": tq["k"]["scale_mode"],
        "value_scale_mode": tq["v"]["scale_mode"],
        "center": tq["center"],
        "rounds": len(signs),
    }
