"""Converting a snapshot from one family to another (the migration tool's verb).

Every conversion goes through dense float rows: the source codec's
``to_dense``, then the target codec's ``from_dense``. What that costs:

* raw -> affine (``kv:plain`` -> ``kv:quant:b:g``) is **lossy**: the rows are
  quantised;
* affine -> raw dequantises; nothing further is lost;
* affine -> affine with other bits/group dequantises and quantises again
  (lossy);
* growing <-> windowed (``kv:plain`` <-> ``kv:rotating-plain``) keeps the
  rows of the snapshot's range as they are: a windowed snapshot already
  holds only positions its window still had, and a growing one becomes a
  window by naming its ``max_size``/``keep``.

:func:`transcode_measured` also measures what was lost: the relative MSE of
keys and values (mean over vectors of ``|x - x'|^2 / |x|^2``, as in
``specs/turboquant.md``), so a migration can report it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from kvstore.abc.codec import KVCodec, Snapshot
from kvstore.codecs.plans import Stack
from kvstore.codecs.registry import get_codec
from kvstore.codecs.ring import RingKVCodec
from kvstore.codecs.snapshot_meta import note_checked_alike

__all__ = ["Transcoded", "transcode", "transcode_stacked", "transcode_measured", "relative_mse"]

_WINDOW_KEYS = ("max_size", "keep", "ring_idx")


@dataclass(frozen=True)
class Transcoded:
    """A transcoded snapshot and what the conversion lost.

    Attributes:
        snapshot: the snapshot in the target family.
        lossless: True when the target decodes to exactly the source's rows.
        relative_mse: ``{"keys": ..., "values": ...}``, 0.0 when lossless.
    """

    snapshot: Snapshot
    lossless: bool
    relative_mse: dict[str, float]


def relative_mse(x: mx.array, approx: mx.array) -> float:
    """Mean over vectors (last axis) of ``|x - approx|^2 / |x|^2``; zero vectors count as 0."""
    x32, a32 = x.astype(mx.float32), approx.astype(mx.float32)
    err = mx.sum(mx.square(x32 - a32), axis=-1)
    norm = mx.sum(mx.square(x32), axis=-1)
    ratio = mx.where(norm > 0, err / mx.maximum(norm, 1e-30), 0.0)
    return float(cast(float, mx.mean(ratio).item())) if ratio.size else 0.0


def transcode(
    snapshot: Snapshot, to_signature: str, *, max_size: int | None = None, keep: int | None = None
) -> Snapshot:
    """``snapshot`` converted to the family ``to_signature``.

    Lossy when the target quantises (``kv:plain`` -> ``kv:quant:b:g``, or
    affine -> affine with other parameters); see :func:`transcode_measured`
    for the error.

    Args:
        snapshot: the source snapshot (any registered family with a dense form).
        to_signature: the target family's signature.
        max_size, keep: the window of a windowed target; default to the
            source's when it is windowed too (``keep`` defaults to 0 otherwise).

    Raises:
        UnknownSignatureError: no codec serves the source or target kind.
        CapabilityError: a family without a dense form.
        ValueError: a windowed target without ``max_size``.
    """
    # Not measured: a restore or save transcodes every layer, and measuring
    # cost four host syncs and a float32 pass per layer (issue 13).
    return _converted(snapshot, to_signature, max_size, keep)[2]


def transcode_stacked(
    snapshots: Sequence[Snapshot],
    to_signature: str,
    stacked: Mapping[str, mx.array] | None = None,
    decoded: list[Stack] | None = None,
) -> list[Snapshot] | None:
    """:func:`transcode` of each of ``snapshots``, as one conversion of them stacked along
    the batch axis; ``None`` (nothing converted) where they cannot be stacked.

    What a lossy restore on a GPU does with its layers (one joined snapshot each): one
    decode of all of them instead of one per layer. Each decode is a few kernels, and
    in a fresh process each evaluation's kernels are instantiated as a CUDA graph
    anew; on an H200 a ``kv:quant:8:64`` restore's 64 dequantizes were 1.4 ms of
    kernels, and the restore 6.6 ms faster without graphs at all
    (``tools/bench/results/gpu/7837ba3/``). The conversion is elementwise over the
    batch axis, so each layer's rows come out the same bits as alone.

    Stacked only when every snapshot is of one signature, range and meta (plain values),
    holds MLX arrays of the same names, shapes and dtypes, and every tensor is a row
    tensor ``[B, H, rows, ...]``; and only when the converted tensors are too.

    ``stacked``: tensors of the snapshots already stacked so (views of one gather's
    output, :class:`~kvstore.codecs.plans.Stack`), used instead of concatenating them
    where their shape and dtype are the stack's.

    ``decoded``: each converted tensor's stack appended to it (its ``members`` the
    snapshots' tensors, in order), for a restore to join the layers' rows from where
    they lie (:func:`~kvstore.codecs.plans.run_plans`).
    """
    if len(snapshots) < 2:
        return None
    first = snapshots[0]
    if not _plain(first.meta):
        return None
    kinds = {name: (tuple(a.shape), a.dtype) for name, a in first.tensors.items()}
    rows = first.stop - first.start
    if not kinds or any(len(shape) < 3 or shape[2] != rows for shape, _ in kinds.values()):
        return None
    batch = next(iter(kinds.values()))[0][0]
    if any(shape[0] != batch for shape, _ in kinds.values()):
        return None
    for snap in snapshots:
        if (snap.signature, snap.start, snap.stop) != (first.signature, first.start, first.stop):
            return None
        if snap.tensors.keys() != kinds.keys() or snap.meta != first.meta:
            return None
        for name, array in snap.tensors.items():
            if not isinstance(array, mx.array) or (tuple(array.shape), array.dtype) != kinds[name]:
                return None
    whole = len(snapshots) * batch
    given = stacked or {}

    def stack(name: str) -> mx.array:
        shape, dtype = kinds[name]
        ready = given.get(name)
        if ready is not None and (tuple(ready.shape), ready.dtype) == ((whole, *shape[1:]), dtype):
            return ready
        return mx.concatenate([s.tensors[name] for s in snapshots])

    together = Snapshot(
        first.signature, first.start, first.stop, {n: stack(n) for n in kinds}, first.meta
    )
    out = transcode(together, to_signature)
    if any(a.ndim < 1 or a.shape[0] != whole for a in out.tensors.values()):
        return None
    parts = {
        name: [a[i * batch : (i + 1) * batch] for i in range(len(snapshots))]
        for name, a in out.tensors.items()
    }
    if decoded is not None:
        decoded.extend(Stack(out.tensors[name], tuple(p)) for name, p in parts.items())
    converted = [
        Snapshot(
            out.signature,
            out.start,
            out.stop,
            {name: p[i] for name, p in parts.items()},
            dict(out.meta),
        )
        for i in range(len(snapshots))
    ]
    # Slices of one conversion, alike but for their rows: the first checked for them all.
    note_checked_alike(converted, get_codec(out.signature))
    return converted


def _plain(value: Any) -> bool:
    """Whether ``value`` compares as a plain value: scalars, strings, and lists and
    mappings of them (a TurboQuant snapshot's parameters), no arrays."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return True
    if isinstance(value, (list, tuple)):
        return all(map(_plain, value))
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def transcode_measured(
    snapshot: Snapshot, to_signature: str, *, max_size: int | None = None, keep: int | None = None
) -> Transcoded:
    """:func:`transcode`, plus whether it was lossless and its relative MSE."""
    dense, target, out = _converted(snapshot, to_signature, max_size, keep)
    if dense is None:
        return Transcoded(out, True, {"keys": 0.0, "values": 0.0})
    keys, values = dense
    new_keys, new_values = target.to_dense(out)
    lossless = bool(mx.array_equal(keys, new_keys).item()) and bool(
        mx.array_equal(values, new_values).item()
    )
    errors = {"keys": relative_mse(keys, new_keys), "values": relative_mse(values, new_values)}
    return Transcoded(out, lossless, errors)


def _converted(
    snapshot: Snapshot, to_signature: str, max_size: int | None, keep: int | None
) -> tuple[tuple[mx.array, mx.array] | None, KVCodec, Snapshot]:
    """``(source dense rows, target codec, converted snapshot)``; the rows are ``None``
    when nothing needed converting (``snapshot`` itself is returned)."""
    source, target = get_codec(snapshot.signature), get_codec(to_signature)
    meta = _target_meta(snapshot, source, target, max_size, keep)
    if source == target and meta == dict(snapshot.meta):
        return None, target, snapshot
    keys, values = source.to_dense(snapshot)
    out = target.from_dense(keys, values, start=snapshot.start, stop=snapshot.stop, meta=meta)
    return (keys, values), target, out


def _target_meta(
    snapshot: Snapshot,
    source: KVCodec,
    target: KVCodec,
    max_size: int | None,
    keep: int | None,
) -> dict[str, Any]:
    source_only = () if source == target else source.own_meta
    carried = {k: v for k, v in snapshot.meta.items() if k not in source_only}
    meta = {k: v for k, v in carried.items() if k not in _WINDOW_KEYS}
    if not isinstance(target, RingKVCodec):
        return meta
    windowed = isinstance(source, RingKVCodec)
    same_window = (
        windowed
        and max_size in (None, snapshot.meta["max_size"])
        and keep
        in (
            None,
            snapshot.meta["keep"],
        )
    )
    if same_window:
        return carried
    if max_size is None and not windowed:
        raise ValueError(
            f"[transcode] A windowed target '{target.signature}' needs max_size (and keep); "
            f"the source '{source.signature}' has no window."
        )
    meta["max_size"] = int(max_size if max_size is not None else snapshot.meta["max_size"])
    meta["keep"] = int(keep if keep is not None else (snapshot.meta["keep"] if windowed else 0))
    if not 0 <= meta["keep"] < meta["max_size"]:
        raise ValueError(
            f"[transcode] A window needs 0 <= keep < max_size; "
            f"received max_size={meta['max_size']}, keep={meta['keep']}."
        )
    return meta
