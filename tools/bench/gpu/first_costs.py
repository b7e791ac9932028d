"""What a fresh process pays once: the restore's staging set-up, and its first save hand-offs.

    python3 tools/bench/gpu/first_costs.py [--tokens 4096] [--quick]

Two questions the thirty-fifth session left for the device:

* The restore's staging set-up (``cuda_pages.proven()``) held a fresh 8B server's
  warm-up 3.4-4.5 s on one H100 (``results/gpu/staging-h100/``). Which part: MLX's
  start, ``KernelTransport()`` (its kernels declared), the round trip that compiles and
  checks them, the page route's set-up, or its trial? Each is timed in turn; run the
  tool twice to see what MLX's kernel cache (``MLX_PTX_CACHE_DIR``, under /tmp by
  default) takes out in a second process.
* A fresh ``kvstore serve`` held its generating thread 5.6-7.0 ms per save on average
  over turn 1's saves, where G3's warm process holds it 1.2-2.2 ms. Each hand-off
  (``save_behind``) of a llama-8B-shaped cache growing by 512 tokens is timed: the
  first against the rest says whether it is a first-use cost.

Without CUDA the set-up part says so and the hand-offs still run (``--quick``: a tiny
shape, for this CPU).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any


def staging_parts() -> list[tuple[str, float]]:
    """Seconds of each part of the restore's staging set-up, in order."""
    parts: list[tuple[str, float]] = []
    start = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal start
        now = time.perf_counter()
        parts.append((name, now - start))
        start = now

    import mlx.core as mx

    mx.eval(mx.ones(4) + 1)
    lap("MLX's start (a first evaluation)")
    from kvstore.codecs import cuda, cuda_pages
    from kvstore.devices import default_is_cuda

    lap("import of the staging modules")
    if not default_is_cuda():
        return parts
    transport = cuda.KernelTransport()
    lap("KernelTransport()")
    # The round trip's parts one by one (the first use of each kernel), then the check.
    slot = transport.slot(1 << 20)
    lap("a pinned slot of 1 MiB")
    device = transport.to_device(slot, 1 << 20)
    lap("to_device (the upload kernel's first use)")
    transport.to_host(device, slot, 0)
    lap("to_host (the download kernel's first use)")
    del device
    slot.release()
    works = cuda._checked(transport)
    lap(f"its round trip, as available() checks it (passed: {works is not False})")
    cuda.available()
    lap("cuda.available() (a second transport, the process's)")
    cuda_pages.proven()
    lap("cuda_pages.proven() (the page route set up, its trial started)")
    passed = cuda_pages.trial_done()
    lap(f"the page route's trial (passed: {passed})")
    return parts


def hand_offs(
    tokens: int,
    layers: int,
    heads: int,
    dim: int,
    step: int,
    copies_first: bool = False,
    warm_copies: bool = False,
) -> list[float]:
    """Seconds the caller was held by each ``save_behind`` of caches growing by ``step``;
    with ``copies_first``, after the copies a hand-off makes, made and timed first; with
    ``warm_copies``, after ``kvstore serve``'s warm-up copies (:func:`handoff_copies` of
    32 tokens)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from kvstore.store import open_store

    caches = []
    for _ in range(layers):
        cache = KVCache()
        rows = mx.random.normal((1, heads, tokens, dim)).astype(mx.bfloat16)
        cache.update_and_fetch(rows, rows)
        caches.append(cache)
    mx.eval([c.keys for c in caches])
    if copies_first:
        copy_costs(caches, step)
    if warm_copies:  # as kvstore serve's warm-up does, on 32-token caches of their own
        from kvstore.store.kv.writer import handoff_copies

        small = []
        for _ in range(2):
            cache = KVCache()
            rows = mx.zeros((1, heads, 32, dim), mx.bfloat16)
            cache.update_and_fetch(rows, rows)
            small.append(cache)
        start = time.perf_counter()
        mx.eval(handoff_copies(small, 0, 32))
        took = (time.perf_counter() - start) * 1e3
        print(f"copies: the warm-up's (32 tokens, 2 layers): {took:.2f} ms")
    held = []
    with tempfile.TemporaryDirectory() as scratch:
        store = open_store(f"lmdb://{Path(scratch) / 's'}", map_size=4 * tokens * (1 << 20))
        try:
            ids = list(range(tokens))
            for stop in range(step, tokens + 1, step):
                handle = store.save_behind("first-costs", ids[:stop], caches)
                held.append(handle.held_s)
                store.flush()
        finally:
            store.close()
    return held


def copy_costs(caches: list[Any], step: int) -> None:
    """Print what the copies a hand-off makes cost the first time in a process: first as
    many zeroed buffers of their size as it makes (their allocation: MLX keeps freed
    buffers for the next of that size), then one layer's rows ``[0, step)`` (the copy
    kernel's first use), another layer's, every layer's keys and values at once, and
    those again."""
    import mlx.core as mx

    def timed(name: str, make: Any) -> None:
        start = time.perf_counter()
        mx.eval(make())
        print(f"copies: {name}: {(time.perf_counter() - start) * 1e3:.2f} ms", flush=True)

    def copies(arrays: list[Any]) -> Any:
        return lambda: [mx.contiguous(a[..., :step, :]) for a in arrays]

    rows = caches[0].keys[..., :step, :]
    count = 2 * len(caches)
    timed(
        f"{count} zeroed buffers of a copy's size (allocated)",
        lambda: [mx.zeros(rows.shape, rows.dtype) for _ in range(count)],
    )
    timed("one layer's keys, first", copies([caches[0].keys]))
    timed("another layer's keys", copies([caches[1].keys]))
    every = [a for c in caches for a in (c.keys, c.values)]
    timed("every layer's keys and values", copies(every))
    timed("every layer's keys and values again", copies(every))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--step", type=int, default=512, help="tokens each save adds")
    parser.add_argument("--quick", action="store_true", help="a tiny shape (a CPU)")
    parser.add_argument(
        "--copies-first", action="store_true", help="time a hand-off's copies before it"
    )
    parser.add_argument(
        "--warm-copies", action="store_true", help="kvstore serve's warm-up copies first"
    )
    args = parser.parse_args()
    for name, seconds in staging_parts():
        print(f"staging: {name}: {seconds * 1e3:.1f} ms", flush=True)
    shape = (2, 2, 16) if args.quick else (32, 8, 128)  # layers, KV heads, head_dim
    held = hand_offs(args.tokens, *shape, args.step, args.copies_first, args.warm_copies)
    for i, seconds in enumerate(held):
        print(f"hand-off {i + 1} (to {(i + 1) * args.step} tokens): {seconds * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
