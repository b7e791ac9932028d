"""The live cache families. Each reports ``signature()``; see :mod:`kvstore.abc.cache`.

Each family's module declares what the family is (a :class:`kvstore.family.Family`,
``QUANT_FAMILY`` in :mod:`kvstore.caches.quantized`); its codec registers it.
"""

from kvstore.caches.base import BaseKVCache, GrowingKVCache
from kvstore.caches.plain import KVCache
from kvstore.caches.quantized import QuantizedKVCache
from kvstore.caches.rotating import RingKVCache, RotatingKVCache, RotatingQuantizedKVCache
from kvstore.caches.turboquant import RotatingTurboQuantKVCache, TurboQuantKVCache

__all__ = [
    "BaseKVCache",
    "GrowingKVCache",
    "RingKVCache",
    "KVCache",
    "QuantizedKVCache",
    "RotatingKVCache",
    "RotatingQuantizedKVCache",
    "TurboQuantKVCache",
    "RotatingTurboQuantKVCache",
]
