"""P4 (lookup latency) and P10 (open time) on an LMDB store holding >= 100k blocks.

    .venv/bin/python tools/bench/store_lookup.py [--blocks 100000] [--dir /tmp/kvbench]

P4: median latency of ``store.lookup`` for prompts of 1k, 8k and 32k tokens
that are stored whole (chain walk, child search, recency touch), with the
store holding ``--blocks`` other blocks; also a cold miss, and the 32k case
with a Python list instead of an integer array. Bar: <= 2 ms at 32k tokens,
linear in blocks walked, not in blocks stored.

P10: ``open_store`` + ``close`` of the big store against the same for a store
of 10 blocks, interleaved. Bar: <= 2x (no scan on open).

Filler blocks carry 4 KiB records: like every record above LMDB's page half
they live on overflow pages, so the B-tree a lookup walks has the same shape
as with 3 MiB or 32 MiB records; only disk use differs.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_common import fill_store, interleaved, median_ms, print_table, write_results  # noqa: E402

from kvstore.store import open_store  # noqa: E402

NS = "bench"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--dir", default="/tmp/kvstore-bench-lookup")
    ap.add_argument("--keep", action="store_true", help="reuse a store left by a previous run")
    args = ap.parse_args()
    root = Path(args.dir)
    big, small = root / "big", root / "small"
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng(1)
    prompts = {n: rng.integers(0, 150_000, n, dtype=np.uint32) for n in (1024, 8192, 32768)}

    with open_store(f"lmdb://{big}", sync=False, touch_interval=0) as store:
        if store.stats().blocks < args.blocks:
            print(f"filling {big} with {args.blocks} blocks ...", flush=True)
            fill_store(store, NS, args.blocks, 128, bytes(4096), seed=2)
            for tokens in prompts.values():
                store.put_blocks(NS, tokens, lambda spans: [bytes(4096)] * len(spans))
        stored = store.stats().blocks
    with open_store(f"lmdb://{small}", sync=False) as store:
        if store.stats().blocks < 10:
            fill_store(store, NS, 10, 10, bytes(4096), seed=3)

    # P4: lookups, interleaved across prompt lengths. The default background
    # recency writer runs as in production; the lookups never wait for it.
    cold = rng.integers(0, 150_000, 32768, dtype=np.uint32)
    as_list = prompts[32768].tolist()
    with open_store(f"lmdb://{big}") as store:
        for n, tokens in prompts.items():
            assert store.lookup(NS, tokens).tokens == n - 1
        cases = {f"{n // 1024}k": (lambda t=t: store.lookup(NS, t)) for n, t in prompts.items()}
        cases["32k list"] = lambda: store.lookup(NS, as_list)
        cases["32k cold"] = lambda: store.lookup(NS, cold)
        lookups = interleaved(cases, args.rounds, warmup=5)

    # P10: open + close, big store against small store.
    opens = interleaved(
        {
            "100k": lambda: open_store(f"lmdb://{big}").close(),
            "10": lambda: open_store(f"lmdb://{small}").close(),
        },
        rounds=max(9, args.rounds // 10),
        warmup=2,
    )

    rows = [
        [name, f"{median_ms(s):.3f}", f"{1e3 * np.percentile(s, 90):.3f}"]
        for name, s in lookups.items()
    ]
    p4 = median_ms(lookups["32k"])
    print_table(
        f"P4 lookup latency, store of {stored} blocks (block 256, LMDB)",
        ["prompt", "median ms", "p90 ms"],
        rows,
        f"P4: 32k-token lookup {p4:.3f} ms median (bar <= 2 ms): {'met' if p4 <= 2 else 'NOT met'}",
    )
    ratio = statistics_ratio(opens["100k"], opens["10"])
    print_table(
        "P10 open time",
        ["store", "median ms"],
        [[f"{k} blocks", f"{median_ms(v):.3f}"] for k, v in opens.items()],
        f"P10: open with {stored} blocks / open with 10 blocks = {ratio:.2f}x (bar <= 2x): "
        f"{'met' if ratio <= 2 else 'NOT met'}",
    )
    write_results(
        "P4",
        {
            "stored_blocks": stored,
            "median_ms": {k: median_ms(v) for k, v in lookups.items()},
            "samples_s": lookups,
        },
    )
    write_results("P10", {"stored_blocks": stored, "ratio": ratio, "samples_s": opens})
    return 0


def statistics_ratio(a: list[float], b: list[float]) -> float:
    return float(np.median(a) / np.median(b))


if __name__ == "__main__":
    sys.exit(main())
