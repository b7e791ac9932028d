"""What a launch costs on each kernel route: ``kvstore.cuda_kernel``'s precompiled one
(``mx.fast.precompiled_cuda_kernel``) against MLX's (``mx.fast.cuda_kernel``).

    python3 tools/bench/gpu/route_probe.py [--launches 12] [--rounds 200]

At ``d134447`` a fresh-process ``kv:quant:8:64`` restore was 0.5 and 2.0 ms slower on the
precompiled route in two runs, its thread faulting ~200 more pages
(``results/gpu/precompiled-h100/ab-route.txt``). This launches the staging transport's
``gather_many`` (64 outputs, its largest cubin) and ``upload`` kernels, ``--launches`` per
evaluation as a restore's spans do, on each route in turn, and prints per launch: the
Python call, the evaluation, the thread's CPU and its minor page faults.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from typing import Any

import mlx.core as mx
import numpy as np


def _thread_usage() -> tuple[float, int]:
    u = resource.getrusage(resource.RUSAGE_THREAD)
    return u.ru_utime + u.ru_stime, u.ru_minflt


def measure(kernel: Any, make_call: Any, launches: int, rounds: int) -> dict[str, float]:
    calls, evals, cpus, faults = [], [], [], []
    for _ in range(rounds + 5):
        cpu0, f0 = _thread_usage()
        t0 = time.perf_counter()
        outs = [make_call(kernel) for _ in range(launches)]
        t1 = time.perf_counter()
        mx.eval(outs)
        t2 = time.perf_counter()
        cpu1, f1 = _thread_usage()
        calls.append((t1 - t0) / launches)
        evals.append((t2 - t1) / launches)
        cpus.append((cpu1 - cpu0) / launches)
        faults.append((f1 - f0) / launches)
    keep = slice(5, None)  # the first rounds build and load
    return {
        "call_us": statistics.median(calls[keep]) * 1e6,
        "eval_us": statistics.median(evals[keep]) * 1e6,
        "cpu_us": statistics.median(cpus[keep]) * 1e6,
        "faults": statistics.mean(faults[keep]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    from kvstore.codecs import cuda

    zeros = mx.array(np.array([1, 0, 0, 0, 0, 0, 0], np.uint64))  # one segment, src 0: zeros

    def gather_many(kernel: Any) -> Any:
        return kernel(
            inputs=[zeros],
            output_shapes=[(4096,)] * cuda.GATHER_OUTPUTS,
            output_dtypes=[mx.uint8] * cuda.GATHER_OUTPUTS,
            grid=(256 * 4, 1, 1),
            threadgroup=(256, 1, 1),
        )

    slot = cuda.KernelTransport().slot(1 << 20)
    upload_params = mx.array(np.array([slot.device_pointer, 4096], np.uint64))

    def upload(kernel: Any) -> Any:
        return kernel(
            inputs=[upload_params],
            output_shapes=[(4096,)],
            output_dtypes=[mx.uint8],
            grid=(256 * 4, 1, 1),
            threadgroup=(256, 1, 1),
        )

    for route in ("precompiled", "mlx", "precompiled", "mlx"):
        os.environ["KVSTORE_CUDA_PRECOMPILED"] = "1" if route == "precompiled" else "0"
        kernels = cuda.transport_kernels()  # fresh objects: each builds on its route
        for name, call in (("gather_many", gather_many), ("upload", upload)):
            r = measure(kernels[name], call, args.launches, args.rounds)
            print(
                f"{route:12s} {name:12s} call {r['call_us']:7.1f} us  eval {r['eval_us']:7.1f} us"
                f"  cpu {r['cpu_us']:7.1f} us  faults {r['faults']:.2f} a launch",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
