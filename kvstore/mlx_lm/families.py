"""Which of mlx-lm's cache families the store persists, and caches in mlx-lm's classes.

A layer's cache is persisted when kvstore knows its family (its signature, read
through :data:`kvstore.abc.cache.MLX_LM_ALIASES` for mlx-lm's ``KVCache``,
``QuantizedKVCache`` and ``RotatingKVCache``) and a codec serves it. Every other
family keeps mlx-lm's behaviour (the in-memory prompt cache) and says why:
:func:`not_persisted` gives one reason per family.

A restore builds kvstore's classes; :func:`as_mlx_lm_caches` hands the same
arrays to mlx-lm's classes for raw rows (``KVCache``, ``RotatingKVCache``), so
what ``fetch`` returns is what ``stream_generate``, ``BatchGenerator`` and
``mlx_lm.server`` expect (``merge`` for batching, ``to_quantized`` for
``kv_bits``). Affine rows stay in our classes: they batch
(:mod:`kvstore.caches.batch`), mlx-lm's ``QuantizedKVCache`` does not, and
they give mlx-lm's logits. No array is copied.
Sliding windows become :class:`~kvstore.mlx_lm.capture.CapturingRotatingKVCache`
(mlx-lm's ring, keeping the blocks it completes for the next save), also in
fresh caches (:func:`with_capture`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from kvstore.abc.cache import signature_of
from kvstore.codecs import get_codec
from kvstore.errors import UnknownSignatureError
from kvstore.family import find_family
from kvstore.mlx_lm.capture import capturing_like

__all__ = [
    "not_persisted",
    "as_mlx_lm_caches",
    "with_capture",
    "held_tokens",
    "token_ids",
    "WHY_NOT",
]

#: mlx-lm cache classes the store does not persist yet, and why.
WHY_NOT: dict[str, str] = {
    "ArraysCache": (
        "recurrent state of a hybrid model (mlx-lm ArraysCache) is not persisted by the "
        "server yet; such models keep mlx-lm's in-memory prompt cache (the store keeps "
        "recurrent checkpoints, issue 16, for kvstore.bridge.generate, whose prefill ends "
        "its chunks where a checkpoint is planned; mlx_lm.server chooses its own chunks)"
    ),
    "CacheList": "composite caches (mlx-lm CacheList) are not persisted yet",
    "ChunkedKVCache": "chunked attention (mlx-lm ChunkedKVCache) is not persisted yet",
    "ConcatenateKVCache": "mlx-lm ConcatenateKVCache is not persisted (no kvstore family)",
}


def _why(cache: Any) -> str | None:
    sig = signature_of(cache)
    if sig is not None:
        family = find_family(sig.kind)
        if family is not None and family.holds_recurrent_state:
            return WHY_NOT.get(type(cache).__name__, WHY_NOT["ArraysCache"])
        try:
            get_codec(str(sig))
            return None
        except UnknownSignatureError:
            return f"no codec is registered for the signature '{sig}'"
    name = type(cache).__name__
    return WHY_NOT.get(name, f"{type(cache).__module__}.{name} has no kvstore family")


def not_persisted(caches: Sequence[Any]) -> dict[str, str]:
    """Per cache class the store cannot persist: why (empty when every layer persists).

    Keys are ``"ArraysCache (layers 0, 2)"``-style labels.
    """
    layers: dict[tuple[str, str], list[int]] = {}
    for i, cache in enumerate(caches):
        why = _why(cache)
        if why is not None:
            layers.setdefault((type(cache).__name__, why), []).append(i)
    return {
        f"{name} (layers {', '.join(map(str, idx))})": why for (name, why), idx in layers.items()
    }


def _as_mlx_lm(cache: Any, block_size: int | None) -> Any:
    from mlx_lm.models import cache as C

    sig = signature_of(cache)
    if sig is None or type(cache).__module__.startswith("mlx_lm."):
        return cache
    out: Any
    if sig.kind == "kv:rotating-plain":
        out = C.RotatingKVCache(max_size=int(cache.max_size), keep=int(cache.keep))
        out._idx = int(cache._idx)
    elif sig.kind == "kv:plain":
        out = C.KVCache()
    else:  # affine and TurboQuant rows: ours batch where mlx-lm's cannot, or mlx-lm has none
        return cache if block_size is None else capturing_like(cache, block_size)
    out.keys, out.values, out.offset = cache.keys, cache.values, int(cache.offset)
    return out if block_size is None else capturing_like(out, block_size)


def as_mlx_lm_caches(caches: Sequence[Any], block_size: int | None = None) -> list[Any]:
    """``caches`` in mlx-lm's own classes where mlx-lm has one that batches (the same
    arrays); with ``block_size``, sliding windows capture their blocks (:func:`with_capture`)."""
    return [_as_mlx_lm(c, block_size) for c in caches]


def with_capture(caches: Sequence[Any], block_size: int) -> list[Any]:
    """``caches`` with each sliding window made a capturing one
    (:func:`~kvstore.mlx_lm.capture.capturing_like`)."""
    return [capturing_like(c, block_size) for c in caches]


def token_ids(tokens: Any, operation: str) -> list[int]:
    """``tokens`` (a list, NumPy or MLX array) as a list of ints.

    Raises:
        ValueError: no tokens.
    """
    if isinstance(tokens, mx.array):
        tokens = tokens.tolist()
    toks = [int(t) for t in np.asarray(tokens, dtype=np.int64).reshape(-1)]
    if not toks:
        raise ValueError(f"[{operation}] The prompt is empty; pass at least one token id.")
    return toks


def held_tokens(caches: Sequence[Any]) -> int | None:
    """Tokens the caches hold KV for (the least over layers with an offset)."""
    offsets = [int(c.offset) for c in caches if isinstance(getattr(c, "offset", None), int)]
    return min(offsets) if offsets else None
