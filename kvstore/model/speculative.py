"""Speculative decoding: draft tokens, verified in one forward of the target.

A *drafter* proposes up to ``γ`` tokens that follow the verified history (the
prompt and every token streamed so far); the target model processes its last
token and the drafts in one forward and keeps the longest run it agrees with,
plus one token of its own (the correction, or a bonus when every draft was
kept). Two drafters:

* :class:`PromptLookup` (n-gram / prompt-lookup drafting): the continuation of
  the latest earlier occurrence of the history's last n-gram. No second
  model; it pays off where text repeats (code, quoting, edits).
* :class:`DraftModel`: any of our models (a smaller one), with its own caches.

Acceptance (:func:`verify`): greedy keeps a draft token while it is the
target's most likely token, so the output is the target's greedy output
exactly. Sampled uses the standard rejection rule (Leviathan et al. 2023,
Chen et al. 2023): keep draft ``d`` with probability ``min(1, p(d) / q(d))``,
else draw from ``max(0, p - q)`` renormalised and stop; a draft that is not
sampled (prompt lookup) has ``q`` a point mass. The tokens are then
distributed exactly as the target's own sampler would draw them.

Rollback goes through one cache capability (:func:`kvstore.abc.cache.can_rollback`):
each cache opens a round before the verify forward and ends it keeping the
tokens the target kept. A KV cache trims the rest; a recurrent cache restores
the state it held before the round and replays exactly the kept tokens; a
sliding window cuts the forward's newest rows. So no cache ever holds, and
no checkpoint is ever taken of, a state that has seen an unverified token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import mlx.core as mx
import numpy as np

from kvstore.abc.cache import can_rollback, is_sliding_window_cache, keeps_rounds, signature_string
from kvstore.errors import CapabilityError
from kvstore.model.sampling import Distribution

__all__ = [
    "Drafter",
    "PromptLookup",
    "DraftModel",
    "Verdict",
    "verify",
    "begin_round",
    "end_round",
    "check_rollback",
]


class Drafter(Protocol):
    """What proposes draft tokens.

    ``start`` runs once, after the target's prefill; ``propose(history, n)``
    returns up to ``n`` tokens that follow ``history`` (``int64`` ids, the
    prompt and every token streamed so far) and, for a drafter that samples,
    the probabilities it drew each from (``[len, vocab]``; ``None`` for a
    deterministic one); ``settle(history)`` gets the verified history after
    each round.
    """

    def start(self, prompt: np.ndarray, sampling: Sampling) -> None: ...

    def propose(self, history: np.ndarray, n: int) -> tuple[list[int], np.ndarray | None]: ...

    def settle(self, history: np.ndarray) -> None: ...


@dataclass
class Sampling:
    """How the target draws: greedy (``distribution is None``) or from ``distribution``,
    with ``rng`` for every random draw of the round (seeded: reproducible)."""

    distribution: Distribution | None
    rng: np.random.Generator

    def draw(self, probs: np.ndarray) -> int:
        return int(self.rng.choice(len(probs), p=probs / probs.sum()))


def _probs(distribution: Distribution, logprobs: mx.array) -> np.ndarray:
    return np.asarray(distribution(logprobs).astype(mx.float32), dtype=np.float64)


@dataclass(frozen=True)
class PromptLookup:
    """Prompt-lookup drafting: find the latest earlier occurrence of the history's
    last ``max_ngram`` tokens (then shorter n-grams, down to ``min_ngram``) and
    propose what followed it.

    Args:
        max_ngram: longest n-gram matched.
        min_ngram: shortest n-gram matched (a 1-gram proposes often and poorly).
    """

    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"[PromptLookup] needs 1 <= min_ngram <= max_ngram; received "
                f"min_ngram={self.min_ngram}, max_ngram={self.max_ngram}."
            )

    def start(self, prompt: np.ndarray, sampling: Sampling) -> None:
        return None

    def propose(self, history: np.ndarray, n: int) -> tuple[list[int], np.ndarray | None]:
        size = len(history)
        for k in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            # Windows of k tokens that end before the last token (so something follows).
            windows = np.lib.stride_tricks.sliding_window_view(history[: size - 1], k)
            hits = np.flatnonzero((windows == history[size - k :]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + k
                return history[start : start + n].tolist(), None
        return [], None

    def settle(self, history: np.ndarray) -> None:
        return None


class DraftModel:
    """A draft model of ours, with its own caches (``model.make_cache(policy)``).

    Its caches must roll back across several one-token forwards (growing KV
    caches trim, Gated-DeltaNet states replay); sliding-window layers cannot,
    once their window wraps, so a draft with them is refused.

    Args:
        model: the draft model (any :class:`~kvstore.model.Model`; same tokenizer
            as the target).
        caches: its caches (default ``model.make_cache(policy)``).
        policy: the cache policy of its caches.
        chunk_size: its prefill chunk length.
    """

    def __init__(
        self,
        model: Any,
        caches: list[Any] | None = None,
        *,
        policy: Any = None,
        chunk_size: int = 512,
    ) -> None:
        self.model = model
        self.caches = model.make_cache(policy) if caches is None else caches
        self.chunk_size = chunk_size
        for i, cache in enumerate(self.caches):
            if is_sliding_window_cache(cache) or not can_rollback(cache):
                raise CapabilityError(
                    f"[speculative] A draft model's caches must roll back across its one-token "
                    f"forwards; layer {i} has '{signature_string(cache)}'. Use a draft without "
                    f"sliding-window layers, or prompt-lookup drafting.",
                    layer=i,
                    signature=signature_string(cache),
                )
        self._fed = 0  # history tokens the draft's caches hold
        self._round: list[int] = []
        self._sampling: Sampling | None = None

    def start(self, prompt: np.ndarray, sampling: Sampling) -> None:
        self._sampling = sampling
        held = int(self.caches[0].offset) if self.caches else 0
        tokens = mx.array(prompt)
        for begin in range(held, len(prompt), self.chunk_size):
            self.model(tokens[None, begin : begin + self.chunk_size], cache=self.caches)
            mx.eval([c.state for c in self.caches])
        self._fed = len(prompt)

    def propose(self, history: np.ndarray, n: int) -> tuple[list[int], np.ndarray | None]:
        assert self._sampling is not None, "start() first"
        pending = history[self._fed :].tolist()
        if n < 1 or not pending:
            return [], None
        sampling = self._sampling
        begin_round(self.caches)
        drafts: list[int] = []
        probs: list[np.ndarray] = []
        feed = pending
        for _ in range(n):
            logits = self.model(mx.array(feed)[None], cache=self.caches)[0, -1]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            if sampling.distribution is None:
                token = cast(int, mx.argmax(logprobs).item())
            else:
                q = _probs(sampling.distribution, logprobs)
                token = sampling.draw(q)
                probs.append(q)
            drafts.append(token)
            feed = [token]
        # The round fed the pending tokens and every draft but the last.
        self._round = pending + drafts[:-1]
        return drafts, (np.stack(probs) if probs else None)

    def settle(self, history: np.ndarray) -> None:
        if not self._round:
            return
        verified = history[self._fed : self._fed + len(self._round)]
        fed = np.asarray(self._round[: len(verified)])
        keep = int(np.argmin(np.append(fed == verified, False)))  # common prefix
        end_round(self.caches, keep, len(self._round))
        self._fed += keep
        self._round = []


@dataclass(frozen=True)
class Verdict:
    """What the target made of one round: the tokens to stream (the drafts it kept,
    then its own), and how many drafts it kept."""

    tokens: list[int]
    accepted: int


def verify(
    logprobs: mx.array,
    drafts: Sequence[int],
    draft_probs: np.ndarray | None,
    sampling: Sampling,
) -> Verdict:
    """Accept a prefix of ``drafts`` from the target's ``logprobs`` ``[len(drafts) + 1, vocab]``
    (position ``i`` predicts the token after the round's ``i``-th input).

    Greedy keeps draft ``i`` while it is the argmax at ``i``. Sampled keeps it with
    probability ``min(1, p(d) / q(d))`` (``q`` a point mass when ``draft_probs``
    is ``None``), else draws the correction from ``max(0, p - q)``.
    """
    n = len(drafts)
    if sampling.distribution is None:
        best = cast(list[int], mx.argmax(logprobs, axis=-1).tolist())
        kept = 0
        while kept < n and drafts[kept] == best[kept]:
            kept += 1
        return Verdict([*drafts[:kept], best[kept]], kept)
    p = _probs(sampling.distribution, logprobs)
    for i, d in enumerate(drafts):
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if sampling.rng.random() < min(1.0, p[i, d] / q_d if q_d > 0 else 0.0):
            continue
        residual = p[i].copy()
        if draft_probs is None:
            residual[d] = 0.0
        else:
            residual = np.maximum(residual - draft_probs[i], 0.0)
        if residual.sum() <= 0:  # p <= q everywhere but rounding: fall back to p itself
            residual = p[i]
        return Verdict([*drafts[:i], sampling.draw(residual)], i)
    return Verdict([*drafts, sampling.draw(p[n])], n)


def check_rollback(caches: Sequence[Any]) -> None:
    """Raise unless every cache can take back the tokens of a round.

    Raises:
        CapabilityError: a cache that cannot roll back (mlx-lm's ``ArraysCache``,
            an unknown family); the message names it.
    """
    for i, cache in enumerate(caches):
        if not can_rollback(cache):
            raise CapabilityError(
                f"[speculative] Speculative decoding takes back rejected draft tokens; the "
                f"cache of layer {i} ('{signature_string(cache)}', {type(cache).__name__}) "
                f"cannot. Use model.make_cache() caches.",
                layer=i,
                signature=signature_string(cache),
            )


def begin_round(caches: Sequence[Any]) -> None:
    """Open a round on every cache (a trimmable cache without rounds needs none)."""
    for cache in caches:
        if keeps_rounds(cache):
            cache.begin_round()


def end_round(caches: Sequence[Any], keep: int, processed: int) -> None:
    """Keep the first ``keep`` of the ``processed`` tokens of the round in every cache."""
    for cache in caches:
        if keeps_rounds(cache):
            cache.end_round(keep)
        elif keep < processed:
            cache.trim(processed - keep)
