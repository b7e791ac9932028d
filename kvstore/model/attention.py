"""Attention kernels and the one place that picks a kernel for a cache.

The choice is made only through the capability predicates of
:mod:`kvstore.abc.cache` (never ``isinstance``/``hasattr`` on a cache): a
cache whose signature we do not know fails closed with ``CapabilityError``
before any layer touches it.

Dense rows go to MLX's fused kernel, except where :func:`attends_unfused` says a call
of that many queries and keys is attended by plain ops (:func:`unfused_attention`): by
default, calls of 4 queries or more but few scores on MLX's CUDA backend, whose fused
kernel builds a cuDNN graph for every shape of queries and keys it has not run (26-37 ms
on an H100), and a suffix's shape is new on nearly every request.

A quantized cache is attended over its packed rows with ``mx.quantized_matmul``
(:func:`quantized_attention`), except where :func:`dequantizes_queries` says a
call of that many queries attends the rows dequantized (:func:`dequantized_attention`):
by default, more than one query on MLX's CUDA backend, which has no
``quantized_matmul`` kernel for a prefill's shapes.
"""

from __future__ import annotations

import os
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
from kvstore.devices import default_is_cuda
from kvstore.errors import CapabilityError, KVStoreError
from kvstore.family import families

__all__ = [
    "Attend",
    "DEQUANTIZED_PREFILL",
    "UNFUSED_ATTENTION",
    "UNFUSED_SCORES_MAX",
    "attends_unfused",
    "attention_for",
    "recurrent_for",
    "dense_attention",
    "dequantized_attention",
    "dequantizes_queries",
    "packed_attention",
    "quantized_attention",
    "unfused_attention",
]

#: ``attend(queries, keys, values, scale, mask) -> output``; keys/values are
#: what the cache's ``update_and_fetch`` returned.
Attend = Callable[[mx.array, Any, Any, float, Any], mx.array]
#: A quantized cache's rows: affine ``(q, scales, biases)``; microscaling ``(q, scales)``
#: (typed as the longer: both are unpacked into MLX's calls).
PackedRows = tuple[mx.array, mx.array, mx.array]


def dense_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """Attention over dense key/value rows: MLX's fused kernel, or plain ops where
    :func:`attends_unfused` says so for this many queries."""
    if attends_unfused(queries.shape[-2], keys.shape[-2]):
        return unfused_attention(queries, keys, values, scale, mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def unfused_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """Attention by plain ops: two matmuls and a softmax, none built per shape.

    The query heads that share a key/value head are folded into its rows (``[B,
    kv_heads, repeats * L, D]``), so the keys and values are read as they are, never
    broadcast to every query head. The scores, their softmax and the weighted sum are
    float32, the output the values' dtype (scores rounded to bfloat16 were off cuDNN's
    output by ~1% of its largest value on an H100). ``mask``: ``None``, ``"causal"``
    (query ``i`` sees the keys up to ``T - L + i``, as the fused kernel's bottom-right
    mask), or an array that broadcasts to ``[B, query heads, L, T]``, boolean (True:
    attended) or additive.
    """
    B, n_q, L, D = queries.shape
    n_kv, T = keys.shape[-3], keys.shape[-2]
    repeats = n_q // n_kv
    folded = (queries.astype(mx.float32) * scale).reshape(B, n_kv, repeats * L, D)
    scores = folded @ keys.astype(mx.float32).swapaxes(-1, -2)
    if mask is not None:
        if type(mask) is str:  # "causal"
            rows = mx.arange(repeats * L) % L + (T - L)
            mask = rows[:, None] >= mx.arange(T)[None]
        else:
            mask = mx.broadcast_to(mask, (B, n_q, L, T)).reshape(B, n_kv, repeats * L, T)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(mx.float32).min)
        else:
            scores = scores + mask
    # The weights stay float32 for the second matmul (TF32 on a CUDA device): rounded to
    # bfloat16 they put the output at 1.5-2x its own rounding error off float32
    # attention; so it is at that floor (tools/bench/gpu/shape_probe.py, part A).
    out = mx.softmax(scores, axis=-1) @ values.astype(mx.float32)
    return out.astype(values.dtype).reshape(B, n_q, L, values.shape[-1])


#: The environment variable choosing when dense attention runs by plain ops
#: (:func:`unfused_attention`): ``auto`` (the default: calls of 4 queries or more, at
#: most :data:`UNFUSED_SCORES_MAX` scores a head, on MLX's CUDA backend), ``always``
#: (calls of 2 queries or more, as many scores, on any backend) or ``never``.
UNFUSED_ATTENTION = "KVSTORE_UNFUSED_ATTENTION"
#: The most scores (queries x keys) a head of a call attended by plain ops has: they are
#: materialised, and past this they cost more than the fused kernel's graph build once.
#: On an H100 (``tools/bench/gpu/shape_probe.py``, a llama-8B-shaped forward over a
#: restored prefix, shapes not run before): 4096 keys and 45 queries 25.8 ms by plain ops
#: against 63.3 fused, 250 queries 35.2 against 62.6, 600 queries 67.1 against 74.0,
#: 1500 queries 157 against 94; 16384 keys and 51 queries 39.6 against 67.3, 121 queries
#: 60.8 against 67.1, 301 queries 99.0 against 67.9.
UNFUSED_SCORES_MAX = 3 << 19


def attends_unfused(n_queries: int, n_keys: int) -> bool:
    """Whether a call of ``n_queries`` queries over ``n_keys`` dense rows is attended by
    plain ops (:data:`UNFUSED_ATTENTION`).

    MLX's CUDA backend attends 4 queries or more with cuDNN, whose graph it builds for
    each shape of queries, keys and their strides it has not run and keeps (256 of them):
    26-37 ms a build on an H100, against 0.2-0.7 ms for the call once built. A suffix
    after a restored prefix, a speculative step's verification or the last chunk of a
    prefill has a shape of its own nearly every time. Fewer than 4 queries take MLX's
    vector kernel, built once.

    Raises:
        KVStoreError: :data:`UNFUSED_ATTENTION` is set to something else than ``auto``,
            ``always`` or ``never``.
    """
    if n_queries < 2 or n_queries * n_keys > UNFUSED_SCORES_MAX:
        return False
    choice = _route_choice(UNFUSED_ATTENTION, "on MLX's CUDA backend only")
    if choice == "auto":
        return n_queries >= 4 and default_is_cuda()
    return choice == "always"


#: The words :data:`UNFUSED_ATTENTION` and :data:`DEQUANTIZED_PREFILL` take.
_ROUTE_CHOICES = ("auto", "always", "never")


def _route_choice(name: str, auto: str) -> str:
    """The route the environment variable ``name`` chooses (``auto`` when unset);
    ``auto``: what the default does, for the error.

    Raises:
        KVStoreError: ``name`` is set to something else than one of :data:`_ROUTE_CHOICES`.
    """
    choice = os.environ.get(name, "auto")
    if choice in _ROUTE_CHOICES:
        return choice
    raise KVStoreError(
        f"[attention] {name} must be one of {', '.join(_ROUTE_CHOICES)}; got {choice!r}. "
        f"Unset it for the default (auto: {auto}).",
        found=choice,
        supported=_ROUTE_CHOICES,
    )


def quantized_attention(
    queries: mx.array,
    keys: PackedRows,
    values: PackedRows,
    scale: float,
    mask: Any,
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
) -> mx.array:
    """Attention on packed rows with ``mx.quantized_matmul``: affine ``(q, scales,
    biases)`` or microscaling ``(q, scales)`` in ``mode``.

    A KV head's query heads are rows of one product (queries ``(B, kv_heads,
    repeats * L, D)``), not a batch axis the keys are broadcast over as mlx-lm's
    ``quantized_scaled_dot_product_attention`` has them: on the CPU the two are
    bit-identical, but MLX 0.32.4's CUDA ``quantized_matmul`` computed the broadcast
    form wrong (65 from the CPU's scores at most, against 1 as rows:
    ``tools/bench/results/gpu/ffd1c4c-h100/``). On CUDA the rows are copied whole
    first: every kernel there wants row-contiguous operands, and a cache's rows are a
    view of its buffer."""
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = keys[0].shape[-3]
    n_repeats = n_q_heads // n_kv_heads
    if default_is_cuda():
        keys, values = tree_map(mx.contiguous, keys), tree_map(mx.contiguous, values)
    queries = mx.reshape(queries * scale, (B, n_kv_heads, n_repeats * L, D))
    scores = mx.quantized_matmul(
        queries, *keys, transpose=True, group_size=group_size, bits=bits, mode=mode
    )
    scores = mx.reshape(scores, (B, n_kv_heads, n_repeats, L, -1))
    if mask is not None:
        if type(mask) is str:  # "causal": built here, as the fused kernel would
            q_len, k_len = scores.shape[-2:]
            mask = mx.arange(k_len - q_len, k_len)[:, None] >= mx.arange(k_len)[None]
        if mask.ndim > 3:  # (B, heads, L, K): over a KV head's query heads alike
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(
        mx.reshape(scores, (B, n_kv_heads, n_repeats * L, -1)),
        *values,
        transpose=False,
        group_size=group_size,
        bits=bits,
        mode=mode,
    )
    return mx.reshape(out, (B, n_q_heads, L, D))


def dequantized_attention(
    queries: mx.array,
    keys: PackedRows,
    values: PackedRows,
    scale: float,
    mask: Any,
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
) -> mx.array:
    """:func:`quantized_attention`'s result by another route: the packed rows
    dequantized to the queries' dtype, then the fused dense kernel (the same
    decoded values, summed in another order)."""

    def rows(packed: PackedRows) -> mx.array:
        return mx.dequantize(
            *packed, group_size=group_size, bits=bits, mode=mode, dtype=queries.dtype
        )

    return dense_attention(queries, rows(keys), rows(values), scale, mask)


#: The environment variable choosing when quantized caches are attended dequantized:
#: ``auto`` (the default: calls of more than one query on MLX's CUDA backend),
#: ``always`` (every call of more than one query) or ``never``.
DEQUANTIZED_PREFILL = "KVSTORE_DEQUANTIZED_PREFILL"


def dequantizes_queries(n_queries: int) -> bool:
    """Whether a call of ``n_queries`` queries over a quantized cache attends its rows
    dequantized (:data:`DEQUANTIZED_PREFILL`).

    One query (a decode step) always reads the packed rows: that is where a quantized
    cache saves bandwidth (on MLX's CUDA backend copied whole first:
    :func:`quantized_attention`).

    Raises:
        KVStoreError: :data:`DEQUANTIZED_PREFILL` is set to something else than
            ``auto``, ``always`` or ``never``.
    """
    if n_queries <= 1:
        return False
    choice = _route_choice(DEQUANTIZED_PREFILL, "dequantized on MLX's CUDA backend only")
    if choice == "auto":
        # MLX 0.32.4's CUDA quantized_matmul raised "[quantized_matmul] No implementation
        # for problem shape: 2047x4095x128x32, transpose: true, ..." on a prefill chunk
        # over a 4-bit cache (G5 on the H200). Its dispatch (mlx/backend/cuda/quantized/
        # quantized.cpp) has a tiled kernel only for key counts that are multiples of 128,
        # and naive and vector kernels that want row-contiguous operands (a prefill's
        # queries are heads transposed out of tokens; a cache's rows a view of its buffer).
        # Dequantizing costs one pass over the rows per call, little beside many queries'
        # attention, and the fused kernel never materialises the scores.
        return default_is_cuda()
    return choice == "always"


def packed_attention(
    queries: mx.array,
    keys: PackedRows,
    values: PackedRows,
    scale: float,
    mask: Any,
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
) -> mx.array:
    """The kernel for a quantized cache's rows: :func:`quantized_attention`, or
    :func:`dequantized_attention` where :func:`dequantizes_queries` says so."""
    attend = (
        dequantized_attention if dequantizes_queries(queries.shape[-2]) else quantized_attention
    )
    return attend(queries, keys, values, scale, mask, group_size=group_size, bits=bits, mode=mode)


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
        return partial(packed_attention, group_size=q.group_size, bits=q.bits, mode=q.mode)
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
