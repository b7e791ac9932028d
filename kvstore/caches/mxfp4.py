"""``kv:mxfp4`` and ``kv:rotating-mxfp4``: MLX ``mxfp4`` rows (4-bit e2m1 values, one e8m0 scale
per 32), read by ``mx.quantized_matmul(..., mode="mxfp4")`` (:mod:`kvstore.caches.microscaling`)."""

from __future__ import annotations

from kvstore.caches.microscaling import MicroscalingKVCache, RotatingMicroscalingKVCache
from kvstore.family import Family, QuantizedAttention

__all__ = ["MXFP4_FAMILY", "ROTATING_MXFP4_FAMILY", "MXFP4KVCache", "RotatingMXFP4KVCache"]

_ATTENTION = QuantizedAttention("mxfp4", bits=4, group_size=32)

MXFP4_FAMILY = Family(
    kind="kv:mxfp4",
    description="MLX mxfp4 rows (4-bit e2m1 values, an e8m0 scale per 32), growing",
    attention=_ATTENTION,
    lossy=True,
    storage_policy=True,
    factory=lambda sig, window, keep: MXFP4KVCache(),
)

ROTATING_MXFP4_FAMILY = Family(
    kind="kv:rotating-mxfp4",
    description="MLX mxfp4 rows in a sliding window",
    attention=_ATTENTION,
    window_of=MXFP4_FAMILY.kind,
    lossy=True,
    factory=lambda sig, window, keep: RotatingMXFP4KVCache(window, keep),
)


class MXFP4KVCache(MicroscalingKVCache):
    """``kv:mxfp4`` rows, growing in steps of 256."""

    family = MXFP4_FAMILY


class RotatingMXFP4KVCache(RotatingMicroscalingKVCache):
    """``kv:mxfp4`` rows in a sliding window with ``keep`` sink tokens."""

    family = ROTATING_MXFP4_FAMILY
