"""What a verified restore of N MiB cannot go under on this machine's CPU.

P1 compares a restore (the records copied from LMDB's pages into the caches' arrays on
every core, each record's xxh3 checked) with mlx-lm's ``load_prompt_cache`` (MLX's
``pread``s into its arrays, nothing checked). This probe times the parts a restore
cannot skip, on the same kind of memory: a file's pages mapped (as LMDB's are, in the
page cache) copied into an already-touched buffer on one thread and on two, xxh3 of the
mapped bytes, xxh3 of bytes just copied (in the cache, as a restore hashes them), and a
copy into fresh memory for scale. Nothing in the library is used::

    python3 tools/bench/copy_floor.py --mib 100 256

On the CI VM (2026-12-06), 100 MiB: copy 14.7 ms on one thread, 8.2 on two, xxh3 8.9
on one, copy then xxh3 per MiB on two threads **10.2 ms**, where a qwen0.5b 8192-token
restore (100 MiB) took 18.8-22.7 ms (its copy and checks 13.2-13.6, headers 2.7-4.3,
allocation 0.9-1.2) and mlx-lm's load 11.8; 256 MiB (a llama-8B 2048-token restore):
copy then xxh3 31.4 ms against the restore's 38-40 and mlx-lm's 25.8.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np
import xxhash


def _median_ms(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _on_two(work: Callable[[slice], None], nbytes: int) -> None:
    half = slice(0, nbytes // 2)
    other = threading.Thread(target=work, args=(half,))
    other.start()
    work(slice(nbytes // 2, nbytes))
    other.join()


def probe(mib: int, directory: str, repeats: int) -> list[tuple[str, float]]:
    nbytes = mib << 20
    with tempfile.NamedTemporaryFile(dir=directory) as f:
        f.write(os.urandom(nbytes))
        f.flush()
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        src = np.frombuffer(mapped, np.uint8)
        dst = np.ones(nbytes, np.uint8)
        chunk = 1 << 20

        def copy(part: slice) -> None:
            dst[part] = src[part]

        def copy_then_hash(part: slice) -> None:  # a restore's order: each MiB hashed hot
            hasher = xxhash.xxh3_64()
            for at in range(part.start, part.stop, chunk):
                piece = slice(at, min(at + chunk, part.stop))
                dst[piece] = src[piece]
                hasher.update(memoryview(dst[piece]))

        def fresh() -> None:
            out = np.empty(nbytes, np.uint8)
            out[:] = src

        rows = [
            ("copy, one thread", _median_ms(lambda: copy(slice(0, nbytes)), repeats)),
            ("copy, two threads", _median_ms(lambda: _on_two(copy, nbytes), repeats)),
            (
                "xxh3 of the mapped bytes, one thread",
                _median_ms(lambda: xxhash.xxh3_64(memoryview(mapped)).intdigest(), repeats),
            ),
            (
                "copy then xxh3 per MiB, two threads",
                _median_ms(lambda: _on_two(copy_then_hash, nbytes), repeats),
            ),
            ("copy into fresh memory, one thread", _median_ms(fresh, repeats)),
        ]
    return rows  # the mapping goes with its last view


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[100])
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    for mib in args.mib:
        print(f"{mib} MiB")
        for name, ms in probe(mib, args.dir, args.repeats):
            print(f"  {name:40s} {ms:7.1f} ms  {(mib << 20) / ms / 1e6:6.2f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
