"""P3's re-save of a stored prompt, timed in the bench's cold conditions, alone.

    .venv/bin/python tools/bench/resave_cold.py [--shape qwen0.5b] [--tokens 512]
        [--repeats 41] [--no-fsync] [--parts]

``kvstore bench --only P3`` times a re-save right after its peer, mlx-lm's
``save_prompt_cache`` of the same cache (and that save fsynced), with
``gc.collect(1)`` before each call: the re-save then runs in caches the peer's
write has emptied, and its 7 repetitions move by 20% from run to run. This puts
the same conditions before every one of ``--repeats`` re-saves and prints the
median, so an A/B of the dedup path (run it at each revision, alternating) says
something in a minute. ``--parts`` also times the steps of ``store.save`` one by
one, each under the same conditions; more code then runs between two calls of a
step, so every figure reads colder than alone (``store.save`` itself ~1.6x): compare
the steps with each other.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

NAMESPACE = "resave-cold"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen0.5b", help="a kvstore bench workload")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--no-fsync", action="store_true", help="the peer's save unsynced")
    parser.add_argument("--parts", action="store_true", help="also each step of the save")
    args = parser.parse_args()

    import numpy as np
    from mlx_lm.models.cache import save_prompt_cache

    from kvstore.bench.workloads import WORKLOADS, SyntheticKV
    from kvstore.store import open_store

    kv = SyntheticKV(WORKLOADS[args.shape], args.tokens)
    caches, peer = kv.ours(), kv.mlx_lm()
    ids = np.random.default_rng(args.tokens).integers(0, 150_000, args.tokens, dtype=np.uint32)
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVSTORE_BENCH_SCRATCH")) as scratch:
        peer_file = Path(scratch) / "peer.safetensors"

        def cold() -> None:
            """What the bench does before a re-save: the peer's save, then a collection."""
            save_prompt_cache(str(peer_file), peer)
            if not args.no_fsync:
                fd = os.open(peer_file, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            gc.collect(1)

        store = open_store(f"lmdb://{Path(scratch) / 'store'}", touch_interval=0)

        def resave() -> None:
            if store.save(NAMESPACE, ids, caches).written:
                raise AssertionError("a re-save wrote blocks")

        try:
            store.save(NAMESPACE, ids, caches)
            steps: dict[str, Callable[[], Any]] = {"store.save": resave}
            if args.parts:
                steps.update(parts(store, ids, caches))
            took: dict[str, list[float]] = {name: [] for name in steps}
            for _ in range(args.repeats):
                for name, step in steps.items():
                    cold()
                    start = time.perf_counter_ns()
                    step()
                    took[name].append((time.perf_counter_ns() - start) / 1e3)
                    peer_file.unlink()  # as the bench's peer case removes its file: untimed
        finally:
            store.close()

    peer_kind = "unsynced" if args.no_fsync else "fsynced"
    print(f"{kv.label}, after the peer's {peer_kind} save, median of {args.repeats}:")
    for name, times in took.items():
        print(f"  {name}: {statistics.median(times):.1f} us")
    return 0


def parts(store: Any, ids: Any, caches: Any) -> dict[str, Callable[[], Any]]:
    """The steps of a re-save that ``store.save`` runs, each alone."""
    from kvstore.store import keys as K
    from kvstore.store.blocks import saving
    from kvstore.store.kv.save import BlockEncoder, check_caches

    toks = K.as_tokens(ids, "save")
    ns = K.parse_namespace(NAMESPACE)
    policy = store.settings.storage_policy
    return {
        "as_tokens": lambda: K.as_tokens(ids, "save"),
        "check_caches": lambda: check_caches(toks, caches),
        "BlockEncoder (signatures)": lambda: BlockEncoder(caches, policy, {}, len(toks)),
        "stored_already (hashing, one read)": lambda: saving.stored_already(
            store.backend.reader, ns, saving.block_digests(ns, toks, store.settings.block_size)
        ),
    }


if __name__ == "__main__":
    raise SystemExit(main())
