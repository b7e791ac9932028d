"""Generation with a prefix store: :func:`kvstore.model.generate` with a store session.

The model's generation knows no store; this wraps it. The longest stored prefix
of the prompt is restored into the fresh caches, prefill captures each block
(sliding windows too, while they hold it), and after generation the prompt and
the generated tokens that have KV are saved, so the next turn of a conversation
reuses all of it. A store fault means recomputing (lookup, restore) or a logged
warning (save); ``stats.store_error`` says what happened.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx

from kvstore.abc.store import PrefixStore
from kvstore.bridge.namespace import namespace_for_model
from kvstore.bridge.session import StoreSession
from kvstore.model.generate import GeneratedToken, GenerationStats, collect
from kvstore.model.generate import generate as generate_without_store
from kvstore.model.policy import CachePolicy

__all__ = ["generate", "generate_tokens"]


def generate(
    model: Any,
    prompt_tokens: Sequence[int] | mx.array,
    caches: list[Any] | None = None,
    *,
    store: PrefixStore | None = None,
    namespace: str | None = None,
    policy: CachePolicy | None = None,
    **kwargs: Any,
) -> Iterator[GeneratedToken]:
    """:func:`kvstore.model.generate` reusing and feeding ``store``.

    Args:
        model: the reference model (:mod:`kvstore.model`).
        prompt_tokens: token ids.
        caches: per-layer caches (fresh ones are replaced by the stored prefix;
            ones already holding a prefix are continued and captured from there).
        store: a prefix store (:func:`kvstore.store.open_store`); ``None`` generates
            without one, exactly as :func:`kvstore.model.generate`.
        namespace: the store namespace; default :func:`namespace_for_model` of the
            model and its caches.
        policy: the cache families the model makes (not with ``caches``).
        **kwargs: the rest of :func:`kvstore.model.generate`'s arguments
            (``max_tokens``, sampling, ``chunk_size``...; not ``prefix_len``).

    Raises:
        CapabilityError: ``store`` is not a prefix store, or a cache family the
            store or the model cannot handle.
        ValueError: bad arguments (as :func:`kvstore.model.generate`).
    """
    if store is None:
        if namespace is not None:
            raise ValueError("[generate] namespace= names a store's namespace; pass store= too.")
        return generate_without_store(model, prompt_tokens, caches, policy=policy, **kwargs)
    if caches is not None and policy is not None:
        raise ValueError("[generate] Pass caches= or policy=, not both.")
    caches = model.make_cache(policy) if caches is None else caches
    session = StoreSession(store, namespace or namespace_for_model(model, caches=caches))
    return generate_without_store(model, prompt_tokens, caches, hooks=session, **kwargs)


def generate_tokens(
    model: Any, prompt_tokens: Sequence[int] | mx.array, **kwargs: Any
) -> tuple[list[int], GenerationStats]:
    """Run :func:`generate` to the end: ``(tokens, stats)``."""
    return collect(generate(model, prompt_tokens, **kwargs))
