"""What reading LMDB values through the checked cursor costs (issue 18, damage 2).

    .venv/bin/python tools/damage/guard_cost.py [--repeats 7] [--out tools/damage/results]

Before issue 18 a view's ``get`` was python-lmdb's ``txn.get`` and a scan
iterated the cursor with values; now each value's node is checked first
(:mod:`kvstore.store.engines.lmdb_guard`). Both run here on the same
environment, interleaved, in one process: ``get`` of index-sized values (96 B),
of block-sized records (64 KiB and 1 MiB, overflow pages) and a scan of 4096
index-sized entries, each in a fresh read transaction. The figure is guarded /
unguarded, median of ``--repeats``; above 1 is what the checks cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: (label, value bytes, keys read per transaction)
GETS = (("get 96 B", 96, 4096), ("get 64 KiB", 64 << 10, 256), ("get 1 MiB", 1 << 20, 32))
SCAN = 4096


def _keys(label: str, n: int) -> list[bytes]:
    return [f"kvstore/v1/{label}/{i:08d}".encode() for i in range(n)]


def _fill(backend: Any) -> None:
    items = []
    for label, size, n in GETS:
        items += [(k, bytes([i % 251]) * size) for i, k in enumerate(_keys(label, n))]
    backend.put_many(items)


def _timed(fn: Callable[[], int]) -> float:
    t0 = time.perf_counter()
    touched = fn()
    assert touched > 0
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from kvstore.store import open_backend

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        backend = open_backend(f"lmdb://{tmp}/store")
        try:
            _fill(backend)
            env = backend._env  # the same environment, read without the checks

            def guarded_get(keys: list[bytes]) -> Callable[[], int]:
                def run() -> int:
                    with backend.reader() as view:
                        return sum(len(memoryview(view.get(k))) for k in keys)

                return run

            def plain_get(keys: list[bytes]) -> Callable[[], int]:
                def run() -> int:
                    with env.begin(buffers=True) as txn:
                        return sum(len(txn.get(k)) for k in keys)

                return run

            prefix = b"kvstore/v1/get 96 B/"

            def guarded_scan() -> int:
                with backend.reader() as view:
                    return sum(len(memoryview(v)) for _, v in view.scan(prefix))

            def plain_scan() -> int:
                with env.begin(buffers=True) as txn:
                    cursor = txn.cursor()
                    cursor.set_range(prefix)
                    total = 0
                    for key, value in cursor:
                        if not bytes(key).startswith(prefix):
                            break
                        total += len(value)
                    return total

            cases = [
                (label, guarded_get(_keys(label, n)), plain_get(_keys(label, n)))
                for label, _, n in GETS
            ]
            cases.append((f"scan {SCAN} x 96 B", guarded_scan, plain_scan))
            for label, guarded, plain in cases:
                guarded(), plain()  # warm: pages in the page cache, code paths hot
                samples = [(_timed(guarded), _timed(plain)) for _ in range(args.repeats)]
                g = statistics.median(s[0] for s in samples)
                p = statistics.median(s[1] for s in samples)
                rows.append({"case": label, "guarded_s": g, "plain_s": p, "ratio": g / p})
        finally:
            backend.close()
    lines = [f"{'case':<20} {'guarded':>10} {'txn.get':>10} {'ratio':>7}"]
    for r in rows:
        lines.append(
            f"{r['case']:<20} {r['guarded_s'] * 1e3:8.2f}ms {r['plain_s'] * 1e3:8.2f}ms "
            f"{r['ratio']:7.2f}"
        )
    lines.append(f"(median of {args.repeats}, interleaved; ratio = guarded / unguarded)")
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "guard-cost.json").write_text(json.dumps(rows, indent=2) + "\n")
        (args.out / "guard-cost.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
