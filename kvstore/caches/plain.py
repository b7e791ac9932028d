"""``kv:plain``: raw rows in the model's dtype (mlx-lm ``KVCache``)."""

from __future__ import annotations

from typing import Any

from kvstore.caches.base import GrowingKVCache

__all__ = ["KVCache", "PlainKVCache"]


class KVCache(GrowingKVCache):
    """Raw key/value rows, growing in steps of 256 tokens.

    Same name, ``state`` layout and behaviour as ``mlx_lm.models.cache.KVCache``,
    so files written by ``mlx_lm.save_prompt_cache`` from it load in stock mlx-lm.
    """

    def signature(self) -> str:
        return "kv:plain"

    @property
    def state(self) -> tuple[Any, Any, int]:
        return self.keys, self.values, self.offset

    @state.setter
    def state(self, v: tuple[Any, Any, int]) -> None:
        self.keys, self.values, self.offset = v


#: The house-style name (STYLE.md C4); the mlx-lm name is the primary one.
PlainKVCache = KVCache
