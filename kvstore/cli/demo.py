"""``kvstore demo``: a smoke demo of what exists so far (the cache families)."""

from __future__ import annotations

import argparse

import mlx.core as mx


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the demo")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvstore.abc.cache import signature_string
    from kvstore.caches import KVCache, QuantizedKVCache, RotatingKVCache, RotatingQuantizedKVCache

    mx.random.seed(0)
    keys = mx.random.normal((1, 8, 512, 128)).astype(mx.bfloat16)
    print(f"{'family':<28}{'bytes/token':>12}{'nbytes':>12}")
    for cache in (
        KVCache(),
        QuantizedKVCache(64, 8),
        QuantizedKVCache(64, 4),
        RotatingKVCache(256, keep=4),
        RotatingQuantizedKVCache(256, keep=4, bits=4),
    ):
        cache.update_and_fetch(keys, keys)
        print(f"{signature_string(cache):<28}{cache.bytes_per_token():>12}{cache.nbytes:>12}")
    return 0
