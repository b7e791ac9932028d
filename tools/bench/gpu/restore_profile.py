"""Where a fresh process's restore spends its time, phase by phase (issue 13's profile).

    python3 tools/bench/gpu/restore_profile.py [--tokens 4096] [--layers 32] [--repeats 3]

Saves a llama-8B-shaped KV (random bf16) into one LMDB store per storage
policy, then restores it in fresh child processes the way G1/G2's sessions
do (a warm-up restore of one block, MLX's buffer cache given back, then the
timed restore). The child wraps the restore's phases -- the store's read and
verify, the record decode, the plans (row joins and transcodes of lossy
records), the arrays' allocation and fill -- and the CUDA staging's slot
growth, fills and uploads, and prints each phase's count, summed time and
first-start/last-end on the restore's clock. A second child measures what
fresh device memory costs there: MLX's CUDA allocator hands out managed
memory, whose pages reach the GPU on first touch.

Nothing in the library is changed; runs on the CPU too (no staging rows).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from typing import Any

POLICIES = ("lossless", "kv:quant:8:64", "kv:turboquant:4:4")


class Timeline:
    """(name, start, end) of every wrapped call, on one clock."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.events: list[tuple[str, float, float, int]] = []
        self.cpu: dict[str, float] = {}
        self.lock = threading.Lock()

    def wrap(self, owner: Any, attr: str, name: str | None = None) -> None:
        real = getattr(owner, attr)
        label = name or attr

        @functools.wraps(real)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return real(*args, **kwargs)
            finally:
                end = time.perf_counter()
                with self.lock:
                    self.events.append((label, start, end, threading.get_ident()))
                    # The calling thread's CPU time in the call: far under its wall time,
                    # the thread waited (the GIL, a lock, the driver) rather than ran.
                    self.cpu[label] = self.cpu.get(label, 0.0) + time.thread_time() - cpu

        setattr(owner, attr, timed)

    def summary(self) -> dict[str, Any]:
        by: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
        for name, s, e, tid in self.events:
            by[name].append((s, e, tid))
        out = {}
        for name, spans in by.items():
            out[name] = {
                "n": len(spans),
                "sum_ms": round(1e3 * sum(e - s for s, e, _ in spans), 2),
                "first_ms": round(1e3 * (min(s for s, _, _ in spans) - self.t0), 2),
                "last_ms": round(1e3 * (max(e for _, e, _ in spans) - self.t0), 2),
                "threads": len({t for _, _, t in spans}),
                "cpu_ms": round(1e3 * self.cpu.get(name, 0.0), 2),
            }
        return out


def session_model(layers: int, tokens: int) -> Any:
    """G1's fresh session before its clock (``KVSTORE_PROFILE_MODEL=1``): the llama-8B-shaped
    model built in this process and a one-token forward over caches of zeros as long as
    the prompt. G1's restore has been 6-9 ms slower than this script's child without it
    (``tools/bench/results/gpu/87ca0d3/``: 39.5 against 30.5 ms): is the model why?"""
    import mlx.core as mx

    from kvstore.bench.figures.gpu_common import LLAMA8B, build

    model = build({**LLAMA8B, "num_hidden_layers": layers})
    caches = model.make_cache()
    shape = (1, LLAMA8B["num_key_value_heads"], tokens, LLAMA8B["head_dim"])
    for cache in caches:
        cache.update_and_fetch(mx.zeros(shape, mx.bfloat16), mx.zeros(shape, mx.bfloat16))
    mx.eval(model(mx.array([[1]]), caches))
    return model


def child_restore(url: str, tokens: int, layers: int, switch_ms: float) -> dict[str, Any]:
    import gc

    import mlx.core as mx

    from kvstore.bench.figures.gpu_session import thread_usage
    from kvstore.caches import KVCache
    from kvstore.codecs import cuda, cuda_pages, gather_tables, growing, one_buffer, plans
    from kvstore.store import open_store
    from kvstore.store.kv import restore

    # KVSTORE_PROFILE_LEAVE_LAST=1: the prompt is the tokens stored, so the lookup leaves
    # the last one to the model and the last block is read in part, as in G1/G2's sessions.
    leave_last = os.environ.get("KVSTORE_PROFILE_LEAVE_LAST") == "1"
    prompt = list(range(tokens if leave_last else tokens + 1))
    # Held through the timed restore, as a session holds its model.
    _model = session_model(layers, tokens) if os.environ.get("KVSTORE_PROFILE_MODEL") else None
    store = open_store(url, readonly=True)
    head = prompt[: store.block_size + 1]
    warm = store.restore(store.lookup("ns", head), [KVCache() for _ in range(layers)])
    mx.eval([c.keys for c in warm])
    cuda_pages.trial_done()  # the warm-up's trial of the page route, not raced
    del warm
    gc.collect()
    mx.clear_cache()

    line = Timeline()
    real_read = store.read_checking  # what a restore reads through

    def read(wanted: Any, **options: Any) -> Any:
        start = time.perf_counter()
        ctx = real_read(wanted, **options)
        views = ctx.__enter__()
        line.events.append(("store.read_checking enter (get)", start, time.perf_counter(), 0))

        class Ctx:
            def __enter__(self) -> Any:
                return views

            def __exit__(self, *exc: Any) -> Any:
                s = time.perf_counter()
                try:
                    return ctx.__exit__(*exc)
                finally:
                    line.events.append(
                        ("store.read_checking exit (checks waited)", s, time.perf_counter(), 0)
                    )

        return Ctx()

    store.read_checking = read  # type: ignore[method-assign]
    for attr in (
        "_headers",
        "_decoded",
        "_plans",
        "run_plans",
        "transcode",
        "transcode_stacked",
        "join_runs",
    ):
        if hasattr(restore, attr):
            line.wrap(restore, attr)
    line.wrap(plans, "filled_arrays", "plans.filled_arrays")
    # The joins per tensor name (kvstore/codecs/alike_joins.py) and what follows them:
    # where a lossy restore's time after the gather goes.
    for attr in ("_alike_plans", "joined_records", "joined_alike", "_converted_plans"):
        if hasattr(restore, attr):
            line.wrap(restore, attr)
    line.wrap(growing.GrowingKVCodec, "plan_restore", "plan_restore (a layer)")
    line.wrap(plans, "_joined_on_device", "run: device joins planned")
    line.wrap(mx, "async_eval", "mx.async_eval")
    line.wrap(mx, "eval", "mx.eval")
    if cuda.available():
        line.wrap(cuda, "_take_slot", "cuda slot (take)")
        transport = cuda.transport()
        line.wrap(transport, "to_device", "cuda to_device (kernel+eval)")
        real_upload = cuda.upload

        def upload(specs: Any, fill: Any) -> Any:
            def timed_fill(i: int, view: Any) -> None:
                s = time.perf_counter()
                fill(i, view)
                with line.lock:
                    line.events.append(("cuda fill", s, time.perf_counter(), threading.get_ident()))

            return real_upload(specs, timed_fill)

        cuda.upload = upload  # type: ignore[assignment]
        line.wrap(cuda, "upload", "cuda.upload")
        line.wrap(cuda_pages, "gathered", "cuda_pages.gathered")
        line.wrap(transport, "register", "cuda register (page-lock)")
        line.wrap(cuda_pages.PinnedPages, "_copy_chunk", "cuda copy (chunk)")
        line.wrap(transport, "gather", "cuda gather (launch)")
        line.wrap(transport, "gather_many", "cuda gather (launch)")
        line.wrap(transport, "assemble", "cuda assemble (launch)")
        line.wrap(transport, "assemble_many", "cuda joins (launch)")
        line.wrap(transport, "staging", "cuda staging (allocate)")
        line.wrap(cuda_pages.PinnedPages, "_all_copied", "cuda copies (wait)")
        # join_runs' own steps (a lossy restore's ~8 ms there on the H200, ~2.5 ms of its
        # Python when timed alone on a CPU): each wrap adds ~1 us a call.
        line.wrap(plans, "_row_names", "join: row names")
        line.wrap(plans._StoredRows, "layout", "join: layouts")
        line.wrap(cuda_pages, "gathered_flat", "join: gathered_flat")
        line.wrap(gather_tables, "segment_tables", "gather: segment tables")
        line.wrap(cuda_pages._DeviceTable, "params", "gather: device table")
        line.wrap(cuda_pages, "_group_buffers", "gather: group buffers")
        line.wrap(cuda_pages, "views_in", "join: views")
        line.wrap(one_buffer, "views_in", "join: views")
        line.wrap(plans, "_stacks", "join: stacks")
    if switch_ms:
        sys.setswitchinterval(switch_ms / 1e3)
    line.t0 = time.perf_counter()
    match = store.lookup("ns", prompt)
    t1, cpu1, usage1 = time.perf_counter(), time.thread_time(), thread_usage()
    restored = store.restore(match, [KVCache() for _ in range(layers)])
    mx.eval([c.keys for c in restored])
    t2, cpu2, usage2 = time.perf_counter(), time.thread_time(), thread_usage()
    assert restored[0].offset == tokens - leave_last, restored[0].offset
    store.close()
    return {
        "lookup_ms": round(1e3 * (t1 - line.t0), 2),
        "restore_ms": round(1e3 * (t2 - t1), 2),
        "restore_cpu_ms": round(1e3 * (cpu2 - cpu1), 2),
        # Its page faults and context switches (Linux; G1/G2's sessions log the same).
        "restore_thread": {k: usage2[k] - usage1[k] for k in usage1},
        "phases": line.summary(),
        "rows": rows_digest(restored, tokens - leave_last),  # after the clock
    }


def rows_digest(caches: Any, tokens: int) -> str:
    """A digest of the first ``tokens`` rows of every layer's keys and values: equal
    for two restores (or a restore and the caches saved) that hold the same bits."""
    import mlx.core as mx
    import numpy as np
    import xxhash

    digest = xxhash.xxh3_128()
    for cache in caches:
        for rows in (cache.keys, cache.values):
            digest.update(np.array(rows[..., :tokens, :].flatten().view(mx.uint8)).tobytes())
    return digest.hexdigest()


def child_memory(layers: int, nbytes: int) -> dict[str, Any]:
    """Fresh vs reused device memory, written by MLX and by the staging upload."""
    import gc

    import mlx.core as mx
    import numpy as np

    from kvstore.codecs import cuda

    n = 2 * layers
    out: dict[str, Any] = {"arrays": n, "MiB_each": nbytes >> 20}

    def timed(label: str, fn: Any) -> None:
        start = time.perf_counter()
        result = fn()
        mx.eval(result)
        out[label] = round(1e3 * (time.perf_counter() - start), 2)
        del result
        gc.collect()

    mx.eval(mx.zeros((16,), mx.uint8))
    timed("mx.zeros fresh", lambda: [mx.zeros((nbytes,), mx.uint8) for _ in range(n)])
    timed("mx.zeros reused", lambda: [mx.zeros((nbytes,), mx.uint8) for _ in range(n)])
    mx.clear_cache()
    timed("mx.ones fresh", lambda: [mx.ones((nbytes,), mx.uint8) for _ in range(n)])
    if cuda.available():
        source = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        specs = [((nbytes,), "uint8")] * n

        def nothing(_: int, view: Any) -> None:
            pass

        def copy(_: int, view: Any) -> None:
            np.copyto(view, source)

        cuda.upload(specs[:2], nothing)  # slots grown, kernels loaded
        mx.clear_cache()
        timed("upload (no fill) fresh", lambda: cuda.upload(specs, nothing))
        timed("upload (no fill) reused", lambda: cuda.upload(specs, nothing))
        timed("upload (copy fill) reused", lambda: cuda.upload(specs, copy))
        mx.clear_cache()
        timed("upload (copy fill) fresh", lambda: cuda.upload(specs, copy))
        out["workers"] = cuda.workers()
    return out


def saved_store(scratch: str, policy: str, tokens: int, caches: Any) -> str:
    """The URL of a store in ``scratch`` holding ``caches`` (``tokens`` of them) saved
    under ``policy`` ("lossless": none); one per policy, as every profile here reads."""
    from kvstore.store import open_store

    options: dict[str, Any] = {"map_size": 1 << 34, "touch_interval": 0}
    if policy != "lossless":
        options["storage_policy"] = policy
    url = f"lmdb://{scratch}/{policy.replace(':', '-')}"
    with open_store(url, **options) as store:
        store.save("ns", list(range(tokens)), caches)
        store.flush()
    return url


def run_child(
    kind: str,
    url: str,
    tokens: int,
    layers: int,
    *,
    switch_ms: float = 0.0,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """This script's ``--child kind url`` in a fresh process (``env`` added to this
    one's): its JSON line, or ``{"error": its stderr's tail}``."""
    cmd = [sys.executable, __file__, "--child", kind, url, "--tokens", str(tokens)]
    cmd += ["--layers", str(layers), "--switch-ms", str(switch_ms)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if done.returncode:
        return {"error": done.stderr[-2000:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def median_run(runs: list[dict[str, Any]]) -> tuple[float, dict[str, Any]]:
    """The median restore of ``runs`` (children that succeeded), and the run nearest it
    (whose phases stand for them)."""
    ms = statistics.median(r["restore_ms"] for r in runs)
    return ms, min(runs, key=lambda r: abs(r["restore_ms"] - ms))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument(
        "--switch-ms", type=float, default=0.0, help="the GIL switch interval of the timed restore"
    )
    parser.add_argument("--child", nargs=2, metavar=("KIND", "URL"))
    args = parser.parse_args()
    if args.child:
        kind, url = args.child
        if kind == "memory":
            result = child_memory(args.layers, args.tokens * 8 * 128 * 2)
        else:
            result = child_restore(url, args.tokens, args.layers, args.switch_ms)
        print(json.dumps(result), flush=True)
        return 0

    import mlx.core as mx

    from kvstore.bench.workloads import KVShape, SyntheticKV

    def child(kind: str, url: str) -> dict[str, Any]:
        return run_child(kind, url, args.tokens, args.layers, switch_ms=args.switch_ms)

    shape = f"{args.layers} layers x {args.tokens} tokens, 8 KV heads x 128, bf16"
    knobs = {k: v for k, v in os.environ.items() if k.startswith("KVSTORE_")}
    print(f"{shape}; {mx.default_device()}; switch {args.switch_ms or 'default'} ms; {knobs}")
    print("memory:", json.dumps(child("memory", "-")), flush=True)
    kv = SyntheticKV(KVShape("llama8b", layers=args.layers, kv_heads=8, head_dim=128), args.tokens)
    caches = kv.ours()
    scratch = tempfile.mkdtemp(prefix="restore-profile-")
    try:
        for policy in args.policies.split(","):
            url = saved_store(scratch, policy, args.tokens, caches)
            runs = [child("restore", url) for _ in range(args.repeats)]
            good = [r for r in runs if "error" not in r]
            if not good:
                print(policy, "error:", runs[0]["error"], flush=True)
                continue
            ms, best = median_run(good)
            usage = best.get("restore_thread") or {}
            faults = sorted(r.get("restore_thread", {}).get("faults", -1) for r in good)
            print(
                f"== {policy}: restore {ms:.1f} ms (median of {len(good)}); the restoring "
                f"thread's {usage} (faults in every run: {faults})"
            )
            for name, p in sorted(best["phases"].items(), key=lambda kv: kv[1]["first_ms"]):
                print(
                    f"   {name:<34} n={p['n']:<4} sum {p['sum_ms']:>8.2f} ms  "
                    f"[{p['first_ms']:>7.2f} .. {p['last_ms']:>7.2f}]  threads {p['threads']}"
                )
            sys.stdout.flush()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
