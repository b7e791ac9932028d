"""Streaming generation with chunked, block-aligned prefill.

:func:`generate` prefills the prompt in chunks whose ends fall on multiples of
``block_size`` (absolute token positions), calls ``on_prefill_chunk`` after
each chunk is evaluated — the moment a prefix store captures the blocks of
that chunk, while a sliding window still holds them — then samples and
streams tokens. Caches that already hold a prefix (offset > 0, e.g. restored
from a store) are continued: only the rest of the prompt is prefilled, and
always at least one token, so the first sampled token has fresh logits.

It yields one type, :class:`GeneratedToken` (as mlx-lm's ``stream_generate``
yields ``GenerationResponse``): the token, and on the last one the run's
:class:`GenerationStats`. Generation here knows no store: a prefix store joins
through ``hooks=`` (:class:`GenerationHooks`), which
:func:`kvstore.bridge.generate` fills with a store session.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import mlx.core as mx
import numpy as np

from kvstore.abc.cache import can_trim
from kvstore.errors import CapabilityError
from kvstore.model.policy import CachePolicy
from kvstore.model.sampling import Sampler, make_sampler
from kvstore.model.transformer import Model

__all__ = ["GenerationStats", "generate", "generate_tokens", "prefill_chunks", "prefill"]

#: ``on_prefill_chunk(offset_end, caches)``: called after each prefill chunk is evaluated.
ChunkCallback = Callable[[int, list[Any]], None]


@dataclass(frozen=True)
class GenerationStats:
    """What one :func:`generate` call did and how fast.

    Attributes:
        prompt_tokens: length of the prompt.
        reused_tokens: prompt tokens already in the caches when generation began.
        prefilled_tokens: prompt tokens the model processed (``prompt - reused``).
        generated_tokens: tokens streamed.
        ttft_s: seconds from the call's first step to the first token.
        prefill_s: seconds spent prefilling (first token's logits and sample included).
        decode_s: seconds from the first token to the last.
        prefill_tps: ``prefilled_tokens / prefill_s``.
        decode_tps: tokens after the first per second of ``decode_s`` (0 if fewer than 2).
        lookup_s, restore_s, save_s: seconds spent looking the prompt up in the
            store, rebuilding the caches from it, and saving after generation
            (0 without a store, i.e. without ``hooks``; lookup and restore are
            part of ``ttft_s``).
        store_error: why the store served or saved nothing, when it failed
            (generation recomputed or went on without it), else ``None``.
    """

    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    generated_tokens: int
    ttft_s: float
    prefill_s: float
    decode_s: float
    prefill_tps: float
    decode_tps: float
    lookup_s: float = 0.0
    restore_s: float = 0.0
    save_s: float = 0.0
    store_error: str | None = None


@dataclass(frozen=True)
class GeneratedToken:
    """One item :func:`generate` yields: a token, and the run's stats on the last one."""

    token: int
    stats: GenerationStats | None = None


class GenerationHooks(Protocol):
    """What joins one generation from outside (a prefix store's session,
    :class:`kvstore.bridge.session.StoreSession`).

    ``restore`` gets fresh caches before prefill and returns the caches to use
    (holding a reused prefix or not); ``on_prefill_chunk`` runs after each
    prefill chunk; ``save`` gets the tokens whose KV the caches hold once
    generation ends (or is stopped). None of them may raise for a fault of
    their own: a hook that fails leaves generation as it would be without it.
    """

    @property
    def block_size(self) -> int: ...

    lookup_s: float
    restore_s: float
    save_s: float
    error: str | None

    def restore(self, tokens: np.ndarray, caches: list[Any]) -> list[Any]: ...

    def on_prefill_chunk(self, offset_end: int, caches: list[Any]) -> None: ...

    def save(self, tokens: np.ndarray, caches: list[Any]) -> None: ...


def prefill_chunks(
    start: int, stop: int, chunk_size: int, block_size: int | None
) -> list[tuple[int, int]]:
    """The ``[begin, end)`` chunks covering prompt positions ``start..stop``.

    Every chunk but the last ends on a multiple of ``block_size``, so a chunk
    is at most ``chunk_size`` tokens and whole blocks never straddle chunks.
    ``block_size=None`` cuts plain ``chunk_size`` chunks.

    Raises:
        ValueError: ``chunk_size`` < 1 or smaller than ``block_size``.
    """
    block = block_size or 1
    if block < 1 or chunk_size < block:
        raise ValueError(
            f"[generate] chunk_size must be >= block_size >= 1 (chunks end on block "
            f"boundaries); received chunk_size={chunk_size}, block_size={block_size}."
        )
    chunks, pos = [], start
    while pos < stop:
        end = min(stop, (pos + chunk_size) // block * block)
        chunks.append((pos, end))
        pos = end
    return chunks


def _as_tokens(prompt_tokens: Sequence[int] | mx.array) -> mx.array:
    if type(prompt_tokens) is mx.array:
        tokens = prompt_tokens
    else:  # lists, ranges, numpy arrays
        tokens = mx.array(np.asarray(prompt_tokens))
    if tokens.ndim != 1 or tokens.size == 0 or not mx.issubdtype(tokens.dtype, mx.integer):
        raise ValueError(
            f"[generate] prompt_tokens must be a non-empty 1-D sequence of token ids; "
            f"received shape {tuple(tokens.shape)} of {tokens.dtype}."
        )
    return tokens


def _start_offset(caches: list[Any], n_prompt: int, prefix_len: int | None) -> int:
    """Where prefill starts: the caches' common offset, leaving at least one token."""
    offsets = sorted({int(c.offset) for c in caches})
    if len(offsets) != 1:
        raise ValueError(
            f"[generate] Every layer's cache must hold the same number of tokens; "
            f"received offsets {offsets}. Restore all layers to the same prefix."
        )
    start = offsets[0]
    if prefix_len is not None and prefix_len != start:
        raise ValueError(
            f"[generate] prefix_len={prefix_len} but the caches hold {start} tokens; "
            f"pass caches restored to exactly the prefix (or omit prefix_len)."
        )
    if start < n_prompt:
        return start
    # A fully cached prompt still needs one token through the model for fresh logits.
    excess = start - (n_prompt - 1)
    if not all(can_trim(c) for c in caches):
        raise CapabilityError(
            f"[generate] The caches hold {start} tokens of a {n_prompt}-token prompt and "
            f"cannot drop the last {excess} (a sliding window wrapped); restore a shorter "
            f"prefix so at least one prompt token is left to process.",
            offset=start,
            prompt_tokens=n_prompt,
        )
    for c in caches:
        c.trim(excess)
    return n_prompt - 1


def prefill(
    model: Model,
    tokens: mx.array,
    caches: list[Any],
    chunks: Sequence[tuple[int, int]],
    on_prefill_chunk: ChunkCallback | None = None,
) -> mx.array:
    """Run ``tokens[begin:end]`` of each chunk through the model; the last
    position's logits ``[1, vocab]``. The output head runs only on that position."""
    logits = None
    for i, (begin, end) in enumerate(chunks):
        hidden = model.model(tokens[None, begin:end], cache=caches)
        if i == len(chunks) - 1:
            logits = model.logits(hidden[:, -1, :])
            mx.eval(logits, [c.state for c in caches])
        else:
            mx.eval([c.state for c in caches])
        if on_prefill_chunk is not None:
            on_prefill_chunk(end, caches)
    assert logits is not None
    return logits


def _log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def generate(
    model: Model,
    prompt_tokens: Sequence[int] | mx.array,
    caches: list[Any] | None = None,
    *,
    max_tokens: int,
    policy: CachePolicy | None = None,
    sampler: Sampler | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    chunk_size: int = 512,
    block_size: int | None = 256,
    prefix_len: int | None = None,
    stop_tokens: Collection[int] = (),
    on_prefill_chunk: ChunkCallback | None = None,
    hooks: GenerationHooks | None = None,
    **unexpected: Any,
) -> Iterator[GeneratedToken]:
    """Stream tokens for ``prompt_tokens``: one :class:`GeneratedToken` each, the last
    one carrying the run's :class:`GenerationStats`.

    Args:
        model: the model.
        prompt_tokens: token ids.
        caches: per-layer caches, updated in place; ``model.make_cache(policy)``
            by default. Caches holding a prefix (offset > 0) are continued.
        max_tokens: tokens to generate at most (>= 1).
        policy: the cache families :meth:`Model.make_cache` makes (plain by
            default); not with ``caches``.
        sampler: a sampler (:func:`~kvstore.model.sampling.make_sampler`); or
            give ``temperature``/``top_p``/``top_k``/``seed``. Greedy by default.
        chunk_size: prefill chunk length at most.
        block_size: chunk ends fall on multiples of it (``None``: plain chunks);
            with ``hooks``, the hooks' block size is used.
        prefix_len: tokens the caches already hold, checked against their offset.
        stop_tokens: generation ends after streaming one of these.
        on_prefill_chunk: ``f(offset_end, caches)`` after each chunk is evaluated.
        hooks: restore, capture and save around the run (a prefix store's session;
            :func:`kvstore.bridge.generate` passes one).

    After generation the caches hold the prompt and every streamed token but the last.

    Raises:
        ValueError: bad arguments, or caches that disagree on their offset.
        TypeError: ``store=`` (generation with a store is :func:`kvstore.bridge.generate`).
        CapabilityError: a cache family the model cannot attend over; a fully
            cached prompt whose caches cannot drop a token.
    """
    _refuse_unexpected(unexpected)
    if max_tokens < 1:
        raise ValueError(f"[generate] max_tokens must be >= 1; received {max_tokens}.")
    if caches is not None and policy is not None:
        raise ValueError("[generate] Pass caches= or policy=, not both.")
    if hooks is not None and prefix_len is not None:
        raise ValueError(
            "[generate] prefix_len checks caches you restored yourself; with a store the "
            "store restores them. Pass one or the other."
        )
    if sampler is None:
        sampler = make_sampler(temperature, top_p, top_k, seed)
    elif (temperature, top_p, top_k, seed) != (0.0, 1.0, 0, None):
        raise ValueError(
            "[generate] Pass either sampler= or temperature/top_p/top_k/seed, not both."
        )
    tokens = _as_tokens(prompt_tokens)
    n_prompt = tokens.size
    caches = model.make_cache(policy) if caches is None else caches
    stop = frozenset(stop_tokens)

    t0 = time.perf_counter()
    callback = on_prefill_chunk
    if hooks is not None:
        block_size = hooks.block_size
        caches[:] = hooks.restore(np.asarray(tokens), caches)
        callback = _both(hooks.on_prefill_chunk, on_prefill_chunk)
    start = _start_offset(caches, n_prompt, prefix_len)
    chunks = prefill_chunks(start, n_prompt, chunk_size, block_size)
    logits = prefill(model, tokens, caches, chunks, callback)
    y = sampler(_log_softmax(logits))
    token = cast(int, y.item())
    t_first = time.perf_counter()

    streamed: list[int] = []
    try:
        while True:
            streamed.append(token)
            if len(streamed) >= max_tokens or token in stop:
                break
            yield GeneratedToken(token)
            logits = model.decode_step(caches)(y[:, None], caches)[:, -1, :]
            y = sampler(_log_softmax(logits))
            token = cast(int, y.item())
    except GeneratorExit:  # the caller stopped early: what has KV is still worth keeping
        if hooks is not None:
            hooks.save(_with_kv(tokens, streamed), caches)
        raise
    t_end = time.perf_counter()
    if hooks is not None:  # before the last item, so its stats hold the save
        hooks.save(_with_kv(tokens, streamed), caches)

    prefill_s, decode_s = t_first - t0, t_end - t_first
    generated = len(streamed)
    yield GeneratedToken(
        token,
        GenerationStats(
            prompt_tokens=n_prompt,
            reused_tokens=start,
            prefilled_tokens=n_prompt - start,
            generated_tokens=generated,
            ttft_s=prefill_s,
            prefill_s=prefill_s,
            decode_s=decode_s,
            prefill_tps=(n_prompt - start) / prefill_s if prefill_s > 0 else 0.0,
            decode_tps=(generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0,
            lookup_s=hooks.lookup_s if hooks else 0.0,
            restore_s=hooks.restore_s if hooks else 0.0,
            save_s=hooks.save_s if hooks else 0.0,
            store_error=hooks.error if hooks else None,
        ),
    )


def _refuse_unexpected(unexpected: dict[str, Any]) -> None:
    if "store" in unexpected or "namespace" in unexpected:
        raise TypeError(
            "[generate] kvstore.model.generate knows no store; generation with a prefix "
            "store is kvstore.bridge.generate(model, prompt, store=store, ...) (and "
            "kvstore.bridge.generate_tokens)."
        )
    if unexpected:
        raise TypeError(
            f"[generate] Unexpected keyword argument(s): {', '.join(sorted(unexpected))}."
        )


def _with_kv(prompt: mx.array, streamed: list[int]) -> np.ndarray:
    """The tokens the caches hold KV for: the prompt and every streamed token but the last."""
    return np.concatenate([np.asarray(prompt), np.asarray(streamed[:-1], dtype=np.int64)])


def _both(first: ChunkCallback, second: ChunkCallback | None) -> ChunkCallback:
    if second is None:
        return first

    def both(offset_end: int, caches: list[Any]) -> None:
        first(offset_end, caches)
        second(offset_end, caches)

    return both


def generate_tokens(
    model: Model, prompt_tokens: Sequence[int] | mx.array, **kwargs: Any
) -> tuple[list[int], GenerationStats]:
    """Run :func:`generate` to the end: ``(tokens, stats)``."""
    return collect(generate(model, prompt_tokens, **kwargs))


def collect(items: Iterator[GeneratedToken]) -> tuple[list[int], GenerationStats]:
    """``(tokens, stats)`` of a whole :func:`generate` run."""
    tokens, stats = [], None
    for item in items:
        tokens.append(item.token)
        stats = item.stats
    assert stats is not None  # the last item carries them
    return tokens, stats
