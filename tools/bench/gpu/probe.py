# ruff: noqa: B023, E501, E731 - a one-off diagnostic, kept as it ran on the device
"""One call's worth of measurements on the GPU machine, to choose the data path by.

    python3 tools/bench/gpu/probe.py [OUT_DIR]

Prints one line per measurement and writes ``probe.json``. Every section runs
on its own: one that fails prints its error and the others go on. Not a
figure (see ``kvstore bench --only G1,...`` for those); the numbers here are
what the design of the CUDA data path rests on: host copy and hash rates,
pinned-memory staging through the CUDA driver API, a kernel that reads (or
writes) host memory, MLX's own ways in and out of the device, the disk.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

#: PROBE_SMALL=1 shrinks every size (a dry run of the script on a CPU).
SMALL = bool(os.environ.get("PROBE_SMALL"))
MiB = 1 << (12 if SMALL else 20)
RESULTS: dict[str, Any] = {}


def with_and_without_graphs(probe: Callable[[], None], script: str) -> int:
    """Run ``probe`` here, then ``script`` again in a child with ``MLX_USE_CUDA_GRAPHS=0``
    (MLX reads it once per process) and this process's arguments; the child is told by
    ``--child``, where it runs ``probe`` alone."""
    probe()
    if "--child" not in sys.argv:
        env = {**os.environ, "MLX_USE_CUDA_GRAPHS": "0"}
        argv = [sys.executable, script, "--child", *sys.argv[1:]]
        subprocess.run(argv, env=env, timeout=240, check=False)
    return 0


def timed(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def report(key: str, seconds: float | None = None, nbytes: int | None = None, **extra: Any) -> None:
    entry: dict[str, Any] = dict(extra)
    line = f"{key:<48}"
    if seconds is not None:
        entry["ms"] = seconds * 1e3
        line += f" {seconds * 1e3:9.2f} ms"
        if nbytes:
            entry["GBps"] = nbytes / seconds / 1e9
            line += f" {nbytes / seconds / 1e9:7.2f} GB/s"
    for k, v in extra.items():
        line += f" {k}={v}"
    RESULTS[key] = entry
    print(line, flush=True)


def section(name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            print(f"== {name}", flush=True)
            t = time.perf_counter()
            try:
                fn()
            except Exception as exc:  # a probe section never stops the others
                RESULTS[f"{name}.error"] = f"{type(exc).__name__}: {exc}"
                print(f"!! {name}: {type(exc).__name__}: {exc}", flush=True)
                traceback.print_exc(limit=4)
            print(f"   ({time.perf_counter() - t:.1f} s)", flush=True)

        return run

    return wrap


# -- host ---------------------------------------------------------------------------------


@section("host")
def host() -> None:
    import xxhash

    n = 512 * MiB
    src = np.ones(n, np.uint8)
    dst = np.zeros(n, np.uint8)
    np.copyto(dst, src)
    report("host copyto 512MiB touched 1 thread", timed(lambda: np.copyto(dst, src)), n)
    report(
        "host copyto 512MiB fresh 1 thread",
        timed(lambda: np.copyto(np.empty(n, np.uint8), src), 3),
        n,
    )
    for threads in (4, 8, 16):
        pool = ThreadPoolExecutor(threads)
        step = n // threads

        def par(target: np.ndarray) -> None:
            list(
                pool.map(
                    lambda i: np.copyto(
                        target[i * step : (i + 1) * step], src[i * step : (i + 1) * step]
                    ),
                    range(threads),
                )
            )

        report(f"host copyto 512MiB touched {threads} threads", timed(lambda: par(dst)), n)
        report(
            f"host copyto 512MiB fresh {threads} threads",
            timed(lambda: par(np.empty(n, np.uint8)), 3),
            n,
        )
        pieces = [memoryview(src)[i * 32 * MiB : (i + 1) * 32 * MiB] for i in range(16)]
        report(
            f"host xxh3 16x32MiB {threads} threads",
            timed(lambda: list(pool.map(xxhash.xxh3_64_intdigest, pieces))),
            n,
        )
        pool.shutdown()
    report("host xxh3 512MiB 1 thread", timed(lambda: xxhash.xxh3_64_intdigest(src), 3), n)
    report("cpu count", cores=os.cpu_count())


@section("disk")
def disk() -> None:
    n = 512 * MiB
    data = np.ones(n, np.uint8)
    for where in (os.getcwd(), "/tmp"):
        path = os.path.join(where, "probe-disk.bin")
        t = time.perf_counter()
        with open(path, "wb") as f:
            f.write(memoryview(data))
            t_write = time.perf_counter() - t
            f.flush()
            os.fsync(f.fileno())
        t_all = time.perf_counter() - t
        os.unlink(path)
        report(f"disk write 512MiB {where}", t_write, n)
        report(f"disk write+fsync 512MiB {where}", t_all, n)


# -- CUDA driver API through ctypes ----------------------------------------------------------

CU: Any = None


def cu_check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed with CUresult {code}")


def cuda_driver() -> Any:
    global CU
    if CU is None:
        cu = ctypes.CDLL("libcuda.so.1")
        cu_check(cu.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        cu_check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        cu_check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        cu_check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        cu.ctx = ctx
        cu.dev = dev
        CU = cu
    else:
        cu_check(CU.cuCtxSetCurrent(CU.ctx), "cuCtxSetCurrent")
    return CU


def pinned(nbytes: int) -> tuple[int, np.ndarray]:
    cu = cuda_driver()
    p = ctypes.c_void_p()
    cu_check(
        cu.cuMemHostAlloc(ctypes.byref(p), ctypes.c_size_t(nbytes), ctypes.c_uint(0x01 | 0x02)),
        "cuMemHostAlloc",
    )
    dptr = ctypes.c_uint64()
    cu_check(
        cu.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), p, ctypes.c_uint(0)),
        "cuMemHostGetDevicePointer",
    )
    buf = (ctypes.c_ubyte * nbytes).from_address(p.value)
    return int(dptr.value), np.frombuffer(buf, np.uint8)


_H2D = """
    const uint4* s = reinterpret_cast<const uint4*>(params[0]);
    uint4* o = reinterpret_cast<uint4*>(out);
    size_t count = (size_t)params[1];
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (; i < count; i += stride) o[i] = s[i];
"""
_D2H = """
    uint4* d = reinterpret_cast<uint4*>(params[0]);
    const uint4* s = reinterpret_cast<const uint4*>(inp);
    size_t count = (size_t)params[1];
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    if (i == 0) done[0] = 1;
    for (; i < count; i += stride) d[i] = s[i];
"""
_ADDR = """
    if (blockIdx.x == 0 && threadIdx.x == 0) addr[0] = (unsigned long long)(out);
"""


@section("pinned")
def pinned_section() -> None:
    import mlx.core as mx

    t = time.perf_counter()
    cuda_driver()
    report("cuda driver init (ctypes)", time.perf_counter() - t)
    t = time.perf_counter()
    ptr, host_view = pinned(256 * MiB)
    report("cuMemHostAlloc 256MiB", time.perf_counter() - t)
    src = np.random.default_rng(0).integers(0, 255, 256 * MiB, dtype=np.uint8)
    report("copy into pinned 256MiB 1 thread", timed(lambda: np.copyto(host_view, src)), 256 * MiB)
    RESULTS["_pinned"] = (ptr, host_view)
    # register an existing numpy buffer
    cu = cuda_driver()
    other = np.zeros(256 * MiB, np.uint8)
    other[::4096] = 1
    t = time.perf_counter()
    code = cu.cuMemHostRegister_v2(
        ctypes.c_void_p(other.ctypes.data), ctypes.c_size_t(other.nbytes), ctypes.c_uint(0x02)
    )
    report("cuMemHostRegister 256MiB", time.perf_counter() - t, code=code)
    if code == 0:
        cu.cuMemHostUnregister(ctypes.c_void_p(other.ctypes.data))
    mx.eval(mx.ones(1))


@section("kernels")
def kernels() -> None:
    import mlx.core as mx

    ptr, host_view = RESULTS["_pinned"]
    n = 256 * MiB
    src = np.random.default_rng(1).integers(0, 255, n, dtype=np.uint8)
    np.copyto(host_view, src)
    h2d = mx.fast.cuda_kernel(
        name="kv_h2d", input_names=["params"], output_names=["out"], source=_H2D
    )
    params = mx.array(np.array([ptr, n // 16], np.uint64))

    def run_h2d(blocks: int = 1024, threads: int = 256) -> mx.array:
        (out,) = h2d(
            inputs=[params],
            output_shapes=[(n // 4,)],
            output_dtypes=[mx.uint32],
            grid=(blocks * threads, 1, 1),
            threadgroup=(threads, 1, 1),
        )
        mx.eval(out)
        return out

    t = time.perf_counter()
    out = run_h2d()
    report("h2d kernel first call (compile)", time.perf_counter() - t)
    ok = bool(np.array_equal(np.asarray(out.view(mx.uint8)), src))
    report("h2d kernel bit-exact", ok=ok)
    del out
    for blocks, threads in ((264, 256), (1024, 256), (4096, 256), (2112, 512)):
        report(
            f"h2d kernel 256MiB grid {blocks}x{threads}",
            timed(lambda: run_h2d(blocks, threads)),
            n,
        )
    # device -> pinned
    d2h = mx.fast.cuda_kernel(
        name="kv_d2h", input_names=["params", "inp"], output_names=["done"], source=_D2H
    )
    dev = mx.array(np.random.default_rng(2).integers(0, 2**32, n // 4, dtype=np.uint32))
    dev = dev + mx.array(0, mx.uint32)  # a device array (not managed)
    mx.eval(dev)
    host_view[:] = 0

    def run_d2h() -> None:
        (done,) = d2h(
            inputs=[params, dev],
            output_shapes=[(1,)],
            output_dtypes=[mx.uint32],
            grid=(1024 * 256, 1, 1),
            threadgroup=(256, 1, 1),
        )
        mx.eval(done)

    run_d2h()
    ok = bool(np.array_equal(host_view.view(np.uint32), np.asarray(dev)))
    report("d2h kernel bit-exact", ok=ok)
    dev = dev + mx.array(0, mx.uint32)
    mx.eval(dev)
    report("d2h kernel 256MiB", timed(run_d2h), n)
    # the address trick + cuMemcpyHtoDAsync / DtoH
    addr_k = mx.fast.cuda_kernel(
        name="kv_addr", input_names=["x"], output_names=["addr"], source=_ADDR.replace("out", "x")
    )
    cu = cuda_driver()
    stream = ctypes.c_void_p()
    cu_check(cu.cuStreamCreate(ctypes.byref(stream), ctypes.c_uint(1)), "cuStreamCreate")
    target = mx.zeros((n // 4,), mx.uint32)
    mx.eval(target)
    (addr,) = addr_k(
        inputs=[target],
        output_shapes=[(1,)],
        output_dtypes=[mx.uint64],
        grid=(1, 1, 1),
        threadgroup=(1, 1, 1),
    )
    dptr = int(addr.item())

    def dma_h2d() -> None:
        cu_check(
            cu.cuMemcpyHtoDAsync_v2(
                ctypes.c_uint64(dptr),
                ctypes.c_void_p(host_view.ctypes.data),
                ctypes.c_size_t(n),
                stream,
            ),
            "cuMemcpyHtoDAsync",
        )
        cu_check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")

    np.copyto(host_view, src)
    dma_h2d()
    report("dma h2d bit-exact", ok=bool(np.array_equal(np.asarray(target.view(mx.uint8)), src)))
    target = mx.zeros((n // 4,), mx.uint32)
    mx.eval(target)
    (addr,) = addr_k(
        inputs=[target],
        output_shapes=[(1,)],
        output_dtypes=[mx.uint64],
        grid=(1, 1, 1),
        threadgroup=(1, 1, 1),
    )
    dptr = int(addr.item())
    report("dma h2d 256MiB (cuMemcpyHtoDAsync pinned)", timed(dma_h2d), n)

    def dma_d2h() -> None:
        cu_check(
            cu.cuMemcpyDtoHAsync_v2(
                ctypes.c_void_p(host_view.ctypes.data),
                ctypes.c_uint64(dptr),
                ctypes.c_size_t(n),
                stream,
            ),
            "cuMemcpyDtoHAsync",
        )
        cu_check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")

    report("dma d2h 256MiB (cuMemcpyDtoHAsync pinned)", timed(dma_d2h), n)
    # pageable source through DMA
    pageable = np.random.default_rng(3).integers(0, 255, n, dtype=np.uint8)

    def dma_pageable() -> None:
        cu_check(
            cu.cuMemcpyHtoDAsync_v2(
                ctypes.c_uint64(dptr),
                ctypes.c_void_p(pageable.ctypes.data),
                ctypes.c_size_t(n),
                stream,
            ),
            "cuMemcpyHtoDAsync pageable",
        )
        cu_check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")

    report("dma h2d 256MiB pageable source", timed(dma_pageable), n)


@section("pipeline")
def pipeline() -> None:
    """The restore design: worker threads copy leaves into their own pinned slot and
    launch the h2d kernel for it on their own stream; 64 leaves of 8 MiB."""
    import mlx.core as mx

    leaves, size = 64, 8 * MiB
    source = np.random.default_rng(8).integers(0, 255, leaves * size, dtype=np.uint8)
    h2d = mx.fast.cuda_kernel(
        name="kv_h2d", input_names=["params"], output_names=["out"], source=_H2D
    )
    for workers in (1, 4, 8, 12):
        slots = [pinned(size) for _ in range(workers)]
        lock = threading.Lock()
        turn = iter(range(leaves))
        outs: list[Any] = [None] * leaves

        def work(slot: tuple[int, np.ndarray]) -> None:
            ptr, view = slot
            params = mx.array(np.array([ptr, size // 16], np.uint64))
            while True:
                with lock:
                    i = next(turn, None)
                if i is None:
                    return
                np.copyto(view, source[i * size : (i + 1) * size])
                (out,) = h2d(
                    inputs=[params],
                    output_shapes=[(size // 4,)],
                    output_dtypes=[mx.uint32],
                    grid=(1024 * 256, 1, 1),
                    threadgroup=(256, 1, 1),
                )
                mx.eval(out)
                outs[i] = out

        def run() -> None:
            nonlocal turn
            turn = iter(range(leaves))
            threads = [threading.Thread(target=work, args=(s,)) for s in slots]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        run()
        ok = all(
            np.array_equal(np.asarray(outs[i].view(mx.uint8)), source[i * size : (i + 1) * size])
            for i in (0, leaves // 2, leaves - 1)
        )
        report(
            f"pipeline 64x8MiB pinned+kernel {workers} workers", timed(run, 3), leaves * size, ok=ok
        )


# -- MLX's own ways in and out --------------------------------------------------------------


@section("mlx-io")
def mlx_io() -> None:
    import mlx.core as mx

    n = 512 * MiB
    pieces = 64
    size = n // pieces
    src = np.random.default_rng(4).integers(0, 2**16, n // 2, dtype=np.uint16)
    views = [src[i * size // 2 : (i + 1) * size // 2] for i in range(pieces)]

    def from_numpy() -> None:
        arrays = [mx.array(v) for v in views]
        mx.eval(arrays)
        used = [a + mx.array(0, mx.uint16) for a in arrays]  # a GPU op reads each
        mx.eval(used)

    report("mx.array(numpy) 64x8MiB + GPU read", timed(from_numpy, 3), n)

    def from_numpy_only() -> None:
        arrays = [mx.array(v) for v in views]
        mx.eval(arrays)

    report("mx.array(numpy) 64x8MiB only", timed(from_numpy_only, 3), n)
    import safetensors.numpy as stn

    blob = stn.save({str(i): v for i, v in enumerate(views)})

    def load() -> None:
        arrays = mx.load(io.BytesIO(blob), format="safetensors")
        mx.eval(list(arrays.values()))

    report("mx.load(BytesIO safetensors) 64x8MiB", timed(load, 3), n)
    dev = [mx.array(v) + mx.array(0, mx.uint16) for v in views[:16]]
    mx.eval(dev)

    def to_numpy() -> None:
        fresh = [d + mx.array(1, mx.uint16) for d in dev]
        mx.eval(fresh)
        t = time.perf_counter()
        for d in fresh:
            np.asarray(d)
        RESULTS.setdefault("_d2h", []).append(time.perf_counter() - t)

    to_numpy()
    RESULTS.pop("_d2h")
    for _ in range(3):
        to_numpy()
    report(
        "np.asarray(gpu array) 16x8MiB (raw_ptr migration)",
        statistics.median(RESULTS.pop("_d2h")),
        128 * MiB,
    )
    # a GPU op on an array that was migrated to managed memory
    migrated = dev[0] + mx.array(2, mx.uint16)
    mx.eval(migrated)
    np.asarray(migrated)
    report(
        "gpu op on migrated 8MiB",
        timed(lambda: mx.eval(migrated * mx.array(3, mx.uint16))),
        8 * MiB,
    )
    fresh = dev[1] + mx.array(2, mx.uint16)
    mx.eval(fresh)
    report("gpu op on device 8MiB", timed(lambda: mx.eval(fresh * mx.array(3, mx.uint16))), 8 * MiB)
    report("mx cache limit", limit=mx.get_cache_memory(), active=mx.get_active_memory())


@section("hash")
def device_hash() -> None:
    import mlx.core as mx

    n = 1 << (22 if SMALL else 30)
    words = mx.random.randint(0, 2**31, (n // 4,), dtype=mx.int32).view(mx.uint32)
    mx.eval(words)
    width = 4096
    k = mx.array(np.random.default_rng(5).integers(1, 2**32, width, dtype=np.uint32) | 1)

    def mix(x: mx.array) -> mx.array:
        x = mx.bitwise_xor(x, mx.right_shift(x, 16))
        x = x * mx.array(0x85EBCA6B, mx.uint32)
        x = mx.bitwise_xor(x, mx.right_shift(x, 13))
        x = x * mx.array(0xC2B2AE35, mx.uint32)
        return mx.bitwise_xor(x, mx.right_shift(x, 16))

    def row_hash(w: mx.array) -> mx.array:
        rows = w.reshape(-1, width)
        r = mx.arange(rows.shape[0], dtype=mx.uint32)[:, None] * mx.array(0x9E3779B9, mx.uint32)
        lanes = [
            mx.sum(mix(mx.bitwise_xor(rows, k * mx.array(2 * j + 1, mx.uint32)) + r), axis=1)
            for j in range(4)
        ]
        return mx.stack(lanes, axis=1)

    t = time.perf_counter()
    mx.eval(row_hash(words))
    report("hash 1GiB plain ops first", time.perf_counter() - t)
    report("hash 1GiB plain ops", timed(lambda: mx.eval(row_hash(words)), 3), n)
    compiled = mx.compile(row_hash)
    t = time.perf_counter()
    mx.eval(compiled(words))
    report("hash 1GiB compiled first", time.perf_counter() - t)
    report("hash 1GiB compiled", timed(lambda: mx.eval(compiled(words)), 3), n)
    small = words[: 1 << 20]
    gpu = np.asarray(row_hash(small))
    with mx.stream(mx.cpu):
        cpu = np.asarray(row_hash(small))
    report("hash gpu == cpu stream", ok=bool(np.array_equal(gpu, cpu)))
    out = compiled(words)
    report("hash result transfer", timed(lambda: np.asarray(compiled(words))), int(out.nbytes))


@section("turboquant")
def turboquant() -> None:
    import mlx.core as mx

    from kvstore.turboquant.quantizer import quantizer_for

    keys = mx.random.normal((1, 8, 4096, 128)).astype(mx.bfloat16)
    values = mx.random.normal((1, 8, 4096, 128)).astype(mx.bfloat16)
    mx.eval(keys, values)
    nbytes = int(keys.nbytes + values.nbytes)
    q = lambda: mx.eval([mx.quantize(x, group_size=64, bits=4) for x in (keys, values)])  # noqa: E731
    affine = [mx.quantize(x, group_size=64, bits=4) for x in (keys, values)]
    dq = lambda: mx.eval([mx.dequantize(*a, group_size=64, bits=4) for a in affine])  # noqa: E731
    report("mx.quantize 4/64 1 layer 4096", timed(q), nbytes)
    report("mx.dequantize 4/64 1 layer 4096", timed(dq), nbytes)
    for bits in (4, 3):
        kq, vq = quantizer_for(bits, 128, "k"), quantizer_for(bits, 128, "v")
        enc = lambda: mx.eval([kq.encode(keys), vq.encode(values)])  # noqa: E731
        t = time.perf_counter()
        enc()
        report(f"tq{bits} encode first", time.perf_counter() - t)
        report(f"tq{bits} encode 1 layer 4096", timed(enc), nbytes)
        codes = [kq.encode(keys), vq.encode(values)]
        mx.eval(codes)
        dec = lambda: mx.eval(
            [kq.decode(*codes[0], mx.bfloat16), vq.decode(*codes[1], mx.bfloat16)]
        )  # noqa: E731
        report(f"tq{bits} decode 1 layer 4096", timed(dec), nbytes)


def llama8b_config() -> dict[str, Any]:
    if SMALL:
        return {
            "model_type": "llama",
            "hidden_size": 256,
            "num_hidden_layers": 2,
            "intermediate_size": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "vocab_size": 1000,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1e4,
        }
    return {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    }


@section("model")
def model_section() -> None:
    import mlx.core as mx

    from kvstore.model import build_model

    t = time.perf_counter()
    model = build_model(llama8b_config(), seed=0, dtype=mx.bfloat16)
    report("build llama8b bf16 (seeded)", time.perf_counter() - t)
    RESULTS["_model"] = model
    prompt = mx.array(
        np.random.default_rng(7).integers(0, 1000 if SMALL else 128256, (1, 4096)), mx.int32
    )

    def prefill() -> list[Any]:
        caches = model.make_cache()
        for s in range(0, 4096, 2048):
            logits = model(prompt[:, s : s + 2048], caches)
            mx.eval(logits[:, -1])
        return caches

    t = time.perf_counter()
    prefill()
    report("prefill 4096 first", time.perf_counter() - t)
    report("prefill 4096 (2048 chunks)", timed(prefill, 3))
    caches = prefill()
    RESULTS["_caches"] = caches
    step = mx.array([[5]], mx.int32)
    t = time.perf_counter()
    logits = model(step, caches)
    mx.eval(logits)
    report("forward 1 token on 4096 cache", time.perf_counter() - t)


@section("kvstore-main")
def kvstore_main() -> None:
    import shutil

    import mlx.core as mx

    from kvstore.store import open_store

    model = RESULTS["_model"]
    caches = RESULTS["_caches"]
    for c in caches:
        c.trim(1)
    tokens = np.random.default_rng(7).integers(0, 1000 if SMALL else 128256, 4096).astype(np.uint32)
    path = "/tmp/probe-store"
    shutil.rmtree(path, ignore_errors=True)
    store = open_store(f"lmdb://{path}", map_size=4 << 30)
    ns = "probe"
    t = time.perf_counter()
    store.save(ns, tokens, caches)
    report("main save 4096 (512MiB)", time.perf_counter() - t)
    query = np.concatenate([tokens, [1]]).astype(np.uint32)
    for i in range(3):
        t = time.perf_counter()
        m = store.lookup(ns, query)
        t1 = time.perf_counter()
        restored = store.restore(m, model.make_cache())
        mx.eval([c.keys for c in restored])
        t2 = time.perf_counter()
        logits = model(mx.array([[1]], mx.int32), restored)
        mx.eval(logits)
        t3 = time.perf_counter()
        report(
            f"main restore 4096 #{i}",
            t2 - t1,
            lookup_ms=round((t1 - t) * 1e3, 2),
            forward_ms=round((t3 - t2) * 1e3, 2),
        )
    store.close()
    shutil.rmtree(path, ignore_errors=True)
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    report(
        "mlx-lm save_prompt_cache 4096",
        timed(lambda: save_prompt_cache("/tmp/probe.safetensors", caches), 2),
    )
    for i in range(2):
        t = time.perf_counter()
        loaded = load_prompt_cache("/tmp/probe.safetensors")
        logits = model(mx.array([[1]], mx.int32), loaded)
        mx.eval(logits)
        report(f"mlx-lm load + forward 4096 #{i}", time.perf_counter() - t)
    os.unlink("/tmp/probe.safetensors")


@section("fresh-process")
def fresh_process() -> None:
    code = "import time; t=time.perf_counter(); import mlx.core as mx; mx.eval(mx.ones(4)+1); print(time.perf_counter()-t)"
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    report("fresh process import+first op", time.perf_counter() - t, inner_s=out.stdout.strip())


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    import mlx.core as mx

    print("mlx", mx.__version__, mx.default_device(), "cores", os.cpu_count(), flush=True)
    try:
        q = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True).stdout
        print(
            "\n".join(
                line
                for line in q.splitlines()
                if "Link" in line or "Gen" in line or "Width" in line
            )[:800]
        )
    except OSError as exc:
        print("nvidia-smi:", exc)
    for fn in (
        host,
        disk,
        pinned_section,
        kernels,
        pipeline,
        mlx_io,
        device_hash,
        turboquant,
        model_section,
        kvstore_main,
        fresh_process,
    ):
        fn()
    clean = {k: v for k, v in RESULTS.items() if not k.startswith("_")}
    with open(os.path.join(out, "probe.json"), "w") as f:
        json.dump(clean, f, indent=1, default=str)


if __name__ == "__main__":
    main()
