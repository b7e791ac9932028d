"""TurboQuant's one-kernel encode and decode (kvstore/turboquant/cuda_rht.py) on the device.

For each width and kind: whether each kernel is proven (builds, agrees with the
ops), how the kernel's encode of one llama-8B layer of 4096 tokens compares
with the ops' (cells that differ, scale error; its decode's error), and the
times, interleaved, against ``mx.quantize``/``mx.dequantize`` 4-bit g64 of the
same rows (P11's peer) and against the ops (``KVSTORE_TQ_RHT_KERNEL=0``)::

    python3 tools/bench/gpu/rht_probe.py
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from kvstore.turboquant import cuda_rht
from kvstore.turboquant.packing import unpack_indices
from kvstore.turboquant.quantizer import FLOAT16_SCALE_LIMIT as LIMIT
from kvstore.turboquant.quantizer import quantizer_for


def timed(fn: Callable[[], Any], repeats: int = 20) -> float:
    mx.eval(fn())
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e3


def with_kernels(on: bool, fn: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        os.environ[cuda_rht.ENV] = "1" if on else "0"
        try:
            out = fn()
            mx.eval(out)
            return out
        finally:
            os.environ[cuda_rht.ENV] = "1"

    return run


def main() -> int:
    print(f"device {mx.default_device()}; cuda {mx.cuda.is_available()}", flush=True)
    shape = (1, 8, 4096, 128)
    keys = mx.random.normal(shape, key=mx.random.key(1)).astype(mx.bfloat16)
    values = mx.random.normal(shape, key=mx.random.key(2)).astype(mx.bfloat16)
    mx.eval(keys, values)
    for bits in (4, 3, 2):
        kq, vq = quantizer_for(bits, 128, "k"), quantizer_for(bits, 128, "v")
        for q, x in ((kq, keys), (vq, values)):
            try:
                proofs = {
                    "encode bf16": cuda_rht._proven("encode", q, mx.bfloat16, LIMIT),
                    "decode bf16 (f16 scales)": cuda_rht._proven(
                        "decode", q, mx.bfloat16, mx.float16
                    ),
                    "decode f32 (f32 scales)": cuda_rht._proven(
                        "decode", q, mx.float32, mx.float32
                    ),
                }
            except Exception:  # noqa: BLE001 - say why and go on
                traceback.print_exc()
                proofs = {}
            print(f"tq{bits} {q.kind} ({q.scale_mode}): proven {proofs}", flush=True)
            try:
                rows = x.reshape(-1, 128)
                (fused,), _ = cuda_rht._encode([(rows, q)], LIMIT)
                idx, scale, _ = q.quantize(rows)
                got = unpack_indices(fused[0], bits, 128)
                mx.eval(fused, idx, scale, got)
                differ = float(mx.mean((got != idx).astype(mx.float32)).item())
                rel = float(mx.max(mx.abs(fused[1] - scale) / mx.abs(scale)).item())
                (dec,) = cuda_rht._decode([(fused[0], fused[1], q, mx.float32)])
                table = mx.take(q.centroids, got.astype(mx.uint32))
                ref = q.rotation.inverse(table * fused[1].reshape(-1, 1))
                err = float(mx.max(mx.abs(dec - ref)).item())
                print(
                    f"  4096 tokens: cells differing {differ:.2e}, scale rel err max {rel:.2e}, "
                    f"decode max abs err {err:.2e}",
                    flush=True,
                )
            except Exception:  # noqa: BLE001
                traceback.print_exc()
        try:
            pair = [(keys.reshape(-1, 128), kq), (values.reshape(-1, 128), vq)]
            together = cuda_rht._proven_together(pair, LIMIT)
        except Exception:  # noqa: BLE001 - say why and go on
            traceback.print_exc()
            together = False
        print(f"tq{bits} keys and values in one launch: proven {together}", flush=True)
        try:
            stored = [kq.encode(keys), vq.encode(values)]
            decode_pair = [
                (codes.reshape(-1, q.words), scales, q, mx.bfloat16)
                for (codes, scales), q in zip(stored, (kq, vq))
            ]
            decoded_together = cuda_rht._proven_decode_together(decode_pair)
        except Exception:  # noqa: BLE001 - say why and go on
            traceback.print_exc()
            decoded_together = False
        print(f"tq{bits} keys and values decoded in one launch: proven {decoded_together}")
        times_of(bits, kq, vq, keys, values)
    return 0


def times_of(bits: int, kq: Any, vq: Any, keys: mx.array, values: mx.array) -> None:
    """The interleaved times of one width's cases, and the ratios P11 takes."""
    affine = [mx.quantize(x, group_size=64, bits=4) for x in (keys, values)]
    encoded = [kq.encode(keys), vq.encode(values)]
    mx.eval(affine, encoded)

    def encode() -> Any:
        return [kq.encode(keys), vq.encode(values)]

    def decode() -> Any:
        return [kq.decode(*encoded[0], mx.bfloat16), vq.decode(*encoded[1], mx.bfloat16)]

    cases = {
        "mx.quantize 4/64": lambda: [mx.quantize(x, group_size=64, bits=4) for x in (keys, values)],
        "mx.dequantize 4/64": lambda: [mx.dequantize(*a, group_size=64, bits=4) for a in affine],
        "encode kernel": with_kernels(True, encode),
        "encode ops": with_kernels(False, encode),
        "decode kernel": with_kernels(True, decode),
        "decode ops": with_kernels(False, decode),
    }
    times = {}
    for _ in range(2):  # interleaved rounds
        for name, fn in cases.items():
            try:
                times.setdefault(name, []).append(timed(fn))
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    med = {k: min(v) for k, v in times.items()}
    for name, ms in med.items():
        print(f"  tq{bits} {name:22s} {ms:8.3f} ms", flush=True)
    if len(med) == len(cases):
        quant, dequant = med["mx.quantize 4/64"], med["mx.dequantize 4/64"]
        print(
            f"  tq{bits} encode vs mx.quantize {quant / med['encode kernel']:.3f}x "
            f"(ops {quant / med['encode ops']:.3f}x); decode vs mx.dequantize "
            f"{dequant / med['decode kernel']:.3f}x (ops {dequant / med['decode ops']:.3f}x)",
            flush=True,
        )


if __name__ == "__main__":
    raise SystemExit(main())
