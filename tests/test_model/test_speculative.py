"""Issue 16, speculative decoding: draft tokens verified in one target forward.

Greedy output is the non-speculative greedy output, for every cache family
(plain, quantized, TurboQuant, sliding window past its window, hybrid) and
every drafter (prompt lookup, a draft model, a drafter that is often wrong).
Rolling a round back keeps exactly what a direct run of the kept tokens
holds, for every keep of a 5-token round. Sampled rounds draw from the
target's distribution (the rejection rule), reproducibly with a seed.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from kvstore.abc.cache import can_rollback, is_recurrent_cache, is_sliding_window_cache
from kvstore.errors import CapabilityError
from kvstore.model import CachePolicy, build_model, generate_tokens
from kvstore.model.generate import prefill
from kvstore.model.sampling import make_distribution
from kvstore.model.speculative import (
    DraftModel,
    PromptLookup,
    Sampling,
    begin_round,
    end_round,
    verify,
)
from kvstore.testing.mlx_lm_models import seed_weights

SLIDING = {
    "model_type": "llama",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "rope_theta": 10000.0,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 16,
}

#: id -> (config, cache policy)
FAMILIES = {
    "plain": ("tiny", None),
    "quantized": ("tiny", CachePolicy(kv_bits=4)),
    "turboquant": ("tiny", CachePolicy(turboquant=(3, 3))),
    "sliding-window": (SLIDING, None),
    "hybrid": ("tiny-qwen3_5", None),
}


def diverse_model(config, seed=1):
    """Seeded weights large enough that greedy text does not collapse to one token."""
    return seed_weights(build_model(config), seed, scale=0.15)


def prompt(n=48):
    base = mx.random.randint(0, 256, (n // 2,), key=mx.random.key(3)).tolist()
    return base + base  # repeats: prompt lookup finds n-grams


class Noisy:
    """Proposes the true greedy continuation with every third token wrong."""

    def __init__(self, reference, n_prompt):
        self.reference, self.n_prompt, self.calls = reference, n_prompt, 0

    def start(self, prompt, sampling):
        pass

    def propose(self, history, n):
        out = []
        for k in range(len(history) - self.n_prompt, len(history) - self.n_prompt + n):
            if k >= len(self.reference):
                break
            self.calls += 1
            out.append(self.reference[k] if self.calls % 3 else (self.reference[k] + 1) % 256)
        return out, None

    def settle(self, history):
        pass


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_output_is_the_non_speculative_output(family):
    config, policy = FAMILIES[family]
    model = diverse_model(config)
    p = prompt()
    expected, plain = generate_tokens(model, p, max_tokens=40, policy=policy)
    assert len(set(expected)) > 5  # a real test: the text varies
    assert plain.target_forwards == 39 and plain.draft_tokens == 0
    drafters = [
        "prompt-lookup",
        Noisy(expected, len(p)),
        PromptLookup(max_ngram=4, min_ngram=2),
    ]
    if family != "sliding-window":  # a draft model's caches roll back across forwards
        drafters.append(DraftModel(diverse_model(config, seed=2), policy=policy))
    for draft in drafters:
        got, stats = generate_tokens(
            model, p, max_tokens=40, policy=policy, draft=draft, num_draft_tokens=5
        )
        assert got == expected, draft
        assert stats.generated_tokens == 40
        assert stats.target_forwards < 39 or stats.accepted_tokens == 0
        assert 0 <= stats.acceptance_rate <= 1
        assert stats.tokens_per_target_forward == pytest.approx(39 / stats.target_forwards)


def test_a_good_draft_takes_several_tokens_per_forward():
    model = diverse_model("tiny")
    p = prompt()
    expected, _ = generate_tokens(model, p, max_tokens=31)
    got, stats = generate_tokens(
        model, p, max_tokens=31, draft=Noisy(expected, len(p)), num_draft_tokens=4
    )
    assert got == expected
    assert stats.draft_tokens > 0 and stats.accepted_tokens > 0
    assert stats.tokens_per_target_forward > 1.5
    same, self_stats = generate_tokens(model, p, max_tokens=31, draft=model, num_draft_tokens=4)
    assert same == expected and self_stats.acceptance_rate == 1.0
    assert self_stats.target_forwards == 6  # 30 tokens, 5 per round


def test_stop_tokens_and_max_tokens_end_a_round_early():
    model = diverse_model("tiny-qwen3_5")
    p = prompt()
    expected, _ = generate_tokens(model, p, max_tokens=30)
    stop = expected[12]
    want, _ = generate_tokens(model, p, max_tokens=30, stop_tokens=[stop])
    caches = model.make_cache()
    got, _ = generate_tokens(
        model, p, caches=caches, max_tokens=30, stop_tokens=[stop], draft=model
    )
    assert got == want and got[-1] == stop
    # The caches hold the prompt and every streamed token but the last, as without drafts.
    assert {c.offset for c in caches} == {len(p) + len(got) - 1}
    for n in (1, 2, 7):
        short, _ = generate_tokens(model, p, max_tokens=n, draft=model, num_draft_tokens=5)
        assert short == expected[:n]


def _run(model, policy, tokens, chunks):
    caches = model.make_cache(policy)
    prefill(model, mx.array(tokens), caches, chunks)
    return caches


def _rows(cache):
    """The logical content of a cache: its offset and arrays -- a KV cache's rows in
    use (temporal order for a window), a recurrent cache's conv window and state."""
    if is_recurrent_cache(cache):
        return int(cache.offset), list(cache.state)
    if is_sliding_window_cache(cache):
        keys, values = cache.temporal_keys_and_values()
    else:
        keys, values = cache.keys_and_values()
    return int(cache.offset), [leaf for _, leaf in tree_flatten((keys, values))]


def _assert_same(a, b, where, exact=True):
    (off_a, arr_a), (off_b, arr_b) = _rows(a), _rows(b)
    assert off_a == off_b, where
    assert len(arr_a) == len(arr_b), where
    for x, y in zip(arr_a, arr_b):
        if x.shape != y.shape:  # a window holding more rows than it attends: its newest ones
            n = min(x.shape[2], y.shape[2])
            x, y = x[..., x.shape[2] - n :, :], y[..., y.shape[2] - n :, :]
        if exact:
            assert mx.array_equal(x, y).item(), where
        else:
            assert mx.allclose(x, y, atol=1e-5, rtol=1e-5).item(), where


#: (family, how the round's tokens are run); a wrapped window rolls back only a
#: round of one forward (one-token forwards into a full ring overwrite rows a rollback needs back).
ROUNDS = [(f, "one") for f in FAMILIES] + [
    (f, "per-token") for f in FAMILIES if f != "sliding-window"
]


@pytest.mark.parametrize("family, forwards", ROUNDS)
def test_rollback_of_every_partial_accept_equals_a_direct_run(family, forwards):
    """A round of 5 tokens ended keeping 0..5 of them holds what running exactly
    the kept tokens does -- bit for bit, and the next token's logits agree.

    A sliding window is the exception to "bit for bit": one token written into
    a wrapped ring attends over its rows in ring order, the round's forward in
    temporal order, so the sums run in another order (equal to float rounding;
    the rows the window holds are the same)."""
    config, policy = FAMILIES[family]
    model = diverse_model(config)
    tokens = prompt(40)  # past the sliding window of 16: the ring has wrapped
    round_tokens = [7, 8, 9, 10, 11]
    probe = mx.array([[42]])
    for keep in range(6):
        caches = _run(model, policy, tokens, [(0, 40)])
        begin_round(caches)
        if forwards == "one":
            model(mx.array(round_tokens)[None], cache=caches)
        else:
            for t in round_tokens:
                model(mx.array([[t]]), cache=caches)
        end_round(caches, keep, 5)
        direct = _run(model, policy, tokens, [(0, 40)])
        if keep:
            model(mx.array(round_tokens[:keep])[None], cache=direct)
        for i, (a, b) in enumerate(zip(caches, direct)):
            _assert_same(a, b, f"keep={keep} layer={i}", exact=family != "sliding-window")
        after = model(probe, cache=caches)
        expected = model(probe, cache=direct)
        assert mx.allclose(after, expected, atol=1e-5).item(), keep


def test_sampled_rounds_reproduce_with_a_seed_and_accept_their_own_draft():
    model = diverse_model("tiny-qwen3_5")
    p = prompt()
    kwargs = dict(max_tokens=24, temperature=0.8, top_p=0.95, seed=11, num_draft_tokens=4)
    a, stats = generate_tokens(model, p, draft=model, **kwargs)
    b, _ = generate_tokens(model, p, draft=model, **kwargs)
    assert a == b
    # A draft identical to the target proposes from the target's own distribution:
    # p(d) / q(d) == 1, so every draft is kept.
    assert stats.acceptance_rate == 1.0
    c, _ = generate_tokens(model, p, draft="prompt-lookup", **kwargs)
    assert len(c) == 24


@pytest.mark.parametrize("draft_probs", [False, True])
def test_rejection_rule_draws_from_the_target_distribution(draft_probs):
    """One draft position over a 4-token vocabulary: the first token streamed is
    distributed as the target's p, whatever the draft proposed."""
    distribution = make_distribution(1.0)
    p = np.array([0.5, 0.2, 0.2, 0.1])
    q = np.array([0.1, 0.6, 0.2, 0.1])
    logprobs = mx.log(mx.array(np.stack([p, p])))
    sampling = Sampling(distribution, np.random.default_rng(0))
    counts = np.zeros(4)
    n = 20000
    for _ in range(n):
        d = int(sampling.rng.choice(4, p=q)) if draft_probs else 1
        verdict = verify(logprobs, [d], q[None] if draft_probs else None, sampling)
        counts[verdict.tokens[0]] += 1
    assert np.abs(counts / n - p).max() < 0.015


def test_refusals():
    model = build_model("tiny")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        generate_tokens(model, [1, 2, 3], max_tokens=2, draft="prompt-lookup", num_draft_tokens=0)
    with pytest.raises(ValueError, match="not a drafter"):
        generate_tokens(model, [1, 2, 3], max_tokens=2, draft="medusa")
    with pytest.raises(ValueError, match="opaque sampler"):
        generate_tokens(
            model, [1, 2, 3], max_tokens=2, draft="prompt-lookup", sampler=lambda lp: lp.argmax(-1)
        )
    with pytest.raises(CapabilityError, match="sliding-window"):
        DraftModel(build_model("tiny-gemma3"))


def test_mlx_lm_caches_that_cannot_roll_back_are_refused():
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import ArraysCache, KVCache

    assert can_rollback(KVCache()) and not can_rollback(ArraysCache(2))
    model = build_model("tiny-qwen3_5")
    caches = [ArraysCache(2), *model.make_cache()[1:]]
    with pytest.raises(CapabilityError, match="cannot"):
        generate_tokens(model, [1, 2, 3], caches=caches, max_tokens=2, draft="prompt-lookup")


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    lookup = PromptLookup(max_ngram=3)
    history = np.array([5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7])
    assert lookup.propose(history, 3) == ([2, 3, 5], None)  # the latest "5 6 7", not the first
    assert lookup.propose(np.array([1, 2, 3, 4]), 3) == ([], None)  # nothing repeats
    assert PromptLookup(max_ngram=2, min_ngram=2).propose(np.array([4, 9, 4, 8, 4]), 2) == (
        [],
        None,
    )
    assert PromptLookup(max_ngram=2).propose(np.array([4, 9, 4, 8, 4]), 2) == ([8, 4], None)
    with pytest.raises(ValueError):
        PromptLookup(max_ngram=1, min_ngram=2)
