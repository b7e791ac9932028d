"""A durable save's two halves one after the other, and overlapped: what pipelining pays.

A save writes every record it stores (a copy into the writer's arena and an xxh3 over
it, on a pool of threads; on a CUDA GPU the download then the hash), and only then
opens LMDB's write transaction to put them all and commit (a write and an fdatasync).
On an H100 the two halves of a 4096-token llama-8B save took 59-61 ms and 67-81 ms,
one after the other (``tools/bench/results/gpu/savestall-h100/``). This times, with
numpy, xxhash and python-lmdb directly (kvstore's store not used), ``--records``
values of ``--mib`` MiB each:

* ``sequential``: every record written (two at a time on a pool), then the
  transaction's puts and its commit, as kvstore saves today;
* ``pipelined``: the records written on another thread, two at a time, each put as it
  arrives, the same one commit::

    .venv/bin/python tools/bench/save_pipeline.py --records 8 --mib 32

Each line: one repetition of both, alternating. The times are this machine's.
"""

from __future__ import annotations

import argparse
import queue
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import lmdb
import numpy as np
import xxhash


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=8)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    n, size = args.records, args.mib << 20
    sources = [np.random.default_rng(i).integers(0, 255, size, dtype=np.uint8) for i in range(n)]
    arena = np.ones(n * size, np.uint8)  # touched: the writer's arena is reused
    pool = ThreadPoolExecutor(2)

    def write(i: int) -> memoryview:
        record = arena[i * size : (i + 1) * size]
        np.copyto(record, sources[i])
        view = memoryview(record)  # type: ignore[arg-type]
        xxhash.xxh3_64_intdigest(view)
        return view

    def save(pipelined: bool) -> float:
        path = tempfile.mkdtemp(prefix="save-pipeline-")
        env = lmdb.open(path, map_size=4 * n * size, sync=True)
        try:
            start = time.perf_counter()
            if pipelined:
                ready: queue.Queue[memoryview] = queue.Queue()

                def produce() -> None:
                    for first in range(0, n, 2):
                        for record in pool.map(write, range(first, min(n, first + 2))):
                            ready.put(record)

                producer = threading.Thread(target=produce)
                producer.start()
                with env.begin(write=True) as txn:
                    for i in range(n):
                        txn.put(b"%d" % i, ready.get())
                producer.join()
            else:
                records = list(pool.map(write, range(n)))
                with env.begin(write=True) as txn:
                    for i, record in enumerate(records):
                        txn.put(b"%d" % i, record)
            return time.perf_counter() - start
        finally:
            env.close()
            shutil.rmtree(path, ignore_errors=True)

    print(f"{n} records of {args.mib} MiB, put and committed (fdatasync) in one transaction")
    for _ in range(args.repeats):
        sequential, pipelined = save(False), save(True)
        print(
            f"  sequential {sequential * 1e3:.0f} ms, pipelined {pipelined * 1e3:.0f} ms: "
            f"{sequential / pipelined:.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
