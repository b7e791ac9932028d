"""Real caches for the store tests: tiny models, prefills, cache comparisons.

Used by the in-process tests and by the subprocess workers (``kv_worker``),
so both sides build the same models and compare caches the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from kvstore.codecs import snapshot_held
from kvstore.codecs.arrays import as_numpy
from kvstore.model import CachePolicy, build_model
from kvstore.model.generate import prefill, prefill_chunks

BLOCK = 16
CHUNK = 32
#: (config, cache policy) of every family the end-to-end tests cover.
FAMILIES: dict[str, tuple[str, CachePolicy | None]] = {
    "plain": ("tiny", None),
    "quant": ("tiny", CachePolicy(kv_bits=8, kv_group_size=64)),
    "window": ("tiny-gemma3", None),
    "window-quant": ("tiny-gemma3", CachePolicy(kv_bits=8, kv_group_size=64)),
    "turboquant": ("tiny", CachePolicy(turboquant=(3, 3))),
    "window-turboquant": ("tiny-gemma3", CachePolicy(turboquant=(4, 4))),
}
_MODELS: dict[str, Any] = {}


def model_for(config: str) -> Any:
    """The tiny model ``config`` (seed 0), built once per process."""
    if config not in _MODELS:
        _MODELS[config] = build_model(config, seed=0)
    return _MODELS[config]


def prompt(seed: int, n: int, vocab: int = 256) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def prefilled(
    model: Any, tokens: Sequence[int], policy: CachePolicy | None = None, chunk: int = CHUNK
) -> list[Any]:
    """The model's caches after a prefill of ``tokens`` in block-aligned chunks (as generate)."""
    caches = model.make_cache(policy)
    prefill(model, mx.array(tokens), caches, prefill_chunks(0, len(tokens), chunk, BLOCK))
    return caches


def token_by_token(model: Any, tokens: Sequence[int], policy: CachePolicy | None = None) -> list:
    """The caches after feeding ``tokens`` one at a time: every row then depends only on
    the tokens before it, computed identically for any prompt sharing them."""
    caches = model.make_cache(policy)
    for t in tokens:
        model(mx.array([[t]]), cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def held_rows(cache: Any) -> list[tuple[int, int, dict[str, np.ndarray]]]:
    """What a cache will still attend to: ``(start, stop, tensors)`` as numpy copies."""
    return [
        (s.start, s.stop, {k: np.array(as_numpy(v)) for k, v in s.tensors.items()})
        for s in snapshot_held(cache)
    ]


def assert_same_caches(got: Sequence[Any], want: Sequence[Any]) -> None:
    """Same offsets and bit-identical held rows, layer by layer."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g.signature(), g.offset) == (w.signature(), w.offset), i
        for (a0, a1, a), (b0, b1, b) in zip(held_rows(g), held_rows(w), strict=True):
            assert (a0, a1) == (b0, b1), (i, (a0, a1), (b0, b1))
            assert a.keys() == b.keys()
            for name in a:
                assert np.array_equal(a[name], b[name]), (i, name)


def log_probs_recorder() -> tuple[list[np.ndarray], Any]:
    """A greedy sampler that also records the log-probabilities it was given."""
    seen: list[np.ndarray] = []

    def sample(logprobs: mx.array) -> mx.array:
        seen.append(np.array(logprobs.astype(mx.float32)))
        return mx.argmax(logprobs, axis=-1)

    return seen, sample
