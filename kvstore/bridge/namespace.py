"""The namespace of a model: what it is (its fingerprint) and what its caches hold.

Two runs may share stored blocks only if the K/V a prefill computes is the
same in both. That depends on the weights (config, tokenizer, parameters:
:func:`~kvstore.bridge.fingerprint.model_fingerprint`), on the cache
geometry, and also on the cache families: a quantized cache's attention sees
quantized keys, so every later position's K/V differs from a plain cache's.
So a namespace folds in, per layer, the cache's signature and window
(``max_size``/``keep``). The store's storage policy is *not* part of it: that
only changes how the same K/V is kept.

A model mlx-lm runs (any architecture ``mlx_lm.load`` loads) is named by
:func:`namespace_for_mlx_lm`: :func:`~kvstore.bridge.fingerprint.mlx_lm_fingerprint`
(equal for the object and its directory) plus the per-layer layout of
``make_prompt_cache(model)``, plus what changes the K/V its generation
computes (``kv_bits``/``kv_group_size``/``quantized_kv_start``; adapters are in
the fingerprint). :func:`namespace_for_model` of a directory whose architecture
the reference model lacks is that namespace. mlx-lm is imported only when used.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.abc.cache import is_sliding_window_cache, signature_string
from kvstore.bridge.fingerprint import mlx_lm_fingerprint, model_fingerprint, namespace_for
from kvstore.errors import CapabilityError, StoreConfigError

__all__ = [
    "namespace_for_model",
    "namespace_for_mlx_lm",
    "mlx_lm_prompt_caches",
    "cache_layout",
    "fingerprint_of",
]

#: mlx-lm's default ``quantized_kv_start`` (``mlx_lm.generate.DEFAULT_QUANTIZED_KV_START``).
DEFAULT_QUANTIZED_KV_START = 5000

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

    An mlx-lm model object, and a directory of an architecture the reference
    model does not have (``qwen3_next``, ``phi3``...), get
    :func:`namespace_for_mlx_lm`: what mlx-lm runs.

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
    if policy is None and _runs_on_mlx_lm(model):
        return namespace_for_mlx_lm(model, caches=caches, tenant=tenant)
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

        args = ModelArgs.from_config(read_config(Path(model).expanduser()))  # a reference-model one
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


def _runs_on_mlx_lm(model: Any) -> bool:
    """An mlx-lm model object, or a directory only mlx-lm runs (not the reference model)."""
    if isinstance(model, (str, os.PathLike)):
        from kvstore.model.args import SUPPORTED_MODEL_TYPES
        from kvstore.model.loader import read_config

        config = read_config(Path(model).expanduser())
        return config.get("model_type") not in SUPPORTED_MODEL_TYPES
    return not callable(getattr(model, "layer_layout", None)) and hasattr(model, "args")


def mlx_lm_prompt_caches(model: Any) -> list[Any]:
    """``mlx_lm.models.cache.make_prompt_cache`` of an mlx-lm model, or of the model a
    directory's config describes (built without reading its weights).

    Raises:
        CapabilityError: an architecture mlx-lm does not have, or custom model code.
    """
    from mlx_lm.models.cache import make_prompt_cache

    if not isinstance(model, (str, os.PathLike)):
        return make_prompt_cache(model)
    from mlx_lm.utils import _get_classes, load_config

    root = Path(model).expanduser()
    config = load_config(root)
    if config.get("model_file") is not None:
        raise CapabilityError(
            f"[namespace_for_mlx_lm] {root} builds its architecture with custom code "
            f"({config['model_file']!r}); pass the loaded model object instead.",
            found=str(config["model_file"]),
        )
    try:
        model_class, args_class = _get_classes(config)
    except ValueError as exc:
        raise CapabilityError(
            f"[namespace_for_mlx_lm] mlx-lm cannot build {root}: {exc}",
            found=config.get("model_type"),
        ) from exc
    # Parameters are created lazily and never evaluated: only the cache layout is read.
    return make_prompt_cache(model_class(args_class.from_dict(config)))


def namespace_for_mlx_lm(
    model: Any,
    *,
    source: str | os.PathLike[str] | None = None,
    adapter_path: str | os.PathLike[str] | None = None,
    caches: Sequence[Any] | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    tenant: str | None = None,
) -> str:
    """The namespace of a model mlx-lm runs: the same for the object and its directory.

    Args:
        model: an mlx-lm model object (``mlx_lm.load(...)[0]``) or its directory.
        source: for an object, the directory it was loaded from unchanged (its
            fingerprint is then read from the digest cache instead of hashed).
        adapter_path: the adapters ``mlx_lm.load`` applied (with a directory or
            ``source``; an object's parameters hold them already).
        caches: the caches it fills, when not ``make_prompt_cache(model)``.
        kv_bits, kv_group_size, quantized_kv_start: mlx-lm's KV quantization
            (``stream_generate``/``mlx_lm.server`` options); ``kv_bits=None`` is none.
        tenant: an optional salt keeping tenants of a shared store apart.

    Raises:
        StoreConfigError: a directory that is not a model directory.
        CapabilityError: an architecture mlx-lm does not have.
    """
    if isinstance(model, (str, os.PathLike)) or source is not None or adapter_path is not None:
        fingerprint = mlx_lm_fingerprint(model, source=source, adapter_path=adapter_path)
    else:
        fingerprint = fingerprint_of(model)
    layout: Any = cache_layout(caches if caches is not None else mlx_lm_prompt_caches(model))
    if kv_bits is not None:
        # Quantized attention changes every later position's K/V, from where it starts.
        layout = {
            "layers": layout,
            "kv_bits": int(kv_bits),
            "kv_group_size": int(kv_group_size),
            "quantized_kv_start": int(quantized_kv_start),
        }
    return namespace_for(fingerprint, layout, tenant)
