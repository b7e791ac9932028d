"""A CPU restore and the first decode step after it, with the restore's arrays in
buffers of their own or cut from shared ones (``fill.OWN_BUFFER_MIN_BYTES``).

    .venv/bin/python -m tools.bench.first_step [--shape llama8b|qwen0.5b] [--tokens 2048]
        [--repetitions 7]

MLX writes into an array in place only when no other array shares its buffer: a
cache's first step after a restore copies an array cut from a shared buffer whole to
write one token into its room. This saves a synthetic KV of P1's shape into an LMDB
store, then restores it over and over in this process, each way in turn (``shared``:
every array in the loader's shared buffers; ``own``: each in its own), and times the
restore (to what attention reads, evaluated) and the first and second one-token steps
of every layer. Prints each way's median of restore + first step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from kvstore.bench.workloads import WORKLOADS, SyntheticKV, attended_arrays, first_step
from kvstore.caches import KVCache
from kvstore.codecs import fill
from kvstore.store import open_store

#: Each way's threshold for a buffer of an array's own.
WAYS = {"shared": 1 << 62, "own": 1}


def _timed(step: Callable[[list[Any]], None], caches: list[Any]) -> float:
    """``step`` of ``caches`` (one token through every layer's cache); its milliseconds."""
    start = time.perf_counter()
    step(caches)
    return 1e3 * (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["llama8b", "qwen0.5b"], default="llama8b")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repetitions", type=int, default=7)
    args = parser.parse_args(argv)
    kv = SyntheticKV(WORKLOADS[args.shape], args.tokens)
    step = first_step(kv)
    tokens = list(range(args.tokens + 1))
    samples: dict[str, list[tuple[float, float, float]]] = {way: [] for way in WAYS}
    previous = fill.OWN_BUFFER_MIN_BYTES
    with tempfile.TemporaryDirectory(prefix="first-step-") as folder:
        with open_store(f"lmdb://{folder}/s", map_size=1 << 34, touch_interval=0) as store:
            caches = kv.ours()
            layers = len(caches)
            store.save("ns", tokens[:-1], caches)
            store.flush()
            del caches
            try:
                for i in range(args.repetitions + 1):  # the first warms up
                    for way, threshold in WAYS.items():
                        fill.OWN_BUFFER_MIN_BYTES = threshold
                        match = store.lookup("ns", tokens)
                        start = time.perf_counter()
                        restored = store.restore(match, [KVCache() for _ in range(layers)])
                        mx.eval(attended_arrays(restored))
                        restore_ms = 1e3 * (time.perf_counter() - start)
                        first, second = _timed(step, restored), _timed(step, restored)
                        if i:
                            samples[way].append((restore_ms, first, second))
                        del restored
            finally:
                fill.OWN_BUFFER_MIN_BYTES = previous
    print(f"{args.shape} {args.tokens} tokens, median of {args.repetitions} (ms):")
    for way, runs in samples.items():
        runs.sort(key=lambda r: r[0] + r[1])
        restore_ms, first, second = runs[len(runs) // 2]
        print(
            f"  {way:6} restore {restore_ms:7.2f} + first step {first:7.2f} = "
            f"{restore_ms + first:7.2f}  (second step {second:.2f}; all: "
            + " ".join(f"{r + f:.1f}" for r, f, _ in runs)
            + ")"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
