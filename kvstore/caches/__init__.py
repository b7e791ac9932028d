"""The live cache families. Each reports ``signature()``; see :mod:`kvstore.abc.cache`.

Each family's module declares what the family is (a :class:`kvstore.family.Family`,
``QUANT_FAMILY`` in :mod:`kvstore.caches.quantized`); its codec registers it.
:mod:`kvstore.caches.batch` holds the row-batched caches of the families that batch
(imported here, so their batch classes are registered whenever a cache can merge).
"""

from kvstore.caches import batch as _batch  # noqa: F401, E402  # registers the batch classes
from kvstore.caches.base import BaseKVCache, GrowingKVCache
from kvstore.caches.mxfp4 import MXFP4KVCache, RotatingMXFP4KVCache
from kvstore.caches.mxfp8 import MXFP8KVCache, RotatingMXFP8KVCache
from kvstore.caches.nvfp4 import NVFP4KVCache, RotatingNVFP4KVCache
from kvstore.caches.plain import KVCache
from kvstore.caches.quantized import QuantizedKVCache
from kvstore.caches.recurrent import ArraysCache, GatedDeltaCache
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
    "MXFP8KVCache",
    "RotatingMXFP8KVCache",
    "MXFP4KVCache",
    "RotatingMXFP4KVCache",
    "NVFP4KVCache",
    "RotatingNVFP4KVCache",
    "GatedDeltaCache",
    "ArraysCache",
]
