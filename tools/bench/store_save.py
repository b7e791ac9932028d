"""Save bookkeeping cost: a new 2048-token prefix, a re-save of it (dedup), and a plain file write.

    .venv/bin/python tools/bench/store_save.py [--dir /tmp/kvbench-save]

With opaque records of the real size of a 256-token block (``qwen0.5b``
3 MiB, ``llama8b`` 32 MiB), measured side by side, median of the rounds:

* ``new``: ``put_blocks`` of a prefix not stored yet, committed durably
  (LMDB ``sync=True``), records already encoded;
* ``dedup``: ``put_blocks`` of the same prefix again (hashing and a read
  transaction: nothing is encoded or written);
* ``file``: writing the same bytes to one file and ``fsync`` -- what a
  single-file save such as mlx-lm's ``save_prompt_cache`` cannot do faster.

These are the store's shares of P2 (save vs ``save_prompt_cache``, bar >= 1x)
and P3 (dedup re-save, bar >= 20x); the codecs' encode time comes on top of
``new`` and is not part of ``dedup``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_common import (  # noqa: E402
    interleaved,
    median_ms,
    per_workload,
    print_table,
    write_results,
)
from store_read import WORKLOADS  # noqa: E402

from kvstore.store import open_store  # noqa: E402

NS = "bench"
TOKENS = 2048


def measure(name: str, per_token: int, root: Path, rounds: int, rng) -> tuple[list, dict]:
    """Time a new save, a dedup re-save and a plain file write of ``name``'s records."""
    records = [rng.bytes(256 * per_token) for _ in range(TOKENS // 256)]
    total = sum(map(len, records))
    store = open_store(f"lmdb://{root / name}", map_size=(rounds + 4) * total, touch_interval=0)
    stored = rng.integers(0, 150_000, TOKENS, dtype=np.uint32)
    store.put_blocks(NS, stored, lambda spans: records[: len(spans)])

    def new() -> None:
        tokens = rng.integers(0, 150_000, TOKENS, dtype=np.uint32)
        result = store.put_blocks(NS, tokens, lambda spans: records[: len(spans)])
        assert len(result.written) == len(records)

    def dedup() -> None:
        assert store.put_blocks(NS, stored, lambda spans: 1 / 0).deduplicated == len(records)

    def write_file() -> None:
        with open(root / "cache.bin", "wb") as f:
            for r in records:
                f.write(r)
            f.flush()
            os.fsync(f.fileno())

    samples = interleaved({"file": write_file, "new": new, "dedup": dedup}, rounds)
    store.close()
    t_file = median_ms(samples["file"])
    rows = []
    for case in ("new", "dedup", "file"):
        t = median_ms(samples[case])
        rows.append([name, case, f"{total >> 20}", f"{t:.2f}", f"{t_file / t:.2f}"])
    return rows, {"bytes": total, "samples_s": samples}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/kvstore-bench-save")
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rows, results = per_workload(measure, WORKLOADS, root, args.rounds)
    new_ratio = [float(r[4]) for r in rows if r[1] == "new"]
    dedup_speedup = [
        median_ms(results[n]["samples_s"]["new"]) / median_ms(results[n]["samples_s"]["dedup"])
        for n in WORKLOADS
    ]
    print_table(
        f"Saving a {TOKENS}-token prefix (8 blocks, records pre-encoded), LMDB sync=True",
        ["workload", "path", "MiB", "median ms", "x file write"],
        rows,
        f"save: new {min(new_ratio):.2f}-{max(new_ratio):.2f}x of a file write+fsync; dedup "
        f"re-save {min(dedup_speedup):.0f}-{max(dedup_speedup):.0f}x faster than a new save",
    )
    write_results("store_save", results)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
