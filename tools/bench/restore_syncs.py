"""Count the MLX evaluations and host syncs of one store restore, per storage policy.

Every ``mx.eval`` and ``mx.array.item`` is a round trip to MLX's stream (on a
GPU, a wait for every kernel queued before it), so a restore that does one
per layer pays the latency of the device as many times. This script saves a
llama-8B-shaped KV (fewer layers by default, so it runs in seconds on a CPU)
into an LMDB store under each storage policy, restores it ``--repeats``
times, and prints per policy: the median restore time, the stored MiB and
the evaluations and ``.item()`` calls one restore made (counted by wrapping
both for the timed calls only; nothing in the library is changed)::

    .venv/bin/python tools/bench/restore_syncs.py --layers 8 --tokens 2048

The counts are the evidence for issue 13's lossy-restore fixes; the times
are this machine's and only compare policies within one run.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

from kvstore.bench.workloads import KVShape, SyntheticKV
from kvstore.caches import KVCache
from kvstore.store import open_store

POLICIES = ("lossless", "kv:quant:8:64", "kv:quant:4:64", "kv:turboquant:4:4")


@contextmanager
def counting() -> Iterator[Counter[str]]:
    """Count ``mx.eval`` and ``mx.array.item`` calls made inside the block."""
    counts: Counter[str] = Counter()
    real_eval: Callable[..., Any] = mx.eval
    real_item: Callable[..., Any] = mx.array.item

    def count(what: str) -> None:
        caller = sys._getframe(2)
        counts[what] += 1
        where = caller.f_code.co_filename.split("kvstore/")[-1]
        counts[f"  {what} at {where}:{caller.f_lineno}"] += 1

    def eval_(*args: Any) -> Any:
        count("eval")
        return real_eval(*args)

    def item(self: mx.array) -> Any:
        count("item")
        return real_item(self)

    mx.eval, mx.array.item = eval_, item  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        mx.eval, mx.array.item = real_eval, real_item  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--where", action="store_true", help="print where the calls are made")
    args = parser.parse_args()

    kv = SyntheticKV(KVShape("llama8b", layers=args.layers, kv_heads=8, head_dim=128), args.tokens)
    caches = kv.ours()
    tokens = list(range(args.tokens + 1))
    scratch = tempfile.mkdtemp(prefix="restore-syncs-")
    print(f"{args.layers} layers x {args.tokens} tokens, llama-8B KV heads/head_dim, bf16")
    print(f"{'policy':<20} {'restore ms':>11} {'stored MiB':>11} {'evals':>6} {'items':>6}")
    try:
        for policy in args.policies.split(","):
            options: dict[str, Any] = {"map_size": 1 << 32, "touch_interval": 0}
            if policy != "lossless":
                options["storage_policy"] = policy
            url = f"lmdb://{scratch}/{policy.replace(':', '-')}"
            with open_store(url, **options) as store:
                store.save("ns", tokens[:-1], caches)
                store.flush()
                stored = store.stats().bytes / 2**20
                store.restore(store.lookup("ns", tokens), [KVCache() for _ in caches])  # warm
                times, counts = [], Counter[str]()  # the last restore's counts are printed
                for _ in range(args.repeats):
                    with counting() as counted:
                        start = time.perf_counter()
                        restored = store.restore(
                            store.lookup("ns", tokens), [KVCache() for _ in caches]
                        )
                        mx.eval([c.keys for c in restored])
                        times.append(time.perf_counter() - start)
                    counts = counted
                    assert restored[0].offset == args.tokens
                    del restored
            ms = 1e3 * statistics.median(times)
            evals, items = counts["eval"], counts["item"]
            print(f"{policy:<20} {ms:>11.1f} {stored:>11.1f} {evals:>6} {items:>6}")
            if args.where:
                for site, n in sorted(counts.items()):
                    if site.startswith(" "):
                        print(f"{site} x{n}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
