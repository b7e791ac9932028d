"""Attention kernels and the one place that picks a kernel for a cache.

The choice is made only through the capability predicates of
:mod:`kvstore.abc.cache` (never ``isinstance``/``hasattr`` on a cache): a
cache whose signature we do not know fails closed with ``CapabilityError``
before any layer touches it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map

from kvstore.abc.cache import (
    is_gated_delta_cache,
    quantized_attention_params,
    signature_string,
    uses_dense_attention,
    uses_quantized_attention,
)
from kvstore.errors import CapabilityError
from kvstore.family import families

__all__ = ["Attend", "attention_for", "recurrent_for", "dense_attention", "quantized_attention"]

#: ``attend(queries, keys, values, scale, mask) -> output``; keys/values are
#: what the cache's ``update_and_fetch`` returned.
Attend = Callable[[mx.array, Any, Any, float, Any], mx.array]


def dense_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """Fused attention over dense key/value rows."""
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def quantized_attention(
    queries: mx.array,
    keys: tuple[mx.array, mx.array, mx.array],
    values: tuple[mx.array, mx.array, mx.array],
    scale: float,
    mask: Any,
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
) -> mx.array:
    """Attention on packed rows with ``mx.quantized_matmul`` (mlx-lm's algorithm):
    affine ``(q, scales, biases)`` or microscaling ``(q, scales)`` in ``mode``."""
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = keys[0].shape[-3]
    n_repeats = n_q_heads // n_kv_heads
    queries = queries * scale
    if n_repeats > 1:
        queries = mx.reshape(queries, (B, n_kv_heads, n_repeats, L, D))
        keys = tree_map(lambda x: mx.expand_dims(x, axis=-3), keys)
        values = tree_map(lambda x: mx.expand_dims(x, axis=-3), values)

    scores = mx.quantized_matmul(
        queries, *keys, transpose=True, group_size=group_size, bits=bits, mode=mode
    )
    if mask is not None:
        if type(mask) is str:  # "causal": built here, as the fused kernel would
            q_len, k_len = scores.shape[-2:]
            mask = mx.arange(k_len - q_len, k_len)[:, None] >= mx.arange(k_len)[None]
        if n_repeats > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(
        scores, *values, transpose=False, group_size=group_size, bits=bits, mode=mode
    )
    if n_repeats > 1:
        out = mx.reshape(out, (B, n_q_heads, L, D))
    return out


def attention_for(cache: object, layer: int | None = None) -> Attend:
    """The kernel for the rows ``cache.update_and_fetch`` returns.

    ``None`` (no cache) gets dense attention.

    Raises:
        CapabilityError: the cache's family is unknown or has no attention
            path; the message names its signature.
    """
    if cache is None or uses_dense_attention(cache):
        return dense_attention
    if uses_quantized_attention(cache):
        q = quantized_attention_params(cache)
        return partial(quantized_attention, group_size=q.group_size, bits=q.bits, mode=q.mode)
    signature = signature_string(cache)
    where = "" if layer is None else f" at layer {layer}"
    kv = [f for f in families() if f.holds_kv]
    dense = ", ".join(f.kind for f in kv if f.attention == "dense")
    quantized = ", ".join(f.kind for f in kv if f.attention != "dense")
    raise CapabilityError(
        f"[attention] No attention path for a cache with signature '{signature}'{where} "
        f"({type(cache).__name__}); the model attends only over families whose signature it "
        f"knows (dense: {dense}; quantized: {quantized}). Give the cache a signature() or use "
        f"model.make_cache().",
        signature=signature,
        layer=layer,
    )


def recurrent_for(cache: object, layer: int | None = None) -> None:
    """Check that a Gated-DeltaNet layer can run on ``cache``; ``None`` (the
    block's recurrent path takes no kernel). ``None`` (no cache) is fine.

    Raises:
        CapabilityError: ``cache`` is not a Gated-DeltaNet state (a KV cache, an
            unknown family); the message names its signature.
    """
    if cache is None or is_gated_delta_cache(cache):
        return None
    signature = signature_string(cache)
    where = "" if layer is None else f" at layer {layer}"
    raise CapabilityError(
        f"[attention] A Gated-DeltaNet layer{where} keeps its state in a rec:gated-delta "
        f"cache; received a cache with signature '{signature}' ({type(cache).__name__}). "
        f"Use model.make_cache().",
        signature=signature,
        layer=layer,
    )
