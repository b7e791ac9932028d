"""What MLX's loader costs an array it allocates, from a Python stream and from a file.

    .venv/bin/python -m tools.bench.loader_cost [--arrays 64] [--bytes 4194304] [--repetitions 30]

A CPU restore gets arrays with buffers of their own (``fill.OWN_BUFFER_MIN_BYTES``)
from MLX's safetensors loader reading :class:`kvstore.codecs.fill.LeafStream`, which
writes nothing: MLX has no uninitialised allocation (``mx.empty`` is ``mx.zeros``).
Each array is one ``Load`` that MLX runs on its four I/O threads, each of which takes the
GIL to call the stream's ``seek`` and ``readinto``. This times ``--arrays`` such arrays
of ``--bytes`` each (``mx.load`` and their evaluation) against the same arrays loaded
from a safetensors file by path (MLX's own reader, no Python, the bytes copied from the
page cache): with small arrays (``--bytes 4096``, where that copy is nothing) the
difference per array is what the Python hand-offs cost.

Prints the median of each in ms, and per array in us.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from kvstore.codecs.fill import LeafStream
from kvstore.codecs.host_memory import keep_freed_memory


def _timed(load: Callable[[], dict[str, mx.array]], repetitions: int) -> float:
    times = []
    for _ in range(repetitions + 1):  # the first warms up
        start = time.perf_counter()
        arrays = load()
        mx.eval(list(arrays.values()))
        times.append(time.perf_counter() - start)
        del arrays
    return statistics.median(times[1:]) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arrays", type=int, default=64)
    parser.add_argument("--bytes", type=int, default=4 << 20)
    parser.add_argument("--repetitions", type=int, default=30)
    args = parser.parse_args(argv)
    keep_freed_memory()  # as a restore does: freed buffers come back from the heap
    specs = [((args.bytes,), "uint8")] * args.arrays
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "arrays.safetensors"
        zeros = {str(i): mx.zeros(args.bytes, mx.uint8) for i in range(args.arrays)}
        mx.save_safetensors(str(path), zeros)
        del zeros
        cases = {
            "python stream (LeafStream)": lambda: mx.load(LeafStream(specs), format="safetensors"),
            "file by path": lambda: mx.load(str(path)),
        }
        for name, load in cases.items():
            ms = _timed(load, args.repetitions)  # type: ignore[arg-type]
            print(f"{name:28} {ms:7.2f} ms  {ms * 1e3 / args.arrays:6.1f} us an array")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
