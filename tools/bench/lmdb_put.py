"""LMDB's side of a durable save, alone: put + commit of save-sized values, three ways.

A save of a 4096-token llama-8B-shaped block set is a few dozen values of
~4 MiB in one transaction. This times, with python-lmdb directly (kvstore's
store not used), ``put`` and ``commit`` (``sync=True``) of such values:

* ``plain``: a new environment opened as kvstore opens it (no writemap);
* ``after delete``: the same, each save after deleting the previous one
  (what G3's and P2's repetitions do: the pages come from LMDB's freelist);
* ``, behind``: those two with kvstore's writeback pump running during the commit
  (:mod:`kvstore.store.engines.writeback`, as a large commit of the store runs);
* ``writemap``: ``writemap=True`` (puts write into the mapped file; no
  write-out copy at commit);
* ``value file``: the layout issue 13 names if LMDB's copy is the limit -- the values
  ``pwrite``-n once into a file of their own (into the space the last save's values
  took, or appended), its writeback started behind, ``fdatasync``-ed, and then a
  synced LMDB commit of small index entries (key -> offset, length); "put" is the
  writes, "commit" the syncs and the index::

    .venv/bin/python tools/bench/lmdb_put.py --values 32 --mib 4

Issue 13's G3 note quotes it; the times are this machine's.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import lmdb
import numpy as np

from kvstore.store.engines.writeback import writeback_for

_libc = ctypes.CDLL(None, use_errno=True)


def run(
    values: list[bytes], repeats: int, *, writemap: bool, delete: bool, behind: bool = False
) -> list[float]:
    path = tempfile.mkdtemp(prefix="lmdb-put-")
    env = lmdb.open(path, map_size=1 << 34, sync=True, metasync=True, writemap=writemap)
    # kvstore's own pump (the commits LMDBBackend makes), not a copy of it.
    pump = writeback_for(Path(path) / "data.mdb") if behind else None
    puts, commits = [], []
    try:
        for rep in range(repeats):
            if delete and rep:
                with env.begin(write=True) as txn:
                    for i in range(len(values)):
                        txn.delete(b"%d-%d" % (rep - 1, i))
            start = time.perf_counter()
            txn = env.begin(write=True)
            for i, value in enumerate(values):
                txn.put(b"%d-%d" % (rep, i), value)
            put = time.perf_counter()
            with pump.during() if pump is not None else nullcontext():
                txn.commit()
            puts.append(put - start)
            commits.append(time.perf_counter() - put)
    finally:
        if pump is not None:
            pump.close()
        env.close()
        shutil.rmtree(path, ignore_errors=True)
    return [statistics.median(puts), statistics.median(commits)]


def run_value_file(values: list[bytes], repeats: int, *, reuse: bool) -> list[float]:
    """The values written once into a file beside the index, then the index committed."""
    path = tempfile.mkdtemp(prefix="value-file-")
    env = lmdb.open(path, map_size=1 << 30, sync=True, metasync=True)
    fd = os.open(os.path.join(path, "values"), os.O_RDWR | os.O_CREAT, 0o644)
    writes, syncs = [], []
    end = 0
    try:
        for rep in range(repeats):
            at = 0 if reuse else end
            start = time.perf_counter()
            index = []
            for i, value in enumerate(values):
                os.pwrite(fd, value, at)
                _libc.sync_file_range(fd, ctypes.c_int64(at), ctypes.c_int64(len(value)), 2)
                index.append((b"%d-%d" % (rep, i), b"%d:%d" % (at, len(value))))
                at += len(value)
            end = max(end, at)
            written = time.perf_counter()
            os.fdatasync(fd)
            with env.begin(write=True) as txn:
                for key, where in index:
                    txn.put(key, where)
            writes.append(written - start)
            syncs.append(time.perf_counter() - written)
    finally:
        os.close(fd)
        env.close()
        shutil.rmtree(path, ignore_errors=True)
    return [statistics.median(writes), statistics.median(syncs)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=32)
    parser.add_argument("--mib", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    values = [rng.bytes((args.mib << 20) + 4096 * i) for i in range(args.values)]
    print(f"{args.values} values of ~{args.mib} MiB, sync=True, medians of {args.repeats}")
    for label, writemap, delete, behind in (
        ("plain", False, False, False),
        ("plain, behind", False, False, True),
        ("after delete", False, True, False),
        ("delete, behind", False, True, True),
        ("writemap", True, False, False),
    ):
        put, commit = run(values, args.repeats, writemap=writemap, delete=delete, behind=behind)
        _line(label, put, commit)
    for label, reuse in (("value file", True), ("value file, +", False)):
        _line(label, *run_value_file(values, args.repeats, reuse=reuse))
    return 0


def _line(label: str, put: float, commit: float) -> None:
    total = 1e3 * (put + commit)
    print(f"{label:<14} put {1e3 * put:7.0f} ms  commit {1e3 * commit:7.0f} ms  {total:7.0f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
