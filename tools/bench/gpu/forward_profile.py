"""What the one-token forward after a restore costs, against the same forward over caches
the model filled itself (issue 13: G1's warm TTFT is restore + this forward).

    python3 tools/bench/gpu/forward_profile.py [--tokens 4096] [--repeats 5] [--policy P]

Builds the llama-8B-shaped model (bf16, seeded), fills caches of ``tokens - 1`` rows
(``update_and_fetch`` of random rows, as a prefill leaves them), saves them to an LMDB
store and restores them. Then times the forward of the last prompt token in each case:
right after ``mx.clear_cache()`` (as a fresh session meets it) and again with MLX's
buffer cache warm; the graph's build (the model call) apart from its evaluation. Also
prints each case's cache class, its keys' shape (capacity included) and dtype, and its
offset. Medians of ``repeats``, in ms.

Which of the restored arrays or the process after a restore makes the difference: the
restored caches with their arrays copied on the default stream (each ``+ 0``, the
restored ones dropped), and the model's own caches made right after a restore. Each
case also prints the build's CPU time on its thread (under its wall time: it waited for
the GIL), the forward's peak memory over what was in use before it (a cache update that
cannot reuse its buffer copies the whole array: ~512 MiB at 4096 tokens), and the
threads alive when it started. ``--policy`` stores with a storage policy.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import threading
import time
from typing import Any

import mlx.core as mx
import numpy as np

from kvstore.bench.figures.gpu_common import LLAMA8B, TINY, build
from kvstore.codecs import cuda_pages
from kvstore.store import open_store


def native(model: Any, cfg: dict[str, Any], rows: int, seed: int = 0) -> list[Any]:
    """Caches the model makes, filled with ``rows`` random rows each."""
    caches = model.make_cache()
    dtype = model.model.embed_tokens.weight.dtype
    shape = (1, cfg["num_key_value_heads"], rows, cfg["head_dim"])
    key = mx.random.key(seed)
    for cache in caches:
        k1, k2, key = mx.random.split(key, 3)
        cache.update_and_fetch(
            mx.random.normal(shape, key=k1).astype(dtype),
            mx.random.normal(shape, key=k2).astype(dtype),
        )
    mx.eval([c.keys for c in caches] + [c.values for c in caches])
    return caches


def forward(model: Any, token: mx.array, caches: list[Any]) -> tuple[float, float, float, int]:
    """(graph build, its CPU time, evaluation) of one token's forward over ``caches``,
    seconds, and the bytes its peak added to those in use before it."""
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    start, cpu = time.perf_counter(), time.thread_time()
    logits = model(token, caches)[:, -1]
    built, cpu = time.perf_counter(), time.thread_time() - cpu
    mx.eval(logits)
    return built - start, cpu, time.perf_counter() - built, mx.get_peak_memory() - before


def copied(caches: list[Any]) -> list[Any]:
    """``caches`` with each array replaced by a copy made on the default stream."""
    for cache in caches:
        cache.keys, cache.values = cache.keys + 0, cache.values + 0
    mx.eval([c.keys for c in caches] + [c.values for c in caches])
    return caches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="the CPU stand-in (a smoke run)")
    parser.add_argument("--policy", default=None, help="a storage policy (default: lossless)")
    args = parser.parse_args(argv)
    cfg = TINY if args.tiny else LLAMA8B
    model = build(dict(cfg))
    rows = args.tokens - 1
    token = mx.array(np.array([[7]], np.int32))
    filled = native(model, cfg, rows)
    mx.eval(model(token, native(model, cfg, rows, 1)))  # kernels compiled
    url = f"lmdb://{tempfile.mkdtemp(prefix='fwd-')}/s"
    prompt = list(range(args.tokens))
    options: dict[str, Any] = {"storage_policy": args.policy} if args.policy else {}
    store = open_store(url, map_size=4 << 30, **options)
    store.save("ns", prompt[:rows], filled)
    store.flush()
    match = store.lookup("ns", prompt)
    print(f"restored rows {match.tokens} of {args.tokens}")

    def restored() -> list[Any]:
        caches = store.restore(match, model.make_cache())
        mx.eval([c.keys for c in caches] + [c.values for c in caches])
        return caches

    def restored_settled() -> list[Any]:
        caches = restored()
        cuda_pages.settle()  # the restore's pages let go (on a staging thread) first
        return caches

    def native_after_restore() -> list[Any]:
        restored()
        return native(model, cfg, rows, 2)

    cases = {
        "model's own caches": lambda: native(model, cfg, rows, 2),
        "restored caches": restored,
        "restored caches, pages let go first": restored_settled,
        "restored caches, arrays copied": lambda: copied(restored()),
        "model's own caches, made after a restore": native_after_restore,
    }
    for name, make in cases.items():
        sample = make()
        c = sample[0]
        print(f"{name}: {type(c).__name__} keys {c.keys.shape} {c.keys.dtype} offset {c.offset}")
        del sample
        for fresh in (True, False):
            builds, cpus, evals, peaks, threads = [], [], [], [], []
            for _ in range(args.repeats):
                caches = make()
                gc.collect()
                if fresh:
                    mx.clear_cache()
                threads.append(threading.active_count())
                b, c, e, p = forward(model, token, caches)
                builds.append(b)
                cpus.append(c)
                evals.append(e)
                peaks.append(p)
                del caches
            label = "after clear_cache" if fresh else "buffer cache warm"
            print(
                f"  forward, {label}: build {1e3 * statistics.median(builds):.2f} ms "
                f"(CPU {1e3 * statistics.median(cpus):.2f}), "
                f"eval {1e3 * statistics.median(evals):.2f} ms, "
                f"peak +{statistics.median(peaks) / 2**20:.0f} MiB, threads {max(threads)} "
                f"(all: {[round(1e3 * (b + e), 1) for b, e in zip(builds, evals, strict=True)]})"
            )
    store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
