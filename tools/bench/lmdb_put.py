"""LMDB's side of a durable save, alone: put + commit of save-sized values, three ways.

A save of a 4096-token llama-8B-shaped block set is a few dozen values of
~4 MiB in one transaction. This times, with python-lmdb directly (no
kvstore), ``put`` and ``commit`` (``sync=True``) of such values:

* ``plain``: a new environment opened as kvstore opens it (no writemap);
* ``after delete``: the same, each save after deleting the previous one
  (what G3's and P2's repetitions do: the pages come from LMDB's freelist);
* ``writemap``: ``writemap=True`` (puts write into the mapped file; no
  write-out copy at commit)::

    .venv/bin/python tools/bench/lmdb_put.py --values 32 --mib 4

Issue 13's G3 note quotes it; the times are this machine's.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import lmdb
import numpy as np


def run(values: list[bytes], repeats: int, *, writemap: bool, delete: bool) -> list[float]:
    path = tempfile.mkdtemp(prefix="lmdb-put-")
    env = lmdb.open(path, map_size=1 << 34, sync=True, metasync=True, writemap=writemap)
    puts, commits = [], []
    try:
        for rep in range(repeats):
            if delete and rep:
                with env.begin(write=True) as txn:
                    for i in range(len(values)):
                        txn.delete(b"%d-%d" % (rep - 1, i))
            start = time.perf_counter()
            with env.begin(write=True) as txn:
                for i, value in enumerate(values):
                    txn.put(b"%d-%d" % (rep, i), value)
                put = time.perf_counter()
            puts.append(put - start)
            commits.append(time.perf_counter() - put)
    finally:
        env.close()
        shutil.rmtree(path, ignore_errors=True)
    return [statistics.median(puts), statistics.median(commits)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=32)
    parser.add_argument("--mib", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    values = [rng.bytes((args.mib << 20) + 4096 * i) for i in range(args.values)]
    print(f"{args.values} values of ~{args.mib} MiB, sync=True, medians of {args.repeats}")
    for label, writemap, delete in (
        ("plain", False, False),
        ("after delete", False, True),
        ("writemap", True, False),
    ):
        put, commit = run(values, args.repeats, writemap=writemap, delete=delete)
        total = 1e3 * (put + commit)
        print(
            f"{label:<14} put {1e3 * put:7.0f} ms  commit {1e3 * commit:7.0f} ms  {total:7.0f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
