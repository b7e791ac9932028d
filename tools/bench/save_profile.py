"""Where a durable save's time goes: encode and checksum, LMDB's copy, the commit and fsync.

A llama-8B-shaped KV (fewer layers by default) is saved ``--repeats`` times
into a fresh LMDB store, each time as a new prefix, under cProfile (the
caller's thread: the record threads' work shows as the wait for them).
Printed per policy: the median save, mlx-lm's ``save_prompt_cache`` of the
same caches in the same run (the G3 peer, not synced), and the profile's
shares of the save: building the records (snapshot, policy encode, copy into
the arena, xxh3 -- ``write_records``), LMDB's ``put`` (its copy into the
transaction's pages) and ``commit`` (the write-out and, with ``sync``, the
fsync). Nothing in the library is changed::

    .venv/bin/python tools/bench/save_profile.py --layers 8 --tokens 4096

The shares are what issue 13's G3 note rests on; the times are this machine's.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvstore.bench.workloads import KVShape, SyntheticKV
from kvstore.store import open_store

#: Profile rows to report: label -> substrings of pstats' function key.
PARTS = {
    "records (snapshot, encode, copy, xxh3)": ("write_records",),
    "policy encode": ("apply_policy",),
    "lmdb put (copy into its pages)": ("'put' of 'Transaction'",),
    "lmdb commit (write-out + fsync)": ("'commit' of 'Transaction'",),
}


def _cumulative(stats: pstats.Stats, needles: tuple[str, ...]) -> float:
    total = 0.0
    for (file, line, name), row in stats.stats.items():  # type: ignore[attr-defined]
        key = f"{file}:{line}({name})"
        if any(n in key for n in needles):
            total += row[3]
    return total


def _model_caches(layers: int, tokens: int) -> tuple[list[Any], list[Any]]:
    """G3's caches: a seeded model's prefill, and mlx-lm caches copied from them."""
    import mlx.core as mx
    import numpy as np

    from kvstore.bench.figures.gpu_common import LLAMA8B, build, prefill
    from kvstore.bench.figures.gpu_save import _mlx_lm_caches

    config = dict(LLAMA8B, num_hidden_layers=layers, intermediate_size=1024, vocab_size=4096)
    model = build(config)
    prompt = np.random.default_rng(0).integers(0, 4096, (1, tokens)).astype(np.int32)
    caches = model.make_cache()
    prefill(model, mx.array(prompt), caches)
    return caches, _mlx_lm_caches(caches, tokens)


def _time_phases() -> dict[str, list[float]]:
    """Wrap the save's phases in wall clocks (this tool's process only): per save, the
    records' encode, the sum of LMDB's puts, and the commit."""
    from kvstore.store.blocks import saving
    from kvstore.store.engines import lmdb as engine

    spent: dict[str, list[float]] = {"encode (D2H, hash)": [], "lmdb puts": [], "commit": []}
    puts = [0.0]
    encode, put, commit = saving.encode_missing, engine._LMDBView.put, engine.LMDBBackend._commit

    def timed_encode(*a: Any, **k: Any) -> None:
        start = time.perf_counter()
        try:
            encode(*a, **k)
        finally:
            spent["encode (D2H, hash)"].append(time.perf_counter() - start)

    def counted_put(self: Any, key: bytes, value: Any, **k: Any) -> bool:
        start = time.perf_counter()
        try:
            return put(self, key, value, **k)
        finally:
            puts[0] += time.perf_counter() - start

    def timed_commit(self: Any, txn: Any, size_hint: int) -> None:
        put_s, puts[0] = puts[0], 0.0
        if size_hint < 1 << 20:  # a delete's or the recency's commit, not a save's
            return commit(self, txn, size_hint)
        spent["lmdb puts"].append(put_s)
        start = time.perf_counter()
        try:
            return commit(self, txn, size_hint)
        finally:
            spent["commit"].append(time.perf_counter() - start)

    saving.encode_missing = timed_encode  # type: ignore[assignment]
    engine._LMDBView.put = counted_put  # type: ignore[method-assign]
    engine.LMDBBackend._commit = timed_commit  # type: ignore[method-assign]
    return spent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policies", default="lossless,kv:quant:8:64")
    parser.add_argument("--durability", default="sync")
    parser.add_argument("--top", type=int, default=0, help="also print the top N functions")
    parser.add_argument(
        "--behind",
        action="store_true",
        help="save_behind + flush (the writer thread; the profile then shows the wait only)",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="delete the last save first (its pages are reused, as in P2 and G3)",
    )
    parser.add_argument(
        "--with-peer",
        action="store_true",
        help="mlx-lm's save of the same caches before each of ours, unlinked only after it "
        "(G3's order: its unsynced pages are still in the page cache)",
    )
    parser.add_argument(
        "--model-caches",
        action="store_true",
        help="the caches a llama-8B-shaped model's prefill leaves (its MLP and vocabulary "
        "small), and G3's peer caches made from them, instead of synthetic ones",
    )
    parser.add_argument("--sort", default="cumulative", help="--top's order (pstats' keys)")
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also the wall time of each save's phases, on whichever thread runs them: "
        "encoding the records, LMDB's puts, its commit",
    )
    args = parser.parse_args()
    phases = _time_phases() if args.phases else None

    from mlx_lm.models.cache import save_prompt_cache

    if args.model_caches:
        caches, peer_caches = _model_caches(args.layers, args.tokens)
    else:
        kv = SyntheticKV(
            KVShape("llama8b", layers=args.layers, kv_heads=8, head_dim=128), args.tokens
        )
        caches, peer_caches = kv.ours(), kv.mlx_lm()
    scratch = Path(tempfile.mkdtemp(prefix="save-profile-"))
    mib = 2 * args.layers * 8 * 128 * 2 * args.tokens / 2**20
    print(f"{args.layers} layers x {args.tokens} tokens ({mib:.0f} MiB bf16), {args.durability}")
    try:
        peer = []
        for i in range(args.repeats):
            start = time.perf_counter()
            save_prompt_cache(str(scratch / f"peer-{i}.safetensors"), peer_caches)
            peer.append(time.perf_counter() - start)
            (scratch / f"peer-{i}.safetensors").unlink()
        print(f"mlx-lm save_prompt_cache (not synced): {1e3 * statistics.median(peer):.0f} ms")
        for policy in args.policies.split(","):
            options: dict[str, Any] = {"map_size": 1 << 34, "durability": args.durability}
            if policy != "lossless":
                options["storage_policy"] = policy
            url = f"lmdb://{scratch / policy.replace(':', '-')}"
            with open_store(url, **options) as store:
                store.save("warm", list(range(256)), caches)
                for spent in (phases or {}).values():
                    spent.clear()
                profile, times = cProfile.Profile(), []
                for i in range(args.repeats):
                    tokens = [i + 1] + [0] * (args.tokens - 1)  # a new prefix each time
                    if args.reuse:
                        store.delete("ns")
                        store.flush()
                    if args.with_peer:
                        (scratch / "peer.safetensors").unlink(missing_ok=True)
                        save_prompt_cache(str(scratch / "peer.safetensors"), peer_caches)
                    start = time.perf_counter()
                    profile.enable()
                    if args.behind:
                        store.save_behind("ns", tokens, caches)
                        store.flush()
                    else:
                        store.save("ns", tokens, caches)
                    profile.disable()
                    times.append(time.perf_counter() - start)
                    if phases is not None:  # this save's sums (a retried save commits twice)
                        for spent in phases.values():
                            spent[:] = [*spent[:i], sum(spent[i:])]
            stats = pstats.Stats(profile)
            if args.top:
                stats.sort_stats(args.sort).print_stats(args.top)
            total = sum(times)
            med = statistics.median(times)
            ratio = statistics.median(peer) / med
            how = ("behind" if args.behind else "save") + (", reusing pages" if args.reuse else "")
            print(
                f"{policy} ({how}): save {1e3 * med:.0f} ms (median; "
                f"{', '.join(f'{1e3 * t:.0f}' for t in times)}); vs mlx-lm {ratio:.2f}x"
            )
            if phases is not None:
                for label, spent in phases.items():
                    per = spent[-args.repeats :]
                    print(
                        f"  wall: {label:<34} {1e3 * statistics.median(per):7.1f} ms (median; "
                        f"{', '.join(f'{1e3 * t:.0f}' for t in per)})"
                    )
                    spent.clear()
            for label, needles in PARTS.items():
                part = _cumulative(stats, needles)
                print(
                    f"  {label:<40} {100 * part / total:5.1f}%  {1e3 * part / args.repeats:7.1f} ms"
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
