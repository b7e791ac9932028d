"""Migrate a store of real records and report size, error, time and memory.

Builds (once) an LMDB store of the ``small`` model's float16 KV in 256-token
blocks -- one prompt's block records reused under ``--prompts`` random token
chains, so the store can be large without prefilling it all -- then runs
``kvstore.store.maintenance.migrate.migrate`` into each target family and prints, per
target: bytes before -> after, the measured relative MSE of K and V (layer
mean), seconds, and peak anonymous memory against the store size (sampled
after every block from /proc; LMDB's file-backed pages are page cache and
reported apart).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python -m tools.bench.migrate_store --prompts 80 --dir /tmp/migrate-figure
"""

from __future__ import annotations

import argparse
import re
import shutil
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from kvstore.codecs.record import verify_record
from kvstore.model import build_model
from kvstore.store import open_store
from kvstore.store.maintenance.migrate import migrate
from tests.test_cli.stores import block_records

TARGETS = ("kv:quant:8:64", "kv:quant:4:64", "kv:turboquant:4:4", "kv:turboquant:3:3")


def rss_mib() -> dict[str, int]:
    status = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"{k}:\s+(\d+)", status)[1]) // 1024 for k in ("RssAnon", "RssFile")}


def build(path: Path, prompts: int) -> None:
    model = build_model("small", seed=0, dtype=mx.float16)
    rng = np.random.default_rng(0)
    records = block_records(model, rng.integers(0, 256, 1100).tolist(), 256)
    with open_store(f"lmdb://{path}", block_size=256, verify=verify_record) as store:
        for _ in range(prompts):
            tokens = rng.integers(0, 256, 1100).tolist()
            store.put_blocks(
                "figure", tokens, lambda spans: [records[(s.start, s.stop)] for s in spans]
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=80, help="token chains (5 blocks each)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/migrate-figure"))
    args = parser.parse_args()
    src = args.dir / f"src-{args.prompts}"
    if not (src / "data.mdb").exists():
        build(src, args.prompts)
    for target in TARGETS:
        dst = args.dir / "dst"
        shutil.rmtree(dst, ignore_errors=True)
        peak = {"RssAnon": 0, "RssFile": 0}

        def sample(blocks: int, nbytes: int, peak: dict[str, int] = peak) -> None:
            for k, v in rss_mib().items():
                peak[k] = max(peak[k], v)

        start = time.perf_counter()
        report = migrate(str(src), str(dst), to=target, progress=sample)
        seconds = time.perf_counter() - start
        keys = np.mean([e.mean_keys for e in report.errors])
        values = np.mean([e.mean_values for e in report.errors])
        print(
            f"{target:<20} {report.bytes_before / 2**20:7.1f} MiB -> "
            f"{report.bytes_after / 2**20:6.1f} MiB ({report.ratio:.3f}x)  "
            f"rel MSE K {keys:.2e} V {values:.2e}  {seconds:5.1f} s  "
            f"peak anon {peak['RssAnon']} MiB, file-backed {peak['RssFile']} MiB"
        )


if __name__ == "__main__":
    main()
