"""Where a small TurboQuant encode or decode spends its time on the device (P11's floor).

P11 on the H200 (``results/gpu/70b56bf/``) put a ~150 us floor under an encode of a
layer's keys and values whatever their size, against ``mx.quantize``'s ~40-50, and
~85 us under a decode against ``mx.dequantize``'s ~30; the kernels' own work at those
sizes is a few microseconds. This times the pieces one at a time, each the median of
many, on a 512-token llama-8B layer (``[1, 8, 512, 128]`` bfloat16) and a 4096-token
one:

* the evaluation's floor: ``mx.eval`` of an add on 4 bytes and on the layer;
* a custom kernel's: an empty kernel (4-byte output; a layer-sized one);
* the peers: ``mx.quantize`` / ``mx.dequantize`` of one tensor and of two;
* the encode kernel alone, then with its verdict's reduction (``cuda_rht.encoded``),
  then with the verdict read back (``tolist``), then ``encode``, ``encode_many`` of
  keys and values, and ``encode_many`` with P11's ``mx.eval`` of its results after
  (at ``774ad9e`` it also timed what could replace the checks' ``mx.any(flags,
  axis=0)``: a reduction of every byte, a maximum, a one-block OR kernel and the flags
  ORed on the host; ``results/gpu/774ad9e/floor-probe.txt``);
* a host read of a freshly computed 2-byte array, alone;
* building the encode kernel's graph without evaluating it (the Python and C++
  call path);
* the decode kernel alone, on one row, and ``decode``; an empty kernel over the
  decode's grid (a warp per row); the encode and decode kernels with the quantizer's
  tables in device memory rather than the managed memory MLX gives host data.

Run twice by ``main``: as is, and in a child with ``MLX_USE_CUDA_GRAPHS=0`` (MLX reads
it once per process)::

    python3 tools/bench/gpu/floor_probe.py
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np

from tools.bench.gpu.probe import timed, with_and_without_graphs

REPEATS = 60


def timed_us(fn: Callable[[], Any]) -> float:
    """The median microseconds of ``fn()`` (which evaluates what it must itself)."""
    return timed(fn, REPEATS, warmup=5) * 1e6


def evaluated(make: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: mx.eval(make())


def cases_of(tokens: int) -> tuple[dict[str, Callable[[], Any]], list[float]]:
    from kvstore.turboquant import cuda_rht
    from kvstore.turboquant.quantizer import FLOAT16_SCALE_LIMIT as LIMIT
    from kvstore.turboquant.quantizer import decode_many, encode_many, quantizer_for

    shape = (1, 8, tokens, 128)
    keys = mx.random.normal(shape, key=mx.random.key(1)).astype(mx.bfloat16)
    values = mx.random.normal(shape, key=mx.random.key(2)).astype(mx.bfloat16)
    tiny = mx.zeros((1,), mx.float32)
    mx.eval(keys, values, tiny)
    kq, vq = quantizer_for(4, 128, "k"), quantizer_for(4, 128, "v")
    rows = keys.reshape(-1, 128)
    assert cuda_rht._proven("encode", kq, mx.bfloat16, LIMIT), "encode kernel not proven"
    encoded = encode_many([(kq, keys, None), (vq, values, None)])
    affine = [mx.quantize(x, group_size=64, bits=4) for x in (keys, values)]
    mx.eval(encoded, affine)
    empty: Any = mx.fast.cuda_kernel(
        name="kvstore_floor_empty",
        input_names=["x"],
        output_names=["out"],
        source="if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = x[0];",
    )

    def empty_kernel(size: int, grid: tuple[int, int, int] = (32, 1, 1)) -> Any:
        return empty(
            inputs=[tiny],
            output_shapes=[(size,)],
            output_dtypes=[mx.float32],
            grid=grid,
            threadgroup=(min(grid[0], 256), 1, 1),
        )[0]

    # The keys' codes and scales as the decode kernel takes them. Its time over
    # mx.dequantize (~15-25 us at 774ad9e): against one row's, and an empty kernel's
    # over the same grid (a warp per row).
    stored_codes, stored_scales = encoded[0][0].reshape(-1, 16), encoded[0][1]
    decode_grid = cuda_rht._grid(int(rows.shape[0]))

    # The quantizer's tables (signs, thresholds, centroids) are made from host data, so
    # MLX puts them in managed memory; an op's output on the GPU's stream is device
    # memory. Do the kernels read the managed tables more slowly?
    host_made = cuda_rht._tables(kq)

    def device_copy(a: mx.array) -> mx.array:
        out = a * 1
        mx.eval(out)
        return out

    device_made = SimpleNamespace(
        signs=device_copy(host_made.signs),
        thresholds=device_copy(host_made.thresholds),
        centroids=device_copy(host_made.centroids),
    )

    def device_tables(make: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            cuda_rht._TABLES[kq] = device_made  # type: ignore[assignment]
            try:
                return mx.eval(make())
            finally:
                cuda_rht._TABLES[kq] = host_made

        return run

    def kernel_checked() -> Any:
        return cuda_rht.encoded(rows, kq, LIMIT)

    def kernel_read() -> Any:
        out = kernel_checked()
        mx.eval(out)
        return out[3].tolist()

    def kernel_host_max() -> Any:
        # Every row's verdict read back and reduced on the host: no reduction on the
        # device (is reading 4096 bytes back cheaper than mx.max's ~20 us?).
        made, verdicts = cuda_rht._encode([(rows, kq)], LIMIT)
        mx.eval(made, verdicts)
        return int(np.asarray(verdicts).max())

    def host_read() -> Any:
        small = (tiny + 1).astype(mx.uint16)
        mx.eval(small)
        t = time.perf_counter()
        small.tolist()
        return time.perf_counter() - t

    reads: list[float] = []

    def per_layer(layers: int) -> Callable[[], Any]:
        # Many launches in one evaluation: what a launch costs the device, without the
        # evaluation's floor (is a 512-token layer's kernel ~5 us of work or ~40?).
        tensors = [(rows, kq), (values.reshape(-1, 128), vq)]

        return evaluated(lambda: [cuda_rht._encode(tensors, LIMIT) for _ in range(layers)])

    pair_inputs = [x for t in ((rows, kq), (values.reshape(-1, 128), vq)) for x in _pair_inputs(*t)]
    pair_empty: Any = mx.fast.cuda_kernel(
        name="kvstore_floor_pair_empty",
        input_names=[f"in{i}" for i in range(len(pair_inputs))],
        output_names=[f"out{i}" for i in range(7)],
        source="if (threadIdx.x == 0 && blockIdx.x == 0) out6[0] = 0;",
    )

    def pair_shaped_empty() -> Any:
        lead = (int(rows.shape[0]),)
        return pair_empty(
            inputs=pair_inputs,
            output_shapes=[(*lead, 16), lead, lead, (*lead, 16), lead, lead, (2 * lead[0],)],
            output_dtypes=[mx.uint32, mx.float32, mx.float16] * 2 + [mx.uint8],
            grid=cuda_rht._grid(2 * lead[0]),
            threadgroup=(256, 1, 1),
        )

    def host_read_only() -> None:
        reads.append(host_read())

    def p11_encode() -> None:
        mx.eval(encode_many([(kq, keys, None), (vq, values, None)]))

    return {
        "eval: add on 4 bytes": evaluated(lambda: tiny + 1),
        "eval: add on the layer": evaluated(lambda: keys + 1),
        "empty kernel, 4-byte output": evaluated(lambda: empty_kernel(1)),
        "empty kernel, layer-sized output": evaluated(lambda: empty_kernel(rows.size)),
        "mx.quantize keys": evaluated(lambda: mx.quantize(keys, group_size=64, bits=4)),
        "mx.quantize keys+values": evaluated(
            lambda: [mx.quantize(x, group_size=64, bits=4) for x in (keys, values)]
        ),
        "mx.dequantize keys": evaluated(lambda: mx.dequantize(*affine[0], group_size=64, bits=4)),
        "mx.dequantize keys+values": evaluated(
            lambda: [mx.dequantize(*a, group_size=64, bits=4) for a in affine]
        ),
        "encode kernel alone (keys)": evaluated(lambda: cuda_rht._encode([(rows, kq)], LIMIT)),
        "encode kernel, keys+values in one launch": evaluated(
            lambda: cuda_rht._encode([(rows, kq), (values.reshape(-1, 128), vq)], LIMIT)
        ),
        "encode kernels, keys and values apart": evaluated(
            lambda: [
                cuda_rht._encode([(rows, kq)], LIMIT),
                cuda_rht._encode([(values.reshape(-1, 128), vq)], LIMIT),
            ]
        ),
        "kernel + verdict (encoded)": evaluated(kernel_checked),
        "kernel + verdict + read": kernel_read,
        "kernel + every row's verdict read (host max)": kernel_host_max,
        "build the kernel's graph only": lambda: cuda_rht._encode([(rows, kq)], LIMIT),
        "encode (keys)": lambda: kq.encode(keys),
        "encode_many keys+values": lambda: encode_many([(kq, keys, None), (vq, values, None)]),
        "encode_many + P11's eval": p11_encode,
        "decode kernel alone (keys)": evaluated(
            lambda: cuda_rht._decode([(stored_codes, stored_scales, kq, mx.bfloat16)])
        ),
        "decode kernel, keys+values in one launch": evaluated(
            lambda: cuda_rht._decode(
                [
                    (stored_codes, stored_scales, kq, mx.bfloat16),
                    (encoded[1][0].reshape(-1, vq.words), encoded[1][1], vq, mx.bfloat16),
                ]
            )
        ),
        "decode_many keys+values": evaluated(
            lambda: decode_many(
                [(kq, *encoded[0], mx.bfloat16, None), (vq, *encoded[1], mx.bfloat16, None)]
            )
        ),
        "decode kernel, tables in device memory": device_tables(
            lambda: cuda_rht._decode([(stored_codes, stored_scales, kq, mx.bfloat16)])
        ),
        "encode kernel, tables in device memory": device_tables(
            lambda: cuda_rht._encode([(rows, kq)], LIMIT)
        ),
        "empty kernel over the decode's grid": evaluated(lambda: empty_kernel(1, decode_grid)),
        "decode kernel, one row": evaluated(
            lambda: cuda_rht._decode(
                [(stored_codes[:1], stored_scales.reshape(-1)[:1], kq, mx.bfloat16)]
            )
        ),
        "encode kernel, one row of each": evaluated(
            lambda: cuda_rht._encode([(rows[:1], kq), (values.reshape(-1, 128)[:1], vq)], LIMIT)
        ),
        "encode kernel + verdict, keys+values": evaluated(
            lambda: mx.max(cuda_rht._encode([(rows, kq), (values.reshape(-1, 128), vq)], LIMIT)[1])
        ),
        "16 layers' encode kernels in one evaluation (all)": per_layer(16),
        "empty kernel, the pair encode's inputs and outputs": evaluated(pair_shaped_empty),
        "decode (keys)": evaluated(lambda: kq.decode(*encoded[0], mx.bfloat16)),
        "decode keys+values": evaluated(
            lambda: [kq.decode(*encoded[0], mx.bfloat16), vq.decode(*encoded[1], mx.bfloat16)]
        ),
        "host read of 2 bytes (the whole step)": host_read_only,
    }, reads


def _pair_inputs(x: mx.array, q: Any) -> list[mx.array]:
    from kvstore.turboquant import cuda_rht

    t = cuda_rht._tables(q)
    return [x, t.signs, t.thresholds, t.centroids]


def probe() -> None:
    graphs = os.environ.get("MLX_USE_CUDA_GRAPHS", "(default)")
    print(f"device {mx.default_device()}; MLX_USE_CUDA_GRAPHS={graphs}", flush=True)
    for tokens in (512, 4096):
        cases, reads = cases_of(tokens)
        times: dict[str, list[float]] = {}
        for _ in range(3):  # interleaved rounds
            for name, fn in cases.items():
                times.setdefault(name, []).append(timed_us(fn))
        for name, samples in times.items():
            print(f"  {tokens:5d} tokens  {name:40s} {min(samples):8.1f} us", flush=True)
        print(
            f"  {tokens:5d} tokens  {'host read of 2 bytes (tolist alone)':40s} "
            f"{statistics.median(reads) * 1e6:8.1f} us",
            flush=True,
        )


def main() -> int:
    return with_and_without_graphs(probe, __file__)


if __name__ == "__main__":
    raise SystemExit(main())
