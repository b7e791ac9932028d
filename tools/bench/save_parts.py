"""A durable save's records written whole after their checksums, or in parts as written.

    python3 tools/bench/save_parts.py [--dir /work] [--mib 32] [--records 2 8 32]
        [--part-mib 4] [--repeats 9]

What a save of ``--records`` records of ``--mib`` MiB each does to its disk, with numpy,
xxhash and ``os`` alone (kvstore's store not used): each record copied into an arena
and hashed on a pool of two threads, then

* ``whole``: written by the committing thread as each is done (``pwrite``, its
  writeback started), then one ``fdatasync``: the value file's writes before
  :mod:`kvstore.abc.placement`;
* ``whole on the pool``: the same ``pwrite`` by the pool thread that hashed it;
* ``in parts``: every ``--part-mib`` MiB copied, hashed and written at once by the
  pool thread, its writeback started, so the disk starts on a record's first part
  while the rest is still being copied (a placed record's way);
* ``no copy, no checksum``: each source written as it is by a pool thread, its
  writeback started, then the ``fdatasync``: the floor of any durable save of these
  bytes on this disk (what the copies and checksums cost is the distance to it);
* ``not synced``: the same without the ``fdatasync`` (writeback still started): about
  what an unsynced save (mlx-lm's ``save_prompt_cache``) can take at best.

The file is written over in place (as the value file reuses a deleted save's space),
and removed at the end. Prints each way's median in ms and its repetitions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from kvstore.store.engines import writeback


def probe(directory: str, mib: int, records: int, part_mib: int, repeats: int) -> None:
    n, part = mib << 20, part_mib << 20
    sources = [np.random.default_rng(i).integers(0, 255, n, np.uint8) for i in range(records)]
    arena = np.ones(n * records, np.uint8)
    fd, path = tempfile.mkstemp(dir=directory, prefix="save-parts-")
    pool = ThreadPoolExecutor(2)
    try:
        os.pwrite(fd, arena.data, 0)
        os.fsync(fd)

        def write(data: np.ndarray, at: int) -> None:
            view = memoryview(data)  # type: ignore[arg-type]
            done = 0
            while done < view.nbytes:
                done += os.pwrite(fd, view[done:], at + done)
            writeback.start(fd, at, view.nbytes)

        def encoded(i: int) -> np.ndarray:
            record = arena[i * n : (i + 1) * n]
            np.copyto(record, sources[i])
            xxhash.xxh3_64_intdigest(record.data)
            return record

        def whole() -> None:
            futures = [pool.submit(encoded, i) for i in range(records)]
            for i, future in enumerate(futures):
                write(future.result(), i * n)
            os.fdatasync(fd)

        def whole_on_the_pool() -> None:
            def one(i: int) -> None:
                write(encoded(i), i * n)

            for future in [pool.submit(one, i) for i in range(records)]:
                future.result()
            os.fdatasync(fd)

        def in_parts() -> None:
            def one(i: int) -> None:
                record, hasher = arena[i * n : (i + 1) * n], xxhash.xxh3_64()
                for at in range(0, n, part):
                    np.copyto(record[at : at + part], sources[i][at : at + part])
                    hasher.update(record[at : at + part].data)
                    write(record[at : at + part], i * n + at)
                hasher.intdigest()

            for future in [pool.submit(one, i) for i in range(records)]:
                future.result()
            os.fdatasync(fd)

        def straight(synced: bool) -> Callable[[], None]:
            def run() -> None:
                futures = [pool.submit(write, sources[i], i * n) for i in range(records)]
                for future in futures:
                    future.result()
                if synced:
                    os.fdatasync(fd)

            return run

        ways: list[tuple[str, Callable[[], None]]] = [
            ("whole", whole),
            ("whole on the pool", whole_on_the_pool),
            (f"in parts of {part_mib} MiB", in_parts),
            ("no copy, no checksum", straight(True)),
            ("not synced", straight(False)),
        ]
        times: dict[str, list[float]] = {name: [] for name, _ in ways}
        for _ in range(repeats + 1):  # the first round warms up
            for name, way in ways:
                start = time.perf_counter()
                way()
                times[name].append(time.perf_counter() - start)
        print(f"{records} records of {mib} MiB into {directory}")
        for name, spent in times.items():
            kept = spent[1:]
            print(
                f"  {name:<24} {1e3 * statistics.median(kept):7.1f} ms  "
                f"({', '.join(f'{1e3 * t:.0f}' for t in kept)})"
            )
    finally:
        pool.shutdown()
        os.close(fd)
        os.unlink(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=".")
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--records", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--part-mib", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    for records in args.records:
        probe(args.dir, args.mib, records, args.part_mib, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
