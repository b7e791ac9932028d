"""A fresh process's first restore on the CPU, against its later ones: what fresh memory costs.

A new session reloads a prompt once, into memory its process has never touched: each
page of the caches' arrays is faulted in as the restore writes it (on the CI microVMs
at 1.4-2 GB/s; ``kvstore bench``'s machine line). ``kvstore bench``'s P1 repeats its
restores in one process, so it sees only the later ones. This saves a llama-8B-shaped
KV (``--shape``, ``--tokens``) into a fresh LMDB store once, then runs ``--processes``
fresh processes for each setting of ``KVSTORE_HUGE_PAGES`` in turn (``1``: the loader's
buffers advised 2 MiB pages, :func:`kvstore.codecs.host_memory.advise_huge_pages`; ``0``:
not), each timing ``--restores`` restores of the whole prefix, and prints each process's
times and the medians of the first and of the rest::

    .venv/bin/python tools/bench/first_restore.py --tokens 2048 --processes 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

#: What one fresh process runs: restores of the stored prefix, each time printed in ms.
_CHILD = """
import sys, time
import mlx.core as mx
from kvstore.bench.workloads import WORKLOADS
from kvstore.caches import KVCache
from kvstore.store import open_store
url, shape, tokens, restores = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
layers = WORKLOADS[shape].layers
with open_store(url, readonly=True) as store:
    for _ in range(restores):
        match = store.lookup("ns", list(range(tokens + 1)))
        start = time.perf_counter()
        caches = store.restore(match, [KVCache() for _ in range(layers)])
        mx.eval([c.keys for c in caches])
        print(1e3 * (time.perf_counter() - start))
        del caches
"""


def _save(url: str, shape: str, tokens: int) -> None:
    from kvstore.bench.workloads import WORKLOADS, SyntheticKV
    from kvstore.store import open_store

    kv = SyntheticKV(WORKLOADS[shape], tokens)
    with open_store(url, map_size=1 << 34, touch_interval=0) as store:
        store.save("ns", list(range(tokens)), kv.ours())
        store.flush()


def _process(url: str, args: argparse.Namespace, huge: str) -> list[float]:
    env = {**os.environ, "KVSTORE_HUGE_PAGES": huge}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    argv = [url, args.shape, str(args.tokens), str(args.restores)]
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *argv], env=env, capture_output=True, text=True, check=True
    )
    return [float(line) for line in done.stdout.split()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["llama8b", "qwen0.5b"], default="llama8b")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--processes", type=int, default=5, help="fresh processes per setting")
    parser.add_argument("--restores", type=int, default=3, help="restores per process")
    args = parser.parse_args(argv)
    url = f"lmdb://{tempfile.mkdtemp(prefix='first-restore-')}/s"
    _save(url, args.shape, args.tokens)
    seen: dict[str, list[list[float]]] = {"1": [], "0": []}
    for _ in range(args.processes):
        for huge in seen:  # in turn: the machine's drift falls on both alike
            times = _process(url, args, huge)
            seen[huge].append(times)
            shown = " ".join(f"{t:.1f}" for t in times)
            print(f"KVSTORE_HUGE_PAGES={huge}: {shown} ms", flush=True)
            time.sleep(0.5)
    print(f"{args.tokens} tokens of {args.shape}, {args.processes} fresh processes each:")
    for huge, runs in seen.items():
        first = statistics.median(run[0] for run in runs)
        rest = statistics.median(t for run in runs for t in run[1:]) if args.restores > 1 else 0
        print(f"  KVSTORE_HUGE_PAGES={huge}: first restore {first:.1f} ms, later ones {rest:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
