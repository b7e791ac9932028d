"""Subprocess side of the hybrid-model store tests (``test_checkpoints``).

Run as ``python -m tests.test_store.hybrid_worker URL N_PROMPT SEED N_SHARED``:
generates with the tiny Qwen3.5-shaped model and the store at ``URL`` for a
prompt whose first ``N_SHARED`` tokens are :func:`tokens` ``(SEED)`` (the rest
another seed's), and prints one JSON document: the tokens generated, the
first step's log-probabilities, and the store figures the run reports.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx

from kvstore.bridge import generate_tokens
from kvstore.model import build_model
from kvstore.store import open_store

MAX_TOKENS = 4


def hybrid_model():
    return build_model("tiny-qwen3_5", seed=5)


def tokens(seed: int, n: int) -> list[int]:
    """The first ``n`` of a fixed sequence per seed (so shorter ones are its prefixes)."""
    assert n <= 4096
    return mx.random.randint(0, 256, (4096,), key=mx.random.key(seed)).tolist()[:n]


def prompt(n: int, seed: int, shared: int) -> list[int]:
    return tokens(seed, shared) + tokens(seed + 1000, n)[shared:]


def first_logprobs_sampler(seen: list):
    def sample(logprobs):
        if not seen:
            seen.append(logprobs.tolist())
        return mx.argmax(logprobs, axis=-1)

    return sample


def run(url: str, n: int, seed: int, shared: int, store: bool = True) -> dict:
    seen: list = []
    kwargs = {"max_tokens": MAX_TOKENS, "sampler": first_logprobs_sampler(seen)}
    if not store:
        out, stats = generate_tokens(hybrid_model(), prompt(n, seed, shared), **kwargs)
        return {"tokens": out, "logprobs": seen[0]}
    with open_store(url) as st:
        out, stats = generate_tokens(hybrid_model(), prompt(n, seed, shared), store=st, **kwargs)
        figures = st.stats()
    return {
        "tokens": out,
        "logprobs": seen[0],
        "reused": stats.reused_tokens,
        "kv_matched": stats.kv_matched_tokens,
        "checkpoints": figures.checkpoints,
        "misses": dict(figures.misses),
        "error": stats.store_error,
    }


if __name__ == "__main__":
    url, n, seed, shared = sys.argv[1], *map(int, sys.argv[2:5])
    print(json.dumps(run(url, n, seed, shared)))
