"""``kv:mxfp8`` and ``kv:rotating-mxfp8``: MLX ``mxfp8`` rows (8-bit e4m3 values, one e8m0 scale
per 32), read by ``mx.quantized_matmul(..., mode="mxfp8")`` (:mod:`kvstore.caches.microscaling`)."""

from __future__ import annotations

from kvstore.caches.microscaling import MicroscalingKVCache, RotatingMicroscalingKVCache
from kvstore.family import Family, QuantizedAttention

__all__ = ["MXFP8_FAMILY", "ROTATING_MXFP8_FAMILY", "MXFP8KVCache", "RotatingMXFP8KVCache"]

_ATTENTION = QuantizedAttention("mxfp8", bits=8, group_size=32)

MXFP8_FAMILY = Family(
    kind="kv:mxfp8",
    description="MLX mxfp8 rows (8-bit e4m3 values, an e8m0 scale per 32), growing",
    attention=_ATTENTION,
    lossy=True,
    storage_policy=True,
    factory=lambda sig, window, keep: MXFP8KVCache(),
)

ROTATING_MXFP8_FAMILY = Family(
    kind="kv:rotating-mxfp8",
    description="MLX mxfp8 rows in a sliding window",
    attention=_ATTENTION,
    window_of=MXFP8_FAMILY.kind,
    lossy=True,
    factory=lambda sig, window, keep: RotatingMXFP8KVCache(window, keep),
)


class MXFP8KVCache(MicroscalingKVCache):
    """``kv:mxfp8`` rows, growing in steps of 256."""

    family = MXFP8_FAMILY


class RotatingMXFP8KVCache(RotatingMicroscalingKVCache):
    """``kv:mxfp8`` rows in a sliding window with ``keep`` sink tokens."""

    family = ROTATING_MXFP8_FAMILY
