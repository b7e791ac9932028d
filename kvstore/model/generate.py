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
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import mlx.core as mx
import numpy as np

from kvstore.abc.cache import can_trim
from kvstore.errors import CapabilityError
from kvstore.model.policy import CachePolicy
from kvstore.model.sampling import Sampler, greedy, make_distribution, make_sampler
from kvstore.model.speculative import (
    Drafter,
    DraftModel,
    PromptLookup,
    Sampling,
    begin_round,
    check_rollback,
    end_round,
    verify,
)
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
        kv_matched_tokens: prompt tokens whose KV the store matched; more than
            ``reused_tokens`` for a hybrid model whose match runs past its last
            recurrent checkpoint (0 without a store).
        store_error: why the store served or saved nothing, when it failed
            (generation recomputed or went on without it), else ``None``.
        target_forwards: forwards of the model after prefill (one per token
            without speculation; one per round with it).
        draft_tokens: draft tokens proposed to the target (speculative decoding).
        accepted_tokens: draft tokens the target kept.
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
    kv_matched_tokens: int = 0
    target_forwards: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Share of draft tokens the target kept (0 without speculation)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        """Tokens streamed after the first per forward of the model after prefill
        (1 without speculation; up to ``num_draft_tokens + 1`` with it)."""
        return (self.generated_tokens - 1) / self.target_forwards if self.target_forwards else 0.0


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

    For recurrent checkpoints (issue 16): ``prefill_stops(start, stop)`` names
    positions where prefill chunks must end, ``next_stop(offset)`` a position a
    decode round must not run past (``None``: any), and ``on_decode(offset,
    caches)`` runs after each decode step or round, the caches then holding
    ``offset`` verified tokens. ``kv_matched`` is how many prompt tokens the
    store matched (``>= reused`` tokens).
    """

    @property
    def block_size(self) -> int: ...

    lookup_s: float
    restore_s: float
    save_s: float
    error: str | None
    kv_matched: int

    def restore(self, tokens: np.ndarray, caches: list[Any]) -> list[Any]: ...

    def prefill_stops(self, start: int, stop: int) -> Sequence[int]: ...

    def next_stop(self, offset: int) -> int | None: ...

    def on_decode(self, offset: int, caches: list[Any]) -> None: ...

    def on_prefill_chunk(self, offset_end: int, caches: list[Any]) -> None: ...

    def save(self, tokens: np.ndarray, caches: list[Any]) -> None: ...


def prefill_chunks(
    start: int,
    stop: int,
    chunk_size: int,
    block_size: int | None,
    stops: Collection[int] = (),
) -> list[tuple[int, int]]:
    """The ``[begin, end)`` chunks covering prompt positions ``start..stop``.

    Every chunk but the last ends on a multiple of ``block_size``, so a chunk
    is at most ``chunk_size`` tokens and whole blocks never straddle chunks.
    ``block_size=None`` cuts plain ``chunk_size`` chunks. A chunk also ends at
    each of ``stops`` (where a recurrent checkpoint is taken).

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
    cuts = sorted(p for p in stops if start < p < stop)
    while pos < stop:
        end = min(stop, (pos + chunk_size) // block * block)
        while cuts and cuts[0] <= pos:
            cuts.pop(0)
        if cuts and cuts[0] < end:
            end = cuts.pop(0)
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
            f"cannot drop the last {excess} (a sliding window wrapped, or a recurrent state, "
            f"which is at one position only); restore a shorter prefix so at least one "
            f"prompt token is left to process.",
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
    draft: Drafter | Model | str | None = None,
    num_draft_tokens: int = 4,
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
        draft: speculative decoding (:mod:`kvstore.model.speculative`): a draft
            model (one of ours, or :class:`~kvstore.model.speculative.DraftModel`),
            ``"prompt-lookup"`` (n-gram drafting from the context,
            :class:`~kvstore.model.speculative.PromptLookup`), or any drafter.
            Greedy output is the same as without it; sampled output has the
            same distribution (the rejection rule; needs ``temperature`` etc.,
            not ``sampler=``).
        num_draft_tokens: draft tokens verified per target forward at most (>= 1).

    After generation the caches hold the prompt and every streamed token but the last.

    Raises:
        ValueError: bad arguments, or caches that disagree on their offset.
        TypeError: ``store=`` (generation with a store is :func:`kvstore.bridge.generate`).
        CapabilityError: a cache family the model cannot attend over; a fully
            cached prompt whose caches cannot drop a token; with ``draft``, a
            cache that cannot roll back.
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
    if num_draft_tokens < 1:
        raise ValueError(f"[generate] num_draft_tokens must be >= 1; received {num_draft_tokens}.")
    sampling = None if draft is None else _sampling(sampler, temperature, top_p, top_k, seed)
    if sampler is None:
        sampler = make_sampler(temperature, top_p, top_k, seed)
    elif (temperature, top_p, top_k, seed) != (0.0, 1.0, 0, None):
        raise ValueError(
            "[generate] Pass either sampler= or temperature/top_p/top_k/seed, not both."
        )
    drafter = _drafter(draft)
    tokens = _as_tokens(prompt_tokens)
    n_prompt = tokens.size
    caches = model.make_cache(policy) if caches is None else caches
    stop = frozenset(stop_tokens)
    if drafter is not None:
        check_rollback(caches)

    t0 = time.perf_counter()
    callback = on_prefill_chunk
    if hooks is not None:
        block_size = hooks.block_size
        caches[:] = hooks.restore(np.asarray(tokens), caches)
        callback = _both(hooks.on_prefill_chunk, on_prefill_chunk)
    start = _start_offset(caches, n_prompt, prefix_len)
    stops = hooks.prefill_stops(start, n_prompt) if hooks is not None else ()
    chunks = prefill_chunks(start, n_prompt, chunk_size, block_size, stops)
    logits = prefill(model, tokens, caches, chunks, callback)
    if hooks is not None:  # the caches hold the prompt: a decode-time position too
        hooks.on_decode(n_prompt, caches)
    y = sampler(_log_softmax(logits))
    token = cast(int, y.item())
    t_first = time.perf_counter()

    if drafter is not None:
        assert sampling is not None
        drafter.start(np.asarray(tokens), sampling)
        t_first = time.perf_counter()  # the draft's prefill is part of the time to first token

    streamed: list[int] = []
    ready: deque[int] = deque([token])
    counts = _Counts()
    try:
        while True:
            token = ready.popleft()
            streamed.append(token)
            if len(streamed) >= max_tokens or token in stop:
                break
            yield GeneratedToken(token)
            if ready:
                continue
            if drafter is None:
                logits = model.decode_step(caches)(y[:, None], caches)[:, -1, :]
                y = sampler(_log_softmax(logits))
                ready.append(cast(int, y.item()))
                counts.forwards += 1
                if hooks is not None:
                    hooks.on_decode(n_prompt + len(streamed), caches)
                continue
            assert sampling is not None
            offset = n_prompt + len(streamed) - 1  # the caches hold all but the last token
            n_draft = min(num_draft_tokens, max_tokens - len(streamed) - 1)
            landing = hooks.next_stop(offset) if hooks is not None else None
            if landing is not None:  # the round ends on it, not past it
                n_draft = min(n_draft, landing - offset - 1)
            out = _speculate(
                model,
                caches,
                drafter,
                sampling,
                np.concatenate([np.asarray(tokens), np.asarray(streamed, dtype=np.int64)]),
                n_draft,
                stop,
                max_tokens - len(streamed),
                counts,
            )
            ready.extend(out)
            if hooks is not None:
                hooks.on_decode(offset + len(out), caches)
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
            kv_matched_tokens=hooks.kv_matched if hooks else 0,
            target_forwards=counts.forwards,
            draft_tokens=counts.drafted,
            accepted_tokens=counts.accepted,
        ),
    )


@dataclass
class _Counts:
    forwards: int = 0
    drafted: int = 0
    accepted: int = 0


def _sampling(
    sampler: Sampler | None, temperature: float, top_p: float, top_k: int, seed: int | None
) -> Sampling:
    """How speculative rounds accept and draw: greedy, or the sampler's distribution."""
    if sampler is not None and sampler is not greedy:
        raise ValueError(
            "[generate] Speculative sampling compares the target's distribution with the "
            "draft's, which an opaque sampler= does not give; pass temperature/top_p/top_k "
            "(and seed) instead."
        )
    rng = np.random.default_rng(seed)
    if sampler is greedy or temperature == 0:
        return Sampling(None, rng)
    return Sampling(make_distribution(temperature, top_p, top_k), rng)


def _drafter(draft: Drafter | Model | str | None) -> Drafter | None:
    if draft is None:
        return None
    if type(draft) is str:
        if draft != "prompt-lookup":
            raise ValueError(
                f"[generate] draft={draft!r} is not a drafter; pass 'prompt-lookup', a draft "
                f"model, or a kvstore.model.speculative drafter."
            )
        return PromptLookup()
    if type(draft) is Model:
        return DraftModel(draft)
    return cast(Drafter, draft)


def _speculate(
    model: Model,
    caches: list[Any],
    drafter: Drafter,
    sampling: Sampling,
    history: np.ndarray,
    n_draft: int,
    stop: frozenset[int],
    budget: int,
    counts: _Counts,
) -> list[int]:
    """One round: draft, verify in one target forward, roll the caches back to what
    is kept. Returns the tokens to stream (at least one; a stop token or the
    ``budget`` of tokens still to stream ends them early). The caches then hold
    ``history`` and every returned token but the last."""
    drafts, draft_probs = drafter.propose(history, n_draft) if n_draft > 0 else ([], None)
    drafts = drafts[:n_draft]
    inputs = [int(history[-1]), *drafts]
    begin_round(caches)
    logits = model(mx.array(inputs)[None], cache=caches)[0]
    verdict = verify(_log_softmax(logits), drafts, draft_probs, sampling)
    out = verdict.tokens[:budget]
    for i, t in enumerate(out):
        if t in stop:
            out = out[: i + 1]
            break
    end_round(caches, len(out), len(inputs))
    drafter.settle(np.concatenate([history, np.asarray(out, dtype=np.int64)]))
    counts.forwards += 1
    counts.drafted += len(drafts)
    counts.accepted += verdict.accepted
    return out


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
