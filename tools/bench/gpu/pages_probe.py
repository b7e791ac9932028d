# ruff: noqa: E501 - a one-off diagnostic, kept as it ran on the device
"""Can the GPU read a restore's rows straight out of the store's pages?

    python3 tools/bench/gpu/pages_probe.py [--records 16] [--record-mib 32]

A fresh process's restore today touches every page of the store twice on the
host (the checksum pass faults them in, the gather copies them into pinned
slots) before the bytes cross the bus. This measures the other route: page-lock
the LMDB map's own pages of each record (``cuMemHostRegister`` with
``CU_MEMHOSTREGISTER_READ_ONLY``: the map is read-only) and let one kernel per
layer array gather its rows over PCIe. Each section runs in a fresh child
process (page tables start empty, as in a new session); the store's file is in
the page cache (written just before). Prints one line per measurement.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

PAGE = 4096
LAYERS, HEADS, DIM, BLOCK = 32, 8, 128, 256
MADV_POPULATE_READ = 22
CU_REGISTER_PORTABLE, CU_REGISTER_DEVICEMAP, CU_REGISTER_READ_ONLY = 0x01, 0x02, 0x08

GATHER = """
    // params: [nseg, then per segment: src, src_pitch, dst_off, dst_pitch, width, height]
    // (bytes; multiples of 16). src 0: zeros. Block b copies part of segment b % nseg.
    const unsigned long long* p = reinterpret_cast<const unsigned long long*>(params);
    unsigned long long nseg = p[0];
    unsigned long long seg = blockIdx.x % nseg;
    unsigned long long part = blockIdx.x / nseg, parts = gridDim.x / nseg;
    const unsigned long long* s = p + 1 + seg * 6;
    const uint4* src = reinterpret_cast<const uint4*>(s[0]);
    unsigned long long sp = s[1] / 16, doff = s[2] / 16, dp = s[3] / 16, w = s[4] / 16, h = s[5];
    uint4* dst = reinterpret_cast<uint4*>(out);
    unsigned long long total = w * h;
    for (unsigned long long j = part * blockDim.x + threadIdx.x; j < total; j += parts * blockDim.x) {
        unsigned long long r = j / w, c = j - r * w;
        dst[doff + r * dp + c] = src ? src[r * sp + c] : make_uint4(0, 0, 0, 0);
    }
"""


def build(path: str, records: int, record_bytes: int) -> None:
    import lmdb

    env = lmdb.open(path, map_size=records * record_bytes * 2 + (1 << 30))
    rng = np.random.default_rng(0)
    with env.begin(write=True) as txn:
        for r in range(records):
            txn.put(b"r%03d" % r, rng.integers(0, 256, record_bytes, dtype=np.uint8).tobytes())
    env.sync()
    env.close()
    # Read it once so it is in the page cache (as a store a session wrote is).
    with open(os.path.join(path, "data.mdb"), "rb") as f:
        while f.read(64 << 20):
            pass


def views(path: str, records: int) -> tuple[object, object, list[memoryview]]:
    import lmdb

    env = lmdb.open(path, readonly=True, lock=False)
    txn = env.begin(buffers=True)
    return env, txn, [memoryview(txn.get(b"r%03d" % r)) for r in range(records)]


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data)


def span(view: memoryview) -> tuple[int, int]:
    start = address(view)
    base = start - start % PAGE
    end = start + view.nbytes
    return base, -(-end // PAGE) * PAGE - base


def child(section: str, path: str, records: int, threads: int) -> None:
    import xxhash

    env, txn, vs = views(path, records)
    pool = ThreadPoolExecutor(threads)
    libc = ctypes.CDLL(None, use_errno=True)
    nbytes = sum(v.nbytes for v in vs)

    def t(label: str, fn) -> float:
        start = time.perf_counter()
        out = fn()
        ms = (time.perf_counter() - start) * 1e3
        print(f"{section:<10} {label:<44} {ms:8.2f} ms  {nbytes / ms / 1e6:6.1f} GB/s", flush=True)
        return out

    def populate(v: memoryview) -> None:
        base, size = span(v)
        if libc.madvise(ctypes.c_void_p(base), ctypes.c_size_t(size), MADV_POPULATE_READ) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_READ)")

    def touch(v: memoryview) -> int:
        return int(np.frombuffer(v, np.uint8)[::PAGE].sum())

    def digest(v: memoryview) -> int:
        return xxhash.xxh3_64_intdigest(v)

    if section == "touch":
        t("touch 1 byte/page, threads", lambda: list(pool.map(touch, vs)))
        t("xxh3 after touch, threads", lambda: list(pool.map(digest, vs)))
        return
    if section == "populate":
        t("madvise(POPULATE_READ), threads", lambda: list(pool.map(populate, vs)))
        t("xxh3 after populate, threads", lambda: list(pool.map(digest, vs)))
        return
    if section == "hashcold":
        t("xxh3 cold (faults as it reads), threads", lambda: list(pool.map(digest, vs)))
        return

    import mlx.core as mx

    cu = ctypes.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0
    dev = ctypes.c_int()
    cu.cuDeviceGet(ctypes.byref(dev), 0)
    ctx = ctypes.c_void_p()
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    attr = ctypes.c_int()
    cu.cuDeviceGetAttribute(ctypes.byref(attr), 113, dev)  # READ_ONLY_HOST_REGISTER_SUPPORTED
    print(f"{section:<10} READ_ONLY_HOST_REGISTER_SUPPORTED={attr.value}", flush=True)
    mx.eval(mx.zeros(4) + 1)  # MLX's context up

    def register(v: memoryview) -> int:
        cu.cuCtxSetCurrent(ctx)
        base, size = span(v)
        flags = CU_REGISTER_PORTABLE | CU_REGISTER_DEVICEMAP | CU_REGISTER_READ_ONLY
        code = cu.cuMemHostRegister_v2(ctypes.c_void_p(base), ctypes.c_size_t(size), flags)
        if code != 0:
            raise RuntimeError(f"cuMemHostRegister CUresult {code}")
        ptr = ctypes.c_uint64()
        code = cu.cuMemHostGetDevicePointer_v2(ctypes.byref(ptr), ctypes.c_void_p(base), 0)
        if code != 0:
            raise RuntimeError(f"cuMemHostGetDevicePointer CUresult {code}")
        return int(ptr.value) + (address(v) - base)

    def unregister(v: memoryview) -> None:
        cu.cuCtxSetCurrent(ctx)
        cu.cuMemHostUnregister(ctypes.c_void_p(span(v)[0]))

    if section == "regtouch":
        t("touch 1 byte/page, threads", lambda: list(pool.map(touch, vs)))
    try:
        pointers = t("cuMemHostRegister READ_ONLY, threads", lambda: list(pool.map(register, vs)))
    except RuntimeError as exc:
        print(f"{section:<10} register failed: {exc}", flush=True)
        return
    print(
        f"{section:<10} device pointer == host pointer: {pointers[0] == address(vs[0])}", flush=True
    )
    if section in ("register", "regtouch"):
        t("xxh3 after register, threads", lambda: list(pool.map(digest, vs)))
        t("cuMemHostUnregister, threads", lambda: list(pool.map(unregister, vs)))
        return

    # section == "gather": every layer's K and V gathered by one kernel each.
    kernel = mx.fast.cuda_kernel(
        name="probe_gather", input_names=["params"], output_names=["out"], source=GATHER
    )
    tokens = records * BLOCK
    chunk = BLOCK * DIM * 2  # one head's rows of one block, bf16
    tensor = HEADS * chunk

    def launch(array: int) -> mx.array:
        segs = [records]
        for r, ptr in enumerate(pointers):
            segs += [ptr + array * tensor, chunk, r * chunk, tokens * DIM * 2, chunk, HEADS]
        params = mx.array(np.array(segs, np.uint64))
        (out,) = kernel(
            inputs=[params],
            output_shapes=[(HEADS * tokens * DIM * 2,)],
            output_dtypes=[mx.uint8],
            grid=(records * 64 * 256, 1, 1),
            threadgroup=(256, 1, 1),
        )
        return out

    def all_arrays() -> list[mx.array]:
        outs = [launch(a) for a in range(2 * LAYERS)]
        mx.eval(outs)
        return outs

    outs = t("gather kernels, 64 arrays (first, compiles)", all_arrays)
    outs = t("gather kernels, 64 arrays", all_arrays)
    got = np.array(outs[5]).reshape(HEADS, tokens, DIM * 2)
    want = np.concatenate(
        [
            np.frombuffer(v, np.uint8)[5 * tensor : 6 * tensor].reshape(HEADS, BLOCK, DIM * 2)
            for v in vs
        ],
        axis=1,
    )
    print(f"{section:<10} gathered bytes equal: {bool(np.array_equal(got, want))}", flush=True)
    t("cuMemHostUnregister, threads", lambda: list(pool.map(unregister, vs)))
    del txn, env


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=16)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    record_bytes = 2 * LAYERS * HEADS * BLOCK * DIM * 2
    if args.child:
        child(args.child[0], args.child[1], args.records, args.threads)
        return
    root = tempfile.mkdtemp(prefix="pages-probe-")
    try:
        build(root, args.records, record_bytes)
        for section in (
            "hashcold",
            "touch",
            "populate",
            "register",
            "regtouch",
            "gather",
            "gather",
        ):
            subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--records",
                    str(args.records),
                    "--threads",
                    str(args.threads),
                    "--child",
                    section,
                    root,
                ],
                check=False,
                timeout=120,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
