"""``kv:nvfp4`` and ``kv:rotating-nvfp4``: MLX ``nvfp4`` rows (4-bit e2m1 values, one e4m3 scale
per 16), read by ``mx.quantized_matmul(..., mode="nvfp4")`` (:mod:`kvstore.caches.microscaling`)."""

from __future__ import annotations

from kvstore.caches.microscaling import MicroscalingKVCache, RotatingMicroscalingKVCache
from kvstore.family import Family, QuantizedAttention

__all__ = ["NVFP4_FAMILY", "ROTATING_NVFP4_FAMILY", "NVFP4KVCache", "RotatingNVFP4KVCache"]

_ATTENTION = QuantizedAttention("nvfp4", bits=4, group_size=16)

NVFP4_FAMILY = Family(
    kind="kv:nvfp4",
    description="MLX nvfp4 rows (4-bit e2m1 values, an e4m3 scale per 16), growing",
    attention=_ATTENTION,
    lossy=True,
    storage_policy=True,
    factory=lambda sig, window, keep: NVFP4KVCache(),
)

ROTATING_NVFP4_FAMILY = Family(
    kind="kv:rotating-nvfp4",
    description="MLX nvfp4 rows in a sliding window",
    attention=_ATTENTION,
    window_of=NVFP4_FAMILY.kind,
    lossy=True,
    factory=lambda sig, window, keep: RotatingNVFP4KVCache(window, keep),
)


class NVFP4KVCache(MicroscalingKVCache):
    """``kv:nvfp4`` rows, growing in steps of 256."""

    family = NVFP4_FAMILY


class RotatingNVFP4KVCache(RotatingMicroscalingKVCache):
    """``kv:nvfp4`` rows in a sliding window with ``keep`` sink tokens."""

    family = ROTATING_NVFP4_FAMILY
