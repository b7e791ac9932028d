"""The live cache families. Each reports ``signature()``; see :mod:`kvstore.abc.cache`."""

from kvstore.caches.base import BaseKVCache, GrowingKVCache
from kvstore.caches.plain import KVCache, PlainKVCache
from kvstore.caches.quantized import QuantizedKVCache
from kvstore.caches.rotating import RingKVCache, RotatingKVCache, RotatingQuantizedKVCache
from kvstore.caches.turboquant import RotatingTurboQuantKVCache, TurboQuantKVCache

__all__ = [
    "BaseKVCache",
    "GrowingKVCache",
    "RingKVCache",
    "KVCache",
    "PlainKVCache",
    "QuantizedKVCache",
    "RotatingKVCache",
    "RotatingQuantizedKVCache",
    "TurboQuantKVCache",
    "RotatingTurboQuantKVCache",
]
