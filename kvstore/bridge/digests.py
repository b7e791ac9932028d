"""Content digests of in-memory arrays (model parameters), computed where the arrays are.

A parameter's digest is defined on its bytes (C order) cut into rows of
:data:`ROW_BYTES` (1 MiB), the last one zero-padded to a full row: each row is
hashed with XXH3-128 (seed 0), and the parameter's digest is XXH3-128 of the
rows' canonical 16-byte digests, in order. Rows make the work parallel
without changing what is hashed: on the CPU (and Apple's unified memory) every
core takes rows, and on a CUDA GPU a kernel hashes every row at once in device
memory, so an 8B model's 16 GB are never copied to the host (copying them
was what made fingerprinting such a model take 8 s on an H200: any host
access to a device array moves its whole buffer to managed memory first).

The kernel is a transcription of XXH3's long-input path for exactly one row
(XXH3-128 with the default secret); before it is trusted in a process it
hashes random rows next to the ``xxhash`` library and is dropped if they
differ, so a digest never depends on where it was computed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np
import xxhash

from kvstore.cuda_kernel import cuda_kernel
from kvstore.threads import cores

__all__ = ["ROW_BYTES", "array_digests", "row_digests_host"]

#: Bytes per hashed row.
ROW_BYTES = 1 << 20
#: The most bytes one launch of the row-digest kernel hashes (whole rows).
LAUNCH_BYTES = 1 << 30

_SECRET = (
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)

_HEADER = """
#define KVS_P32_1 0x9E3779B1ULL
#define KVS_P32_2 0x85EBCA77ULL
#define KVS_P32_3 0xC2B2AE3DULL
#define KVS_P64_1 0x9E3779B185EBCA87ULL
#define KVS_P64_2 0xC2B2AE3D27D4EB4FULL
#define KVS_P64_3 0x165667B19E3779F9ULL
#define KVS_P64_4 0x85EBCA77C2B2AE63ULL
#define KVS_P64_5 0x27D4EB2F165667C5ULL
#define KVS_ROW %(row)dULL
__constant__ unsigned char kvs_secret[192] = {%(secret)s};
__device__ __forceinline__ unsigned long long kvs_sec64(int o) {
    unsigned long long v = 0;
    #pragma unroll
    for (int k = 0; k < 8; ++k) v |= (unsigned long long)kvs_secret[o + k] << (8 * k);
    return v;
}
__device__ __noinline__ unsigned long long kvs_load_tail(
        const unsigned char* p, unsigned long long off, unsigned long long avail) {
    unsigned long long v = 0;
    for (int k = 0; k < 8; ++k)
        if (off + k < avail) v |= (unsigned long long)p[off + k] << (8 * k);
    return v;
}
__device__ __forceinline__ unsigned long long kvs_load(
        const unsigned char* p, unsigned long long off, unsigned long long avail, bool fast) {
    if (fast) return *reinterpret_cast<const unsigned long long*>(p + off);
    return kvs_load_tail(p, off, avail);
}
__device__ __forceinline__ unsigned long long kvs_fold(unsigned long long a, unsigned long long b) {
    return (a * b) ^ __umul64hi(a, b);
}
__device__ __forceinline__ unsigned long long kvs_avalanche(unsigned long long h) {
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    return h ^ (h >> 32);
}
"""

_BODY = """
    unsigned long long n = params[0];
    unsigned long long rows = (n + KVS_ROW - 1) / KVS_ROW;
    unsigned long long r = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const unsigned char* base = reinterpret_cast<const unsigned char*>(inp) + r * KVS_ROW;
    unsigned long long avail = n - r * KVS_ROW;
    bool fast = avail >= KVS_ROW && ((reinterpret_cast<unsigned long long>(base) & 7ULL) == 0);
    unsigned long long acc[8] = {KVS_P32_3, KVS_P64_1, KVS_P64_2, KVS_P64_3,
                                 KVS_P64_4, KVS_P32_2, KVS_P64_5, KVS_P32_1};
    unsigned long long sk[24];
    #pragma unroll
    for (int i = 0; i < 24; ++i) sk[i] = kvs_sec64(8 * i);
    const unsigned long long blocks = (KVS_ROW - 1) / 1024;
    for (unsigned long long b = 0; b < blocks; ++b) {
        #pragma unroll
        for (int s = 0; s < 16; ++s) {
            #pragma unroll
            for (int i = 0; i < 8; ++i) {
                unsigned long long v = kvs_load(base, b * 1024 + s * 64 + 8 * i, avail, fast);
                unsigned long long k = v ^ sk[s + i];
                acc[i ^ 1] += v;
                acc[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
            }
        }
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
            unsigned long long a = acc[i];
            a ^= a >> 47;
            a ^= sk[16 + i];
            acc[i] = a * KVS_P32_1;
        }
    }
    const int last = (int)(((KVS_ROW - 1) - 1024 * blocks) / 64);
    #pragma unroll
    for (int s = 0; s < 16; ++s) {
        if (s < last) {
            #pragma unroll
            for (int i = 0; i < 8; ++i) {
                unsigned long long v = kvs_load(base, blocks * 1024 + s * 64 + 8 * i, avail, fast);
                unsigned long long k = v ^ sk[s + i];
                acc[i ^ 1] += v;
                acc[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
            }
        }
    }
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        unsigned long long v = kvs_load(base, KVS_ROW - 64 + 8 * i, avail, fast);
        unsigned long long k = v ^ kvs_sec64(192 - 64 - 7 + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
    }
    unsigned long long lo = KVS_ROW * KVS_P64_1;
    unsigned long long hi = ~(KVS_ROW * KVS_P64_2);
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        unsigned long long a = acc[2 * i], b = acc[2 * i + 1];
        lo += kvs_fold(a ^ kvs_sec64(11 + 16 * i), b ^ kvs_sec64(19 + 16 * i));
        hi += kvs_fold(a ^ kvs_sec64(117 + 16 * i), b ^ kvs_sec64(125 + 16 * i));
    }
    out[2 * r] = kvs_avalanche(lo);
    out[2 * r + 1] = kvs_avalanche(hi);
"""

_KERNEL_LOCK = threading.Lock()
_POOL_LOCK = threading.Lock()
_KERNEL: Any = None  # None: not tried yet; False: not usable here
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(min(16, cores()), thread_name_prefix="kvstore-digest")
        return _POOL


def row_digests_host(data: memoryview) -> bytes:
    """The rows' canonical digests of ``data`` (the definition, on the CPU)."""
    out = []
    for start in range(0, max(len(data), 1), ROW_BYTES):
        row = data[start : start + ROW_BYTES]
        if len(row) < ROW_BYTES:
            row = memoryview(bytes(row) + bytes(ROW_BYTES - len(row)))
        out.append(xxhash.xxh3_128_digest(row))
    return b"".join(out)


def _host_digests(views: Sequence[memoryview]) -> list[str]:
    """Every array's digest, the rows spread over every core (xxhash releases the GIL)."""
    jobs = []
    for k, view in enumerate(views):
        rows = max(1, -(-len(view) // ROW_BYTES))
        step = max(1, rows // (4 * cores()) + 1)
        for first in range(0, rows, step):
            jobs.append((k, first, view[first * ROW_BYTES : (first + step) * ROW_BYTES]))
    parts = list(_pool().map(lambda job: row_digests_host(job[2]), jobs))
    joined: dict[int, list[bytes]] = {}
    for (k, _, _), part in zip(jobs, parts, strict=True):
        joined.setdefault(k, []).append(part)
    return [xxhash.xxh3_128_hexdigest(b"".join(joined[k])) for k in range(len(views))]


def _kernel() -> Any:
    """The CUDA row-digest kernel, checked against ``xxhash`` once; False if unusable."""
    global _KERNEL
    with _KERNEL_LOCK:
        if _KERNEL is None:
            _KERNEL = False
            try:
                from kvstore.devices import default_is_cuda  # imports MLX: only here

                if default_is_cuda():
                    _KERNEL = checked_kernel(_build_kernel())
            except Exception:  # noqa: BLE001 - any failure means: hash on the host
                _KERNEL = False
        return _KERNEL


def _build_kernel() -> Any:
    secret = ", ".join(f"0x{_SECRET[i : i + 2]}" for i in range(0, len(_SECRET), 2))
    return cuda_kernel(
        name="kvstore_row_digests",
        input_names=["params", "inp"],
        output_names=["out"],
        source=_BODY,
        header=_HEADER % {"row": ROW_BYTES, "secret": secret},
    )


def checked_kernel(kernel: Any) -> Any:
    """``kernel`` if it hashes random rows (a partial last one too) as ``xxhash`` does,
    else False. Computed here on one thread: the caller may hold a lock."""
    import mlx.core as mx

    probe = np.random.default_rng(0).integers(0, 256, 3 * ROW_BYTES + 4099, dtype=np.uint8)
    want = xxhash.xxh3_128_hexdigest(row_digests_host(memoryview(cast(Any, probe))))
    return kernel if _device_digests(kernel, [mx.array(probe)]) == [want] else False


def _device_digests(kernel: Any, arrays: Sequence[Any]) -> list[str]:
    import mlx.core as mx

    outs = []
    for array in arrays:
        flat = mx.contiguous(array).reshape(-1)
        # At most LAUNCH_BYTES (whole rows) a launch: MLX aborts the process on a kernel
        # input of 2**31 bytes or more (a 70B model's embedding is 2.1 GB).
        step = LAUNCH_BYTES // flat.itemsize
        parts = []
        for start in range(0, max(int(flat.size), 1), step):
            part = flat[start : start + step].view(mx.uint8)
            n = int(part.size)
            rows = max(1, -(-n // ROW_BYTES))
            params = mx.array(np.array([n], np.uint64))
            (out,) = kernel(
                inputs=[params, part],
                output_shapes=[(2 * rows,)],
                output_dtypes=[mx.uint64],
                grid=(-(-rows // 128) * 128, 1, 1),
                threadgroup=(128, 1, 1),
            )
            parts.append(out)
        outs.append(parts[0] if len(parts) == 1 else mx.concatenate(parts))
    words = np.asarray(mx.concatenate(outs)) if outs else np.zeros(0, np.uint64)
    digests, at = [], 0
    for out in outs:
        pairs = words[at : at + out.size].reshape(-1, 2)
        at += out.size
        canonical = np.empty_like(pairs, dtype=">u8")
        canonical[:, 0], canonical[:, 1] = pairs[:, 1], pairs[:, 0]
        digests.append(xxhash.xxh3_128_hexdigest(canonical.tobytes()))
    return digests


def array_digests(arrays: Sequence[Any]) -> list[str]:
    """The digest (hex) of each of ``arrays`` (evaluated ``mx.array`` s), as defined above.

    On a CUDA GPU the rows are hashed on the device; elsewhere on every core.
    """
    import mlx.core as mx

    if not arrays:
        return []
    kernel = _kernel()
    if kernel is not False:
        return _device_digests(kernel, arrays)
    views = []
    for array in arrays:
        contiguous = mx.contiguous(array)
        mx.eval(contiguous)
        # MLX arrays export the buffer protocol (the stubs do not say so).
        views.append(memoryview(cast(Any, contiguous)).cast("B"))
    return _host_digests(views)
