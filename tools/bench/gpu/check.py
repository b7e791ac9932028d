"""Before the GPU figures: the CUDA paths this checkout relies on, checked on the device.

    python3 tools/bench/gpu/check.py

Prints one line per check (staging round trip, a restore through staging equal
to its record, a save's records equal to encode_record's, the row-digest kernel
equal to xxhash) and exits 1 if any fails, so run.sh stops before measuring a
path that is not the one meant. Falling back is not failing: a path that is off
says so (``staging False``) and the figures then measure the fallback.
"""

from __future__ import annotations

import sys
import time

import mlx.core as mx
import numpy as np


def main() -> int:
    from kvstore.bridge import digests
    from kvstore.caches import KVCache
    from kvstore.codecs import codec_for, cuda
    from kvstore.codecs.arena import write_records
    from kvstore.codecs.record import encode_record, plan_record

    failed = 0
    print(f"mlx {mx.__version__} {mx.default_device()}", flush=True)
    t = time.perf_counter()
    staging = cuda.available()
    print(f"staging {staging} ({(time.perf_counter() - t) * 1e3:.0f} ms to check)", flush=True)
    cache = KVCache()
    rows = mx.random.normal((1, 8, 700, 128)).astype(mx.bfloat16)
    cache.update_and_fetch(rows, rows * 3)
    codec = codec_for(cache)
    layers = [[codec.snapshot(cache, s, min(700, s + 256))] for s in (0, 256, 512)]
    got = [bytes(r) for r in write_records([plan_record(layer) for layer in layers])]
    ok = got == [encode_record(layer) for layer in layers]
    failed += not ok
    print(f"records via the arena == encode_record: {ok}", flush=True)
    specs = [((1, 8, 768, 128), "bfloat16"), ((3, 5), "float32"), ((1001,), "uint8")]
    from kvstore.codecs.fill import filled_arrays

    sizes = [int(np.prod(s)) * (2 if n == "bfloat16" else np.dtype(n).itemsize) for s, n in specs]
    # Finite float bit patterns (a NaN's bits need not survive a float view).
    want = [
        np.random.default_rng(i).integers(0, 64, n, dtype=np.uint8) for i, n in enumerate(sizes)
    ]

    def fill(i: int, view: np.ndarray) -> None:
        view.reshape(-1).view(np.uint8)[:] = want[i]

    arrays = filled_arrays(specs, fill)
    ok = all(
        np.array_equal(np.asarray(a.reshape(-1).view(mx.uint8)), w)
        for a, w in zip(arrays, want, strict=True)
    )
    failed += not ok
    print(f"filled arrays (staged: {staging}) bit-exact: {ok}", flush=True)
    probe = mx.random.randint(0, 255, (3 * digests.ROW_BYTES + 777,), dtype=mx.uint8)
    mx.eval(probe)
    t = time.perf_counter()
    device = digests.array_digests([probe])
    elapsed = time.perf_counter() - t
    host = digests._host_digests([memoryview(np.asarray(probe))])
    ok = device == host
    failed += not ok
    kernel = digests._kernel() is not False
    print(f"row digests here == host: {ok} (kernel {kernel}, {elapsed * 1e3:.0f} ms)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
