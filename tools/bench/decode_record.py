"""Figure: decoding a 512 MiB llama8b-shaped record into MLX arrays, against memcpy.

One record holds 32 layers of bf16 keys and values ``[1, 8, 4096, 128]``
(4096 tokens x 128 KiB = 512 MiB). Each repetition, interleaved, times:

* ``copyto``: ``numpy.copyto`` of the payload into an already-touched buffer
  of the same size (the memcpy limit);
* ``decode_to_mlx``: :func:`kvstore.codecs.decode_record_to_mlx` -- header
  checks, payload checksum (on a second thread) and one copy into MLX
  memory, every tensor evaluated;
* ``decode+snapshot_to_mlx``: :func:`decode_record` (checksum, numpy views)
  then :func:`snapshot_to_mlx` per layer (one copy per tensor);
* ``decode_views``: :func:`decode_record` alone (checksum, no copy).

The figure is ``copyto / decode_to_mlx``, the median of the per-repetition
ratios (higher is better; 1.0 = memcpy speed). MLX's buffer cache decides whether decoded
arrays land in memory already touched: ``warm`` raises its limit above the
record size (a long-running process reusing freed cache memory, like the
touched numpy buffer), ``cold`` keeps MLX's default limit (every decode page-
faults fresh memory). Both are reported; BENCHMARKS.md asks for the first.

    .venv/bin/python tools/bench/decode_record.py [--repeats 7] [--json bench-results.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from kvstore.abc.codec import Snapshot
from kvstore.codecs import decode_record, decode_record_to_mlx, encode_record, snapshot_to_mlx
from kvstore.codecs.arrays import BFLOAT16_WORDS

LAYERS, HEADS, HEAD_DIM, TOKENS = 32, 8, 128, 4096


def llama8b_record(seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    shape = (1, HEADS, TOKENS, HEAD_DIM)
    layers = []
    for _ in range(LAYERS):
        words = {
            n: rng.integers(0, 1 << 16, shape, dtype=np.uint16).view(BFLOAT16_WORDS)
            for n in ("keys", "values")
        }
        layers.append(
            Snapshot("kv:plain", 0, TOKENS, words, {"dtype": "bfloat16", "offset": TOKENS})
        )
    return encode_record(layers, meta={"workload": "llama8b", "tokens": TOKENS})


def timed(fn: Callable[[], object]) -> float:
    gc.collect()
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    del result
    return elapsed


def run(record: bytes, repeats: int) -> dict[str, list[float]]:
    payload = np.frombuffer(record, dtype=np.uint8)[
        -decode_record(record, verify=False).header.payload_nbytes :
    ]
    target = np.empty_like(payload)
    np.copyto(target, payload)  # touch every page once

    def to_mlx_per_layer() -> list[Snapshot]:
        return [snapshot_to_mlx(s) for s in decode_record(record).layers if s is not None]

    cases: dict[str, Callable[[], object]] = {
        "copyto": lambda: np.copyto(target, payload),
        "decode_to_mlx": lambda: decode_record_to_mlx(record),
        "decode+snapshot_to_mlx": to_mlx_per_layer,
        "decode_views": lambda: decode_record(record),
    }
    for fn in cases.values():  # one untimed round: imports, first allocations
        timed(fn)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            samples[name].append(timed(fn))
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed repetitions (>= 5)")
    parser.add_argument("--json", type=Path, default=None, help="merge raw samples into this file")
    args = parser.parse_args(argv)
    if args.repeats < 5:
        parser.error("--repeats must be at least 5 (the figure is a median of >= 5)")
    record = llama8b_record()
    mib = len(record) / (1 << 20)
    default_limit = mx.set_cache_limit(0)
    results = {}
    for mode, limit in (("warm", 4 * len(record)), ("cold", default_limit)):
        mx.set_cache_limit(limit)
        mx.clear_cache()
        results[mode] = run(record, args.repeats)
    mx.set_cache_limit(default_limit)

    shape = f"[1, {HEADS}, {TOKENS}, {HEAD_DIM}]"
    print(f"record: {mib:.0f} MiB, {LAYERS} layers x keys/values {shape} bf16")
    print(f"{'mode':<6} {'case':<24} {'median ms':>10} {'GB/s':>7} {'vs copyto':>10}")
    summary = {}
    for mode, samples in results.items():
        base = statistics.median(samples["copyto"])
        for name, times in samples.items():
            med = statistics.median(times)
            rate = len(record) / med / 1e9
            print(f"{mode:<6} {name:<24} {med * 1e3:>10.1f} {rate:>7.2f} {base / med:>10.2f}")
        # Each repetition's own ratio: load that drifts between repetitions cancels out.
        paired = [c / d for c, d in zip(samples["copyto"], samples["decode_to_mlx"], strict=True)]
        summary[mode] = statistics.median(paired)
    print(
        f"decode_record_to_mlx, {mib:.0f} MiB llama8b record: {summary['warm']:.2f}x numpy.copyto "
        f"with a warm MLX buffer cache, {summary['cold']:.2f}x cold "
        f"(median of {args.repeats} paired repetitions)"
    )
    if args.json is not None:
        existing = json.loads(args.json.read_text()) if args.json.exists() else {}
        existing["decode_record"] = {
            "record_bytes": len(record),
            "repeats": args.repeats,
            "samples_s": results,
            "ratio_vs_copyto": summary,
        }
        args.json.write_text(json.dumps(existing, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
