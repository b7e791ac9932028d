"""``kv:plain``: raw rows in the model's dtype (mlx-lm ``KVCache``)."""

from __future__ import annotations

from typing import Any

from kvstore.caches.base import Batchable, GrowingKVCache
from kvstore.caches.packed import quantize_rows
from kvstore.caches.quantized import QuantizedKVCache
from kvstore.family import Family
from kvstore.signature import parse_signature

__all__ = ["PLAIN_FAMILY", "KVCache"]

PLAIN_FAMILY = Family(
    kind="kv:plain",
    description="raw rows in the model's dtype, growing",
    factory=lambda sig, window, keep: KVCache(),
)


class KVCache(Batchable, GrowingKVCache):
    """Raw key/value rows, growing in steps of 256 tokens.

    Same name, ``state`` layout and behaviour as ``mlx_lm.models.cache.KVCache``,
    so files written by ``mlx_lm.save_prompt_cache`` from it load in stock mlx-lm.
    """

    family = PLAIN_FAMILY

    def signature(self) -> str:
        return self.family.kind

    @property
    def state(self) -> tuple[Any, Any, int]:
        return self.keys, self.values, self.offset

    @state.setter
    def state(self, v: tuple[Any, Any, int]) -> None:
        self.keys, self.values, self.offset = v

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> QuantizedKVCache:
        """This cache's rows affine-quantized (what mlx-lm's ``kv_bits`` option calls)."""
        quant = QuantizedKVCache(group_size=group_size, bits=bits)
        quant.offset = self.offset
        if self.keys is not None and self.values is not None:
            # The whole buffer, padding included, exactly as mlx-lm does.
            sig = parse_signature(quant.signature())
            quant.keys = quantize_rows(self.keys, sig)
            quant.values = quantize_rows(self.values, sig)
        return quant
