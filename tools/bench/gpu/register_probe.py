"""How fast can a fresh process page-lock a restore's records, and in what shape?

    python3 -m tools.bench.gpu.register_probe [--sizes 32,8] [--repeats 2]

A restore on the H200 waits on ``cuMemHostRegister`` of its records' pages more than
on anything else: a lossless 4096-token llama-8B restore (16 records of 32 MiB) locks
them from ~3 to ~22 ms in, and TurboQuant 4/4 (16 of ~8.3 MiB) from ~2 to ~13 ms, at
half the rate per byte. ``pages_probe.py`` found the driver locks pages already in the
process's page tables about twice as fast as pages it must fault in itself (13.7 against
24.8 ms for 512 MiB), and ``MADV_POPULATE_READ`` maps 512 MiB in 2.7 ms on 16 threads.

This asks, each in a fresh child process (page tables empty, as in a new session) over
16 LMDB values back to back in the page cache: the records locked one call each on 4
threads (the library today) against the same after ``MADV_POPULATE_READ`` on 16
threads, each populated on its locking thread just before, merged into fewer calls, on
more threads, and while 8 threads hash the same pages (as a restore's checks do).
Prints one line per child: what it did, and when populating and locking ended.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tools.bench.gpu.pages_probe import build
from tools.bench.gpu.pages_probe import views as record_views

PAGE = 4096
MADV_POPULATE_READ = 22
FLAGS = 0x01 | 0x02 | 0x08  # PORTABLE | DEVICEMAP | READ_ONLY, as cuda.Driver.register_pages

#: name: (populate first on 16 threads, populate on the locking thread, calls, threads,
#: hashing beside)
CONFIGS = {
    "today (16 calls, 4 threads)": (False, False, 16, 4, False),
    "today + 8 hashing": (False, False, 16, 4, True),
    "populate16 then 16 calls/4 thr": (True, False, 16, 4, False),
    "populate16 then 16 calls/16 thr": (True, False, 16, 16, False),
    "populate16 then 4 calls/4 thr": (True, False, 4, 4, False),
    "populate16 then 1 call": (True, False, 1, 1, False),
    "populate16 + 8 hashing, 16/4": (True, False, 16, 4, True),
    "populate on lock thread 16/4": (False, True, 16, 4, False),
    "populate on lock thread 16/8": (False, True, 16, 8, False),
    "no populate, 4 calls/4 thr": (False, False, 4, 4, False),
    "no populate, 1 call": (False, False, 1, 1, False),
}


def child(path: str, name: str, records: int) -> None:
    import mlx.core as mx
    import xxhash

    populate_first, populate_each, calls, threads, hashing = CONFIGS[name]
    libc = ctypes.CDLL(None, use_errno=True)
    cu = ctypes.CDLL("libcuda.so.1")
    mx.eval(mx.zeros(4) + 1)  # MLX's context up, as in a session
    assert cu.cuInit(0) == 0
    dev = ctypes.c_int()
    cu.cuDeviceGet(ctypes.byref(dev), 0)
    ctx = ctypes.c_void_p()
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    env, txn, views = record_views(path, records)
    addresses = [np.frombuffer(v, np.uint8).ctypes.data for v in views]
    sizes = [memoryview(v).nbytes for v in views]
    lo = addresses[0] - addresses[0] % PAGE
    hi = -(-(addresses[-1] + sizes[-1]) // PAGE) * PAGE
    contiguous = all(addresses[i] + sizes[i] <= addresses[i + 1] for i in range(records - 1))
    # Spans: the records' pages cut into `calls` spans at record boundaries.
    cut = [lo] + [addresses[i * records // calls] // PAGE * PAGE for i in range(1, calls)] + [hi]
    spans = [(cut[i], cut[i + 1]) for i in range(calls)]

    def populate(span: tuple[int, int]) -> None:
        if libc.madvise(
            ctypes.c_void_p(span[0]), ctypes.c_size_t(span[1] - span[0]), MADV_POPULATE_READ
        ):
            raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_READ)")

    def lock(span: tuple[int, int]) -> float:
        cu.cuCtxSetCurrent(ctx)
        if populate_each:
            populate(span)
        code = cu.cuMemHostRegister_v2(
            ctypes.c_void_p(span[0]), ctypes.c_size_t(span[1] - span[0]), FLAGS
        )
        if code:
            raise RuntimeError(f"cuMemHostRegister CUresult {code}")
        return time.perf_counter()

    pool16 = ThreadPoolExecutor(16)
    pool = ThreadPoolExecutor(threads)
    list(pool16.map(lambda _: None, range(16)))
    list(pool.map(lambda _: None, range(threads)))
    hashers = ThreadPoolExecutor(8) if hashing else None
    sys.setswitchinterval(0.0005)
    t0 = time.perf_counter()
    populated = None
    if populate_first:
        step = -(-(hi - lo) // 16 // PAGE) * PAGE
        list(pool16.map(populate, [(a, min(a + step, hi)) for a in range(lo, hi, step)]))
        populated = time.perf_counter()
    hashed: list[float] = []
    if hashers is not None:

        def digest(v: memoryview) -> None:
            xxhash.xxh3_64_intdigest(v)
            hashed.append(time.perf_counter())

        futures = [hashers.submit(digest, v) for v in views]
    ends = list(pool.map(lock, spans))
    locked = max(ends)
    if hashers is not None:
        for f in futures:
            f.result()
    ms = lambda t: round(1e3 * (t - t0), 2)  # noqa: E731
    print(
        f"{name:<34} {(hi - lo) >> 20:5d} MiB  contiguous={contiguous}  "
        f"populated {ms(populated) if populated else '-':>6}  locked {ms(locked):7.2f} ms"
        + (f"  hashed {ms(max(hashed)):7.2f}" if hashed else ""),
        flush=True,
    )
    for span in spans:
        cu.cuMemHostUnregister(ctypes.c_void_p(span[0]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="32,8", help="MiB per record, 16 records")
    parser.add_argument("--records", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.records)
        return
    for mib in (int(s) for s in args.sizes.split(",")):
        root = tempfile.mkdtemp(prefix="register-probe-")
        try:
            build(root, args.records, mib << 20)
            print(f"# {args.records} records of {mib} MiB", flush=True)
            for _ in range(args.repeats):
                for name in CONFIGS:
                    child_args = ["--records", str(args.records), "--child", root, name]
                    subprocess.run(
                        [sys.executable, "-m", __spec__.name, *child_args], check=False, timeout=60
                    )
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
