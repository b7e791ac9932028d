"""Raw read throughput of a stored 2048-token prefix against the memcpy limit.

    .venv/bin/python tools/bench/store_read.py [--dir /tmp/kvbench-read]

For each workload shape (records of the real size of a 256-token block:
``qwen0.5b`` 3 MiB, ``llama8b`` 32 MiB, bf16), a 2048-token prompt is stored
(8 blocks of opaque random bytes) in an LMDB store. Measured side by side,
interleaved, median of the rounds:

* ``store``: ``lookup`` + ``read`` (zero-copy views, no verification) + one
  ``numpy.copyto`` of each view into an already-touched destination, i.e.
  every byte leaves the store once, as a restore needs;
* ``store+xxh3``: the same with an xxh3-64 checksum verified on every record
  (what a codec's ``verify`` costs on top);
* ``lmdb``: python-lmdb alone (one read transaction, ``get`` and the same
  copies): the engine's floor, to separate store overhead from mmap reads;
* ``memcpy``: ``numpy.copyto`` of a touched buffer of the same total size
  into the same destination: the physical limit.

The figure is ``memcpy time / store time`` (fraction of memcpy speed); P1's
bar for a full restore is >= 40% of memcpy.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_common import (  # noqa: E402
    interleaved,
    median_ms,
    per_workload,
    print_table,
    write_results,
)

from kvstore.errors import CorruptEntryError  # noqa: E402
from kvstore.store import open_store  # noqa: E402

NS = "bench"
TOKENS = 2048
MiB = 1 << 20
#: bytes per token, bf16 K and V over all layers (BENCHMARKS.md workloads)
WORKLOADS = {"qwen0.5b": 12 * 1024, "llama8b": 128 * 1024}


def checksummed(payload: bytes) -> bytes:
    return xxhash.xxh3_64_digest(payload) + payload


def verify_xxh3(view: memoryview) -> None:
    if xxhash.xxh3_64_digest(view[8:]) != view[:8]:
        raise CorruptEntryError("[bench] checksum mismatch")


def measure(name: str, per_token: int, root: Path, rounds: int, rng) -> tuple[list, dict]:
    """Store one 2048-token prefix of ``name``'s block size; time the three paths."""
    block = 256 * per_token
    tokens = rng.integers(0, 150_000, TOKENS + 1, dtype=np.uint32)
    records = [checksummed(rng.bytes(block)) for _ in range(TOKENS // 256)]
    url = f"lmdb://{root / name}"
    with open_store(url, map_size=2 * len(records) * block) as store:
        store.put_blocks(NS, tokens[:TOKENS], lambda spans: records[: len(spans)])
    total = sum(len(r) for r in records)
    dst = np.ones(total, dtype=np.uint8)
    src = np.ones(total, dtype=np.uint8)

    def restore(store) -> None:
        match = store.lookup(NS, tokens)
        assert match.tokens == TOKENS
        with store.read(match.blocks) as views:
            at = 0
            for v in views:
                n = len(v)
                np.copyto(dst[at : at + n], np.frombuffer(v, dtype=np.uint8))
                at += n
        assert at == total

    raw = open_store(url, touch_interval=0)
    checked = open_store(url, verify=verify_xxh3, touch_interval=0)
    keys = [b.key for b in raw.lookup(NS, tokens).blocks]
    env = raw.backend.environment  # the engine alone, same mapping

    def engine() -> None:
        with env.begin(buffers=True) as txn:
            at = 0
            for key in keys:
                v = txn.get(key)
                np.copyto(dst[at : at + len(v)], np.frombuffer(v, dtype=np.uint8))
                at += len(v)

    samples = interleaved(
        {
            "memcpy": lambda: np.copyto(dst, src),
            "lmdb": engine,
            "store": lambda: restore(raw),
            "store+xxh3": lambda: restore(checked),
        },
        rounds,
        warmup=2,
    )
    raw.close()
    checked.close()
    rows = []
    for case in ("store", "store+xxh3", "lmdb", "memcpy"):
        t = median_ms(samples[case])
        mib = total / MiB
        rows.append(
            [
                name,
                case,
                f"{mib:.0f}",
                f"{t:.2f}",
                f"{mib / t * 1e3:.0f}",
                f"{median_ms(samples['memcpy']) / t:.2f}",
            ]
        )
    return rows, {"bytes": total, "samples_s": samples}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--dir", default="/tmp/kvstore-bench-read")
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    rows, results = per_workload(measure, WORKLOADS, root, args.rounds)
    ratios = [float(r[5]) for r in rows if r[1] == "store"]
    print_table(
        f"Raw read of a {TOKENS}-token prefix (8 blocks) from LMDB vs numpy.copyto",
        ["workload", "path", "MiB", "median ms", "MiB/s", "x memcpy"],
        rows,
        f"store read: {min(ratios):.2f}-{max(ratios):.2f}x of memcpy speed without checksum "
        f"(P1's bar for a whole restore: >= 0.40x)",
    )
    write_results("store_read", results)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
