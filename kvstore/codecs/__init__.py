"""Codecs: a cache (or a token range of it) <-> named tensors + metadata, and the record format.

The registry maps a signature *kind* to a codec class; built-ins are
registered here, one line per family (registering a codec registers the
:class:`~kvstore.family.Family` it serves: importing this package is what
registers the built-in families, see :mod:`kvstore.family`), and third-party
codecs come from the entry-point group ``kvstore.codecs`` (see
:mod:`kvstore.codecs.registry`).

Snapshot tensor names, per row encoding (all ``[B, H, T, width]``, in
temporal order, logical rows only):

* raw rows (``kv:plain``, ``kv:rotating-plain``): ``keys``, ``values``;
* affine rows (``kv:quant``, ``kv:rotating-quant``): ``keys.q`` (packed
  uint32 words), ``keys.scales``, ``keys.biases``, and the same for ``values``;
* microscaling rows (``kv:mxfp8``, ``kv:mxfp4``, ``kv:nvfp4`` and their
  ``kv:rotating-*`` twins): ``keys.q`` (packed uint32 words), ``keys.scales``
  (uint8, one per group), the same for ``values``; meta ``dtype`` is the model's;
* TurboQuant rows (``kv:turboquant``, ``kv:rotating-turboquant``):
  ``keys.codes`` (packed uint32 indices), ``keys.scales`` (``[B, H, T]``), the
  same for ``values``, plus ``meta["tq"]`` and side tensors saying how they were
  encoded (:mod:`kvstore.codecs.turboquant_params`).

Snapshot ``meta``: ``dtype`` and ``offset`` always; windowed families add
``max_size``, ``keep`` and, for a rotated ring, ``ring_idx``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.abc.codec import KVCodec, Snapshot
from kvstore.caches.batch import BATCH_FAMILY
from kvstore.codecs.growing import GrowingKVCodec, PlainKVCodec, QuantizedKVCodec
from kvstore.codecs.mxfp4 import MXFP4KVCodec, RotatingMXFP4KVCodec
from kvstore.codecs.mxfp8 import MXFP8KVCodec, RotatingMXFP8KVCodec
from kvstore.codecs.nvfp4 import NVFP4KVCodec, RotatingNVFP4KVCodec
from kvstore.codecs.record import (
    Record,
    RecordHeader,
    decode_record,
    decode_record_to_mlx,
    encode_record,
    read_header,
    snapshot_to_mlx,
)
from kvstore.codecs.recurrent import ArraysCodec, CheckpointCodec, GatedDeltaCodec
from kvstore.codecs.registry import (
    ENTRY_POINT_GROUP,
    codec_for,
    get_codec,
    load_plugin,
    load_plugins,
    register_codec,
    registered_kinds,
)
from kvstore.codecs.ring import RingKVCodec, RotatingKVCodec, RotatingQuantizedKVCodec
from kvstore.codecs.transcode import Transcoded, transcode, transcode_measured, transcode_stacked
from kvstore.codecs.turboquant import RotatingTurboQuantKVCodec, TurboQuantKVCodec
from kvstore.family import register_family

__all__ = [
    "KVCodec",
    "Snapshot",
    "GrowingKVCodec",
    "RingKVCodec",
    "PlainKVCodec",
    "QuantizedKVCodec",
    "RotatingKVCodec",
    "RotatingQuantizedKVCodec",
    "TurboQuantKVCodec",
    "RotatingTurboQuantKVCodec",
    "MXFP8KVCodec",
    "RotatingMXFP8KVCodec",
    "MXFP4KVCodec",
    "RotatingMXFP4KVCodec",
    "NVFP4KVCodec",
    "RotatingNVFP4KVCodec",
    "CheckpointCodec",
    "GatedDeltaCodec",
    "ArraysCodec",
    "ENTRY_POINT_GROUP",
    "register_codec",
    "get_codec",
    "registered_kinds",
    "load_plugin",
    "load_plugins",
    "codec_for",
    "snapshot",
    "snapshot_held",
    "restore",
    "transcode",
    "transcode_measured",
    "transcode_stacked",
    "Transcoded",
    "Record",
    "RecordHeader",
    "encode_record",
    "decode_record",
    "decode_record_to_mlx",
    "read_header",
    "snapshot_to_mlx",
]

register_codec(PlainKVCodec)
register_codec(QuantizedKVCodec)
register_codec(RotatingKVCodec)
register_codec(RotatingQuantizedKVCodec)
register_codec(TurboQuantKVCodec)
register_codec(RotatingTurboQuantKVCodec)
register_codec(MXFP8KVCodec)
register_codec(RotatingMXFP8KVCodec)
register_codec(MXFP4KVCodec)
register_codec(RotatingMXFP4KVCodec)
register_codec(NVFP4KVCodec)
register_codec(RotatingNVFP4KVCodec)
register_codec(GatedDeltaCodec)
register_codec(ArraysCodec)
# A wrapper has no codec (a batch is extracted row by row before it is stored).
register_family(BATCH_FAMILY)


def snapshot(cache: Any, start: int = 0, stop: int | None = None) -> Snapshot:
    """The logical content of ``cache`` for tokens ``[start, stop)`` (default: all).

    Raises:
        CapabilityError: an unknown cache, or positions it does not hold.
    """
    return codec_for(cache).snapshot(cache, start, stop)


def snapshot_held(cache: Any) -> list[Snapshot]:
    """Snapshots of every position ``cache`` will still attend to (a window's sinks and window)."""
    return codec_for(cache).snapshot_held(cache)


def restore(snapshots: Snapshot | Sequence[Snapshot]) -> Any:
    """A live cache rebuilt from one snapshot or from ranges sorted by start.

    Raises:
        UnknownSignatureError: no codec serves the snapshots' kind.
        CapabilityError: the ranges do not cover what the cache needs.
        CorruptEntryError: malformed or mutually inconsistent snapshots.
    """
    first = snapshots if isinstance(snapshots, Snapshot) else next(iter(snapshots), None)
    if first is None:
        raise ValueError("[restore] Nothing to restore: no snapshots.")
    return get_codec(first.signature).restore(snapshots)
