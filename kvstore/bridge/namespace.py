"""The namespace of a model: what it is (its fingerprint) and what its caches hold.

Two runs may share stored blocks only if the K/V a prefill computes is the
same in both. That depends on the weights (config, tokenizer, parameters:
:func:`~kvstore.bridge.fingerprint.model_fingerprint`), on the cache
geometry, and also on the cache families: a quantized cache's attention sees
quantized keys, so every later position's K/V differs from a plain cache's.
So a namespace folds in, per layer, the cache's signature and window
(``max_size``/``keep``). The store's storage policy is *not* part of it: that
only changes how the same K/V is kept.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.abc.cache import is_sliding_window_cache, signature_string
from kvstore.bridge.fingerprint import model_fingerprint, namespace_for
from kvstore.errors import StoreConfigError

__all__ = ["namespace_for_model", "cache_layout", "fingerprint_of"]

_FINGERPRINTS: dict[int, str] = {}
_LOCK = threading.Lock()


def cache_layout(caches: Sequence[Any]) -> list[dict[str, Any]]:
    """Per layer: ``{"cache": signature}`` plus ``"window": [max_size, keep]`` for a
    sliding-window cache."""
    layout = []
    for cache in caches:
        entry: dict[str, Any] = {"cache": signature_string(cache)}
        if is_sliding_window_cache(cache):
            entry["window"] = [int(cache.max_size), int(cache.keep)]
        layout.append(entry)
    return layout


def fingerprint_of(model: Any) -> str:
    """:func:`model_fingerprint` of ``model``, computed once per model object.

    A model object's fingerprint hashes its parameters, so it is remembered
    for the object's lifetime: a model whose weights are changed in place
    needs ``namespace=`` given explicitly. Directories are not remembered
    here (their file digests are cached on disk by identity).
    """
    if isinstance(model, (str, os.PathLike)):
        return model_fingerprint(model)
    key = id(model)
    with _LOCK:
        known = _FINGERPRINTS.get(key)
    if known is not None:
        return known
    fingerprint = model_fingerprint(model)
    with _LOCK:
        _FINGERPRINTS[key] = fingerprint
    weakref.finalize(model, _FINGERPRINTS.pop, key, None)
    return fingerprint


def namespace_for_model(
    model: Any,
    *,
    policy: Any = None,
    caches: Sequence[Any] | None = None,
    tenant: str | None = None,
) -> str:
    """The namespace a model's caches are stored under.

    Args:
        model: a kvstore model, an mlx-lm model, or an mlx-lm model directory.
        policy: the :class:`~kvstore.model.CachePolicy` its caches are made with
            (kvstore models and directories; default plain).
        caches: the caches themselves, instead of ``policy`` (any model).
        tenant: an optional salt keeping tenants of a shared store apart.

    Raises:
        StoreConfigError: both ``policy`` and ``caches``, or a ``policy`` for an
            mlx-lm model.
        ModelLoadError: a directory without a readable config.json.
        CapabilityError: a model of no supported kind (from the fingerprint).
    """
    if policy is not None and caches is not None:
        raise StoreConfigError(
            "[namespace_for_model] Give policy or caches, not both.", found="policy+caches"
        )
    geometry, templates = _geometry(model, policy, caches)
    layout = [{**g, **c} for g, c in zip(geometry, cache_layout(templates), strict=True)]
    return namespace_for(fingerprint_of(model), layout, tenant)


def _geometry(
    model: Any, policy: Any, caches: Sequence[Any] | None
) -> tuple[list[dict[str, Any]], Sequence[Any]]:
    """(per-layer geometry, the caches the model fills) for each kind of model."""
    if isinstance(model, (str, os.PathLike)):
        from kvstore.model import ModelArgs, make_caches
        from kvstore.model.loader import read_config

        args = ModelArgs.from_config(read_config(Path(model).expanduser()))
        geometry = args.layer_layout()
        return geometry, caches if caches is not None else make_caches(geometry, policy)
    if callable(getattr(model, "layer_layout", None)):  # a kvstore model
        geometry = model.layer_layout()
        return geometry, caches if caches is not None else model.make_cache(policy)
    if policy is not None:
        raise StoreConfigError(
            "[namespace_for_model] A cache policy applies to kvstore models; for an mlx-lm "
            "model pass its caches (caches=...).",
            found=type(model).__name__,
        )
    if caches is None:  # mlx-lm's own choice (make_prompt_cache)
        from mlx_lm.models.cache import make_prompt_cache

        caches = make_prompt_cache(model)
    return [{} for _ in caches], caches
