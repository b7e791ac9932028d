"""Token samplers: greedy, temperature, top-p, top-k, reproducible with a seed;
presence and frequency penalties.

A sampler maps log-probabilities ``[B, vocab]`` to token ids ``[B]``. The
filters are mlx-lm's (``sample_utils``); a seeded sampler draws from its own
key chain, so its tokens depend only on the seed and the logits, never on
the global random state or on other samplers.

:class:`PenalisedSampler` wraps a sampler with mlx-lm's presence and frequency
penalties (``make_logits_processors(presence_penalty=, frequency_penalty=)``):
it keeps the prompt and what it sampled, and subtracts the penalties before
sampling. mlx-lm applies them to the logits, a sampler sees log-probabilities;
the two differ by one constant per row, which neither softmax nor argmax sees,
so the tokens are mlx-lm's. mlx-lm's ``repetition_penalty`` is not offered: it
divides positive and multiplies negative *logits*, a sign log-probabilities
no longer carry (each is <= 0).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import cast

import mlx.core as mx

__all__ = [
    "Sampler",
    "Distribution",
    "greedy",
    "make_sampler",
    "make_distribution",
    "apply_top_k",
    "apply_top_p",
    "PenalisedSampler",
]

Sampler = Callable[[mx.array], mx.array]
#: Log-probabilities ``[..., vocab]`` -> the probabilities a sampler draws from.
Distribution = Callable[[mx.array], mx.array]


def greedy(logprobs: mx.array) -> mx.array:
    """The most likely token."""
    return mx.argmax(logprobs, axis=-1)


def apply_top_k(logprobs: mx.array, top_k: int) -> mx.array:
    """Keep the ``top_k`` most likely tokens (the others get ``-inf``)."""
    drop = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(logprobs, drop, mx.array(-float("inf"), logprobs.dtype), axis=-1)


def apply_top_p(logprobs: mx.array, top_p: float) -> mx.array:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``."""
    sorted_logprobs = mx.sort(logprobs, axis=-1)
    sorted_probs = mx.exp(sorted_logprobs.astype(mx.float32))
    mass_above = mx.cumsum(sorted_probs, axis=-1, reverse=True, inclusive=False)
    total_mass = mass_above[..., :1] + sorted_probs[..., :1]
    num_dropped = (mass_above >= top_p * total_mass).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(sorted_logprobs, num_dropped, axis=-1)
    return mx.where(logprobs < threshold, -float("inf"), logprobs)


def make_sampler(
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
) -> Sampler:
    """A sampler; ``temperature == 0`` is greedy (the other settings are then unused).

    Args:
        temperature: softmax temperature (> 0 samples).
        top_p: nucleus mass in (0, 1]; 1 keeps every token.
        top_k: keep the k most likely tokens; 0 keeps every token.
        seed: seeds the sampler's own key chain (reproducible); ``None`` draws
            from MLX's global random state.

    Raises:
        ValueError: a setting out of range.
    """
    if temperature < 0:
        raise ValueError(f"[sampler] temperature must be >= 0; received {temperature}.")
    if not 0 < top_p <= 1:
        raise ValueError(f"[sampler] top_p must be in (0, 1]; received {top_p}.")
    if type(top_k) is not int or top_k < 0:
        raise ValueError(f"[sampler] top_k must be an int >= 0 (0: off); received {top_k!r}.")
    if temperature == 0:
        return greedy

    inv_temp = 1.0 / temperature
    key = [mx.random.key(seed)] if seed is not None else None

    def sample(logprobs: mx.array) -> mx.array:
        if top_p < 1:
            logprobs = apply_top_p(logprobs, top_p)
        if 0 < top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, top_k)
        if key is None:
            return mx.random.categorical(logprobs * inv_temp)
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sample


class PenalisedSampler:
    """``sampler`` with mlx-lm's presence and frequency penalties over recent tokens.

    Every call subtracts ``presence_penalty`` once from each token among the last
    ``presence_context_size`` tokens seen, and ``frequency_penalty`` once per
    occurrence among the last ``frequency_context_size``, then samples with
    ``sampler`` and remembers the token it returns. The tokens seen are the
    prompt (all of it, also when a store restored part of it: a warm run samples
    what a cold one does) and every token sampled since, as in mlx-lm's
    ``generate_step``. One instance serves one generation of one sequence.

    Args:
        prompt_tokens: the prompt's token ids.
        sampler: what samples the penalised log-probabilities (greedy by default).
        presence_penalty: subtracted once from a token seen recently (0: off).
        presence_context_size: how many of the newest tokens count for it.
        frequency_penalty: subtracted per recent occurrence (0: off).
        frequency_context_size: how many of the newest tokens count for it.

    Raises:
        ValueError: a context size < 1 or a penalty that is not finite.
    """

    def __init__(
        self,
        prompt_tokens: Iterable[int],
        sampler: Sampler = greedy,
        *,
        presence_penalty: float = 0.0,
        presence_context_size: int = 20,
        frequency_penalty: float = 0.0,
        frequency_context_size: int = 20,
    ) -> None:
        for name, size in (
            ("presence_context_size", presence_context_size),
            ("frequency_context_size", frequency_context_size),
        ):
            if type(size) is not int or size < 1:
                raise ValueError(f"[sampler] {name} must be an int >= 1; received {size!r}.")
        for name, value in (
            ("presence_penalty", presence_penalty),
            ("frequency_penalty", frequency_penalty),
        ):
            if not -float("inf") < value < float("inf"):
                raise ValueError(f"[sampler] {name} must be finite; received {value!r}.")
        self.sampler = sampler
        self.presence = (float(presence_penalty), presence_context_size)
        self.frequency = (float(frequency_penalty), frequency_context_size)
        # Only the newest tokens count: keep as many as the wider window.
        self.tokens: deque[int] = deque(
            (int(t) for t in prompt_tokens),
            maxlen=max(presence_context_size, frequency_context_size),
        )

    def penalise(self, logprobs: mx.array) -> mx.array:
        """``logprobs`` ``[1, vocab]`` with the penalties subtracted, renormalised
        (the log-probabilities mlx-lm's sampler would get)."""
        if logprobs.ndim != 2 or logprobs.shape[0] != 1:
            raise ValueError(
                f"[sampler] A PenalisedSampler follows one sequence: log-probabilities "
                f"[1, vocab]; received shape {tuple(logprobs.shape)}."
            )
        seen = list(self.tokens)
        out = logprobs
        for (penalty, size), per_occurrence in ((self.presence, False), (self.frequency, True)):
            recent = seen[-size:]
            if penalty == 0 or not recent:
                continue
            ids = mx.array(recent if per_occurrence else sorted(set(recent)))
            out = out.at[:, ids].subtract(mx.array(penalty, out.dtype))
        if out is logprobs:
            return logprobs
        return out - mx.logsumexp(out, axis=-1, keepdims=True)

    def __call__(self, logprobs: mx.array) -> mx.array:
        token = self.sampler(self.penalise(logprobs))
        self.tokens.append(cast(int, token.item()))
        return token


def make_distribution(temperature: float, top_p: float = 1.0, top_k: int = 0) -> Distribution:
    """The distribution :func:`make_sampler` with these settings draws from, as
    probabilities (speculative sampling compares the target's and the draft's).

    Raises:
        ValueError: a setting out of range, or ``temperature == 0`` (greedy
            has no distribution to compare: it accepts a draft token when it is
            the most likely one).
    """
    make_sampler(temperature, top_p, top_k)  # validates the settings
    if temperature == 0:
        raise ValueError("[sampler] A greedy sampler has no distribution; use temperature > 0.")
    inv_temp = 1.0 / temperature

    def probabilities(logprobs: mx.array) -> mx.array:
        if top_p < 1:
            logprobs = apply_top_p(logprobs, top_p)
        if 0 < top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, top_k)
        return mx.softmax(logprobs * inv_temp, axis=-1, precise=True)

    return probabilities
