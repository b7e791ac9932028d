"""A store kept to a byte budget under churn: how large its value file grows against it.

    python3 tools/bench/budget_churn.py [--dir /work] [--workload qwen0.5b]
        [--budget-mib 300] [--saves 600] [--min-tokens 300] [--max-tokens 2000]

Saves ``--saves`` prompts of random lengths (random tokens: nothing is shared, so every
save over the budget evicts) of a synthetic KV of ``--workload``'s shape into a new
LMDB store with ``max_bytes`` ``--budget-mib``, and prints, every tenth of the way,
the value file's size, the bytes the store holds, its free extents and their bytes,
and LMDB's own file (the index and the small values).
What a user sees on disk is the file; a budget that holds must keep it near the
budget, flat once eviction begins. The store is removed at the end.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstore.bench.workloads import synthetic_kv
from kvstore.store import open_store

MiB = 1 << 20


def churn(directory: str, workload: str, budget_mib: int, saves: int, lo: int, hi: int) -> None:
    folder = Path(tempfile.mkdtemp(dir=directory, prefix="budget-churn-"))
    rng = np.random.default_rng(0)
    caches: dict[int, list] = {}  # by length rounded up to 64 tokens: built once each
    try:
        store = open_store(
            f"lmdb://{folder / 's'}",
            map_size=16 << 30,
            touch_interval=0,
            max_bytes=budget_mib * MiB,
        )
        print(f"{workload}, budget {budget_mib} MiB, {saves} saves of {lo}-{hi} tokens")
        with store:
            started = time.perf_counter()
            for i in range(1, saves + 1):
                tokens = int(rng.integers(lo, hi + 1))
                rounded = -(-tokens // 64) * 64
                if rounded not in caches:
                    caches[rounded] = synthetic_kv(workload, rounded).ours()
                prompt = rng.integers(0, 150_000, tokens, dtype=np.uint32)
                store.save("churn", prompt, caches[rounded])
                if i % max(saves // 10, 1) == 0 or i == saves:
                    report(store, i, time.perf_counter() - started)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def report(store, saves: int, seconds: float) -> None:
    stats = store.stats()
    engine = stats.backend  # LMDB's figures: its own file (the index), the value file's
    print(
        f"  {saves:5d} saves  file {engine['value_file_bytes'] / MiB:8.1f} MiB  "
        f"held {stats.bytes / MiB:7.1f} MiB  "
        f"free {engine['value_file_free_bytes'] / MiB:7.1f} MiB in "
        f"{engine['value_file_free_extents']:3d} extents  "
        f"LMDB {engine['file_bytes'] / MiB:6.1f} MiB  ({seconds:.0f} s)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=".")
    parser.add_argument("--workload", default="qwen0.5b")
    parser.add_argument("--budget-mib", type=int, default=300)
    parser.add_argument("--saves", type=int, default=600)
    parser.add_argument("--min-tokens", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=2000)
    args = parser.parse_args()
    churn(args.dir, args.workload, args.budget_mib, args.saves, args.min_tokens, args.max_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
