"""PenalisedSampler: mlx-lm's presence and frequency penalties, from log-probabilities."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvstore.model import PenalisedSampler, greedy, make_sampler

VOCAB = 64


def _logits(seed: int) -> mx.array:
    # raw logits of both signs, as a model's head gives them
    return 4 * mx.random.normal((1, VOCAB), key=mx.random.key(seed))


def _log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


SETTINGS = [
    dict(presence_penalty=3.0, presence_context_size=8),
    dict(frequency_penalty=0.7, frequency_context_size=12),
    dict(
        presence_penalty=1.5,
        presence_context_size=5,
        frequency_penalty=0.4,
        frequency_context_size=20,
    ),
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_the_penalties_are_mlx_lms_on_the_same_logits(settings):
    """Step by step, the log-probabilities and the greedy token mlx-lm's generate_step
    computes (processors on the logits, then log-softmax) from the same logits."""
    sample_utils = pytest.importorskip("mlx_lm.sample_utils")
    processors = sample_utils.make_logits_processors(**settings)
    prompt = [3, 9, 3, 27, 9, 9, 50, 1, 3, 12, 12, 40]  # repeats, inside and across windows
    ours = PenalisedSampler(prompt, greedy, **settings)
    tokens = list(prompt)
    for step in range(12):
        logits = _logits(step)
        theirs = logits + 0  # mlx-lm's presence processor writes into its input
        for processor in processors:
            theirs = processor(mx.array(tokens), theirs)
        expected = _log_softmax(theirs)
        got = ours.penalise(_log_softmax(logits))
        assert mx.allclose(got, expected, atol=1e-5).item(), step
        token = ours(_log_softmax(logits)).item()
        assert token == mx.argmax(expected, axis=-1).item()
        tokens.append(token)
    assert list(ours.tokens) == tokens[-len(ours.tokens) :]


def test_penalties_change_the_greedy_choice_and_nothing_else():
    logprobs = _log_softmax(mx.array([[2.0, 1.9, -1.0, 0.5]]))
    assert PenalisedSampler([], presence_penalty=1.0)(logprobs).item() == 0  # nothing seen
    assert PenalisedSampler([0], presence_penalty=1.0)(logprobs).item() == 1
    plain = PenalisedSampler([0, 1])  # no penalty: the wrapped sampler's choice, untouched
    assert plain.penalise(logprobs) is logprobs and plain(logprobs).item() == 0
    # frequency counts occurrences: 2.0 - 3 x 0.6 and 1.9 - 3 x 0.6 lose to 0.5
    assert PenalisedSampler([0, 0, 0, 1, 1, 1], frequency_penalty=0.6)(logprobs).item() == 3
    # the penalised row is still a distribution, for samplers that assume one
    out = PenalisedSampler([0, 1], presence_penalty=2.0).penalise(logprobs)
    assert abs(mx.exp(out).sum().item() - 1) < 1e-6


def test_a_penalised_sampler_is_deterministic_and_wraps_any_sampler():
    """Same prompt, same logits: same tokens (a warm run samples what a cold one does);
    it wraps a seeded sampler too."""

    def run(sampler):
        return [sampler(_log_softmax(_logits(i))).item() for i in range(10)]

    greedy_runs = [run(PenalisedSampler([1, 2, 3], presence_penalty=2.0)) for _ in range(2)]
    assert greedy_runs[0] == greedy_runs[1]
    seeded = [
        run(PenalisedSampler([1, 2, 3], make_sampler(1.0, seed=5), presence_penalty=2.0))
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


def test_penalised_sampler_settings_are_checked():
    with pytest.raises(ValueError, match="presence_context_size must be an int >= 1"):
        PenalisedSampler([], presence_context_size=0)
    with pytest.raises(ValueError, match="frequency_penalty must be finite"):
        PenalisedSampler([], frequency_penalty=float("nan"))
    with pytest.raises(ValueError, match=r"one sequence: log-probabilities \[1, vocab\]"):
        PenalisedSampler([1], presence_penalty=1.0)(mx.zeros((2, VOCAB)))
