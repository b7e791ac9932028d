"""The prefix store's side of the restore and save figures (P1, P2, P3).

Each case runs the real path a model would: an LMDB store in the scratch
directory, the workload's caches saved by ``store.save`` (every layer of a
block in one record, checksummed, committed durably), and restored by
``store.lookup`` + ``store.restore`` into fresh caches of the workload's
families (arrays evaluated, capacity rounded up for the next token).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvstore.bench.harness import BenchContext, Case
from kvstore.bench.workloads import SyntheticKV, cache_nbytes

__all__ = ["NS", "prompt_tokens", "fresh_caches", "open_bench_store", "restore", "save", "resave"]

NS = "bench"


def prompt_tokens(kv: SyntheticKV) -> np.ndarray:
    """Token ids of the workload's prompt, plus one: a lookup leaves the last to the model."""
    return np.random.default_rng(kv.tokens).integers(0, 150_000, kv.tokens + 1, dtype=np.uint32)


def fresh_caches(kv: SyntheticKV) -> list[Any]:
    """Empty caches of the workload's families (what ``model.make_cache()`` gives)."""
    from kvstore.caches import KVCache, RotatingKVCache

    shape, window = kv.shape, kv.shape.window or 0
    return [
        RotatingKVCache(max_size=window) if shape.is_sliding(i) else KVCache()
        for i in range(shape.layers)
    ]


@contextmanager
def open_bench_store(ctx: BenchContext, name: str, nbytes: int) -> Iterator[Any]:
    """An LMDB store ``name`` in the scratch directory, its map sized for ``nbytes``
    (so no timed call grows it), removed afterwards."""
    import shutil

    from kvstore.store import open_store

    path = ctx.scratch / name
    store = open_store(
        f"lmdb://{path}",
        block_size=ctx.sizes.block_tokens,
        map_size=4 * nbytes + (64 << 20),
        touch_interval=0,
    )
    try:
        yield store
    finally:
        store.close()
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def restore(ctx: BenchContext, kv: SyntheticKV) -> Iterator[Case]:
    """P1's ``ours``: lookup + read + checksum + live caches built and evaluated.

    Header parses are remembered across reads (a hot prefix is parsed once);
    ``reset`` forgets them, so every timed call parses every record.
    """
    from kvstore.codecs.record import forget_parsed_headers

    caches = kv.ours()
    tokens = prompt_tokens(kv)
    with open_bench_store(ctx, f"p1-{kv.shape.name}-{kv.tokens}", cache_nbytes(caches)) as store:
        store.save(NS, tokens[: kv.tokens], caches)
        del caches

        def run() -> list[Any]:
            restored = store.restore(store.lookup(NS, tokens), fresh_caches(kv))
            if restored[0].offset != kv.tokens:
                raise AssertionError(f"[bench] restored {restored[0].offset} of {kv.tokens}")
            return restored

        yield Case("ours", "ours", run, reset=forget_parsed_headers)


@contextmanager
def save(ctx: BenchContext, kv: SyntheticKV) -> Iterator[Case]:
    """P2's ``ours``: a prefix the store does not hold, saved and committed durably
    (``reset`` deletes it, untimed, so every timed call writes every block)."""
    caches = kv.ours()
    tokens = prompt_tokens(kv)[: kv.tokens]
    with open_bench_store(ctx, f"p2-{kv.shape.name}-{kv.tokens}", cache_nbytes(caches)) as store:

        def run() -> None:
            result = store.save(NS, tokens, caches)
            if result.deduplicated:
                raise AssertionError("[bench] a new save found blocks already stored")

        yield Case("ours", "ours", run, reset=lambda: store.delete(NS))


@contextmanager
def resave(ctx: BenchContext, kv: SyntheticKV) -> Iterator[Case]:
    """P3's ``ours``: saving a prefix the store already holds (hashing and one read)."""
    caches = kv.ours()
    tokens = prompt_tokens(kv)[: kv.tokens]
    with open_bench_store(ctx, f"p3-{kv.shape.name}-{kv.tokens}", cache_nbytes(caches)) as store:
        store.save(NS, tokens, caches)

        def run() -> None:
            if store.save(NS, tokens, caches).written:
                raise AssertionError("[bench] a re-save wrote blocks")

        yield Case("ours", "ours", run)
