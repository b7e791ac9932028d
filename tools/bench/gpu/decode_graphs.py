"""What building the decode graphs ahead costs (``kvstore serve --warm-decode``).

    python3 tools/bench/gpu/decode_graphs.py [--up-to 256,512,768,4096,4096] [--quick]

In a fresh process: the llama-8B-shaped reference model, the server's warm-up
(:func:`kvstore.serve.warmup.build_kernels`) timed, then
:func:`~kvstore.serve.warmup.build_decode_graphs` up to each of ``--up-to`` in turn,
timed: a size met before costs its decode step alone, a new one the graph cuDNN builds
for it too (the sizes repeat from 256 each call, so the differences say which).
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--up-to", default="256,512,768,4096,4096")
    parser.add_argument("--quick", action="store_true", help="the tiny stand-in (a CPU)")
    args = parser.parse_args()

    from kvstore.bench.figures.gpu_common import LLAMA8B, TINY, build
    from kvstore.serve.warmup import build_decode_graphs, build_kernels

    model = build(TINY if args.quick else LLAMA8B)
    mx.eval(model.parameters())
    start = time.perf_counter()
    build_kernels(model)
    mx.synchronize()
    print(f"warm-up (build_kernels): {(time.perf_counter() - start) * 1e3:.0f} ms", flush=True)
    for up_to in (int(n) for n in args.up_to.split(",")):
        start = time.perf_counter()
        sizes = build_decode_graphs(model, up_to)
        mx.synchronize()
        took = (time.perf_counter() - start) * 1e3
        print(f"up_to {up_to}: {sizes} sizes in {took:.0f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
