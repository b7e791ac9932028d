"""How a restore's arrays are best made on the CPU, by size: the three ways compared.

    .venv/bin/python -m tools.bench.fill_paths [--repetitions 15]

For a few restore shapes (qwen-0.5B, llama-8B and gemma's arrays at several lengths),
each array written from its row pieces by ``write_rows``, as a restore writes them:

* ``copied``: each array written into a host buffer and copied once into MLX's memory
  (:func:`kvstore.codecs.fill.filled_arrays` under ``DIRECT_MIN_BYTES``);
* ``loader``: allocated uninitialised by MLX's safetensors loader, then written on every
  core (``filled_arrays`` at or over it);
* ``zeros``: ``mx.zeros`` and a writable view of each, then written one after another
  (the small restores' way before the copied one);
* ``zeros on every core``: the zeros made on this thread's CPU streams (a core each),
  then written on every core as the loader's are.

Prints the median of each, in ms; the fastest of two rounds taken in turn.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from kvstore.codecs.arrays import numpy_dtype, owned_arrays, owned_views, word_dtype
from kvstore.codecs.copies import each_on_threads
from kvstore.codecs.fill import Fill, LeafSpec, filled_arrays
from kvstore.codecs.host_memory import keep_freed_memory
from kvstore.codecs.plans import write_rows
from kvstore.cpu_streams import cpu_streams

#: (arrays, heads, tokens, head_dim, pieces an array is written from)
CASES = (
    (48, 2, 512, 64, 2),
    (48, 2, 2048, 64, 8),
    (48, 2, 8192, 64, 32),
    (64, 8, 512, 128, 2),
    (64, 8, 2048, 128, 8),
    (52, 4, 1024, 256, 4),
    (52, 4, 4096, 256, 16),
    (64, 8, 4096, 128, 16),
)


def zeros(specs: list[LeafSpec], fill: Fill) -> list[Any]:
    arrays = []
    for i, (array, view) in enumerate(owned_arrays(specs)):
        fill(i, view.view(numpy_dtype(specs[i][1])))
        arrays.append(array)
    return arrays


def zeros_on_every_core(specs: list[LeafSpec], fill: Fill) -> list[Any]:
    streams = cpu_streams()
    words = [
        mx.zeros(shape, word_dtype(name), stream=streams[i % len(streams)])
        for i, (shape, name) in enumerate(specs)
    ]
    owned = owned_views(words, specs)
    each_on_threads(len(specs), lambda i: fill(i, owned[i][1].view(numpy_dtype(specs[i][1]))))
    return [array for array, _ in owned]


def timed(make: Callable[[], list[Any]], repetitions: int) -> float:
    times = []
    for _ in range(repetitions + 3):  # the first three warm up
        start = time.perf_counter()
        made = make()
        times.append(time.perf_counter() - start)
        del made
    return 1e3 * statistics.median(times[3:])


def compared(count: int, heads: int, tokens: int, dim: int, parts: int, repetitions: int) -> str:
    """One case's line: each way's best median, in ms."""
    shape = (1, heads, tokens, dim)
    rng = np.random.default_rng(tokens)
    words = [
        rng.integers(0, 1 << 16, (1, heads, tokens // parts, dim), dtype=np.uint16)
        for _ in range(parts)
    ]
    pieces = [w.view(numpy_dtype("bfloat16")) for w in words]
    specs: list[LeafSpec] = [(shape, "bfloat16")] * count

    def fill(_: int, target: np.ndarray) -> None:
        write_rows(pieces, target)

    ways: dict[str, Callable[[], list[Any]]] = {
        "copied": lambda: filled_arrays(specs, fill, direct=False),
        "loader": lambda: filled_arrays(specs, fill, direct=True),
        "zeros": lambda: zeros(specs, fill),
        "zeros on every core": lambda: zeros_on_every_core(specs, fill),
    }
    best: dict[str, float] = {}
    for _ in range(2):
        for name, make in ways.items():
            ms = timed(make, repetitions)
            best[name] = min(best.get(name, ms), ms)
    mib = count * int(np.prod(shape)) * 2 / (1 << 20)
    return f"{count} arrays of {shape} ({mib:.0f} MiB): " + "  ".join(
        f"{name} {ms:.2f}" for name, ms in best.items()
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=15)
    args = parser.parse_args(argv)
    keep_freed_memory()  # as a restore does
    for case in CASES:
        print(compared(*case, args.repetitions))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
