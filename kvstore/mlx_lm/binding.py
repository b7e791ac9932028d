"""A model a :class:`~kvstore.mlx_lm.StorePromptCache` serves: its namespace, or why
the store keeps nothing of it, and the cache families its prompts are held in."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from kvstore.bridge.namespace import DEFAULT_QUANTIZED_KV_START
from kvstore.caches import QuantizedKVCache, RotatingQuantizedKVCache
from kvstore.mlx_lm.families import with_capture

__all__ = ["Binding"]


@dataclass
class Binding:
    """A model the prompt cache serves, and what the store keeps of it.

    Attributes:
        namespace: its store namespace, or ``None`` when nothing is persisted.
        not_persisted: why not, per cache family (empty when persisted).
    """

    model_key: Hashable
    model: Any
    namespace: str | None
    not_persisted: dict[str, str]
    block_size: int = 256
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START

    @property
    def quantizes_from_start(self) -> bool:
        """``kv_bits`` from the first token (``quantized_kv_start`` 0) on a persisted
        model: every layer is one of our affine families, which batch (mlx-lm's
        ``QuantizedKVCache`` does not, so its server serves ``kv_bits`` one at a time)."""
        return self.kv_bits is not None and self.quantized_kv_start <= 0 and bool(self.namespace)

    def fresh(self) -> list[Any]:
        """Fresh caches: ``make_prompt_cache(model)``, affine from the start when
        :attr:`quantizes_from_start`, sliding windows capturing their blocks."""
        caches = make_prompt_cache(self.model)
        if self.namespace is None:
            return caches
        if self.quantizes_from_start:
            caches = self._affine(caches, windows=True)
        return with_capture(caches, self.block_size)

    def templates(self, tokens: int) -> list[Any]:
        """Fresh caches of the families a prefix of ``tokens`` tokens is held in.

        With ``kv_bits``, mlx-lm's generation quantizes a plain ``KVCache`` once it
        holds ``quantized_kv_start`` tokens, so a prefix that long is restored
        affine (windows too when quantizing from the start).
        """
        caches = make_prompt_cache(self.model)
        if self.kv_bits is None or tokens < self.quantized_kv_start:
            return caches
        return self._affine(caches, windows=self.quantizes_from_start)

    def _affine(self, caches: list[Any], *, windows: bool) -> list[Any]:
        assert self.kv_bits is not None
        group, bits = self.kv_group_size, self.kv_bits
        out: list[Any] = []
        for c in caches:
            if type(c) is KVCache:
                out.append(QuantizedKVCache(group_size=group, bits=bits))
            elif windows and type(c) is RotatingKVCache:
                out.append(RotatingQuantizedKVCache(int(c.max_size), int(c.keep), group, bits))
            else:
                out.append(c)
        return out
