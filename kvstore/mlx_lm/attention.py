"""mlx-lm models' attention through kvstore's kernels: dense calls of few queries by
plain ops where :func:`~kvstore.model.attention.attends_unfused` says so, and quantized
caches' packed rows by :func:`~kvstore.model.attention.packed_attention`.

mlx-lm's model modules attend through ``mlx_lm.models.base.scaled_dot_product_attention``,
which each imports by name. On MLX's CUDA backend its fused kernel builds a cuDNN graph
for every shape of queries and keys it has not run (26-37 ms on an H100), and the suffix
a server prefills after a restored prefix has a new shape on nearly every request: a
4096-token restore's 47-token suffix took 54.6 ms through the fused kernel against
11.6 once its shape was built, and 35.8 by plain ops (an H100) (``tools/bench/gpu/shape_probe.py``).
:func:`unfused_for_model` puts :func:`~kvstore.model.attention.unfused_attention` in
front of that function in the modules a model's layers come from. A quantized cache's
packed rows (mlx-lm's own test: the cache has ``bits``) go to
:func:`~kvstore.model.attention.packed_attention`, the same algorithm as mlx-lm's
``quantized_scaled_dot_product_attention`` (bit-identical on the CPU) with a KV head's
query heads as rows: MLX 0.32.4's CUDA backend has no ``quantized_matmul`` kernel for
mlx-lm's form over a cache's rows (``tools/bench/results/gpu/qmmviews-h100/``), and
computed its broadcast wrong (``tools/bench/results/gpu/ffd1c4c-h100/``). Every other
call (attention sinks, one query, long prefills) goes on as mlx-lm has it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import mlx.core as mx

from kvstore.model.attention import attends_unfused, packed_attention, unfused_attention

__all__ = ["unfused_for_model"]

#: The name mlx-lm's model modules import their attention function under.
_NAME = "scaled_dot_product_attention"


def unfused_for_model(model: Any) -> list[str]:
    """Route ``model``'s few-query dense attention through plain ops, and its quantized
    caches' attention through kvstore's kernel (see the module).

    Changes the modules its layers' classes are defined in, so every model of those
    classes in the process is served so; idempotent, and cheap once a model of its class
    was routed (its layers are walked once: ~0.6 ms for 32 layers). Returns the names of
    the modules that route so (empty: none imports mlx-lm's function).
    """
    from mlx_lm.models import base

    original = base.scaled_dot_product_attention
    known = _ROUTED.get(type(model))
    if known is not None and all(_routes(module, original) for module in known):
        return [module.__name__ for module in known]
    names = {type(module).__module__ for _, module in model.named_modules()}
    routed = []
    for name in sorted(names):
        module = sys.modules.get(name)
        if module is None:
            continue
        if getattr(module, _NAME, None) is original:
            setattr(module, _NAME, _routed_attention(original))
        if _routes(module, original):
            routed.append(module)
    _ROUTED[type(model)] = routed
    return [module.__name__ for module in routed]


#: Per model class, the modules :func:`unfused_for_model` found routing it.
_ROUTED: dict[type, list[ModuleType]] = {}


def _routes(module: ModuleType, original: Callable[..., mx.array]) -> bool:
    return getattr(getattr(module, _NAME, None), "__wrapped__", None) is original


def _routed_attention(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    @functools.wraps(original)
    def attend(
        queries: mx.array,
        keys: Any,
        values: Any,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: mx.array | None = None,
    ) -> mx.array:
        if sinks is None and hasattr(cache, "bits"):  # mlx-lm's own test for packed rows
            return packed_attention(
                queries,
                keys,
                values,
                scale,
                mask,
                group_size=cache.group_size,
                bits=cache.bits,
                mode=getattr(cache, "mode", "affine"),
            )
        if sinks is None and _unfused(queries, keys):
            return unfused_attention(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    return attend


def _unfused(queries: mx.array, keys: Any) -> bool:
    return isinstance(keys, mx.array) and attends_unfused(queries.shape[-2], keys.shape[-2])
