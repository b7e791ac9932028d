"""P11: TurboQuant encode/decode throughput against ``mx.quantize``/``mx.dequantize``.

Same tensors for both: one layer's keys and values of the ``llama8b`` workload
(8 KV heads, head_dim 128, bfloat16, seeded Gaussian) at each prompt length.
Encode is keys and values through their TurboQuant quantizers (default scale
modes: keys ``matched``, values ``ls``; codes packed, scales float16) against
``mx.quantize(.., group_size=64, bits=4)`` of both; decode is back to bfloat16
against ``mx.dequantize``. Repetitions are interleaved (every candidate once per
round), each timed to ``mx.eval``; the figure is the median ratio of the peer's
time to ours (>= 1 means as fast as MLX affine 4-bit), bar >= 0.5.

Run: ``python -m tools.bench.turboquant_speed [--tokens 512 4096] [--repeats 9]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from kvstore.turboquant.quantizer import quantizer_for

HERE = Path(__file__).resolve().parent
BAR = 0.5
HEADS, HEAD_DIM, GROUP = 8, 128, 64


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - start


def _candidates(tokens: int, bits: tuple[int, ...]) -> dict[str, Callable[[], Any]]:
    shape = (1, HEADS, tokens, HEAD_DIM)
    k = mx.random.normal(shape, key=mx.random.key(1)).astype(mx.bfloat16)
    v = mx.random.normal(shape, key=mx.random.key(2)).astype(mx.bfloat16)
    affine = [mx.quantize(x, group_size=GROUP, bits=4) for x in (k, v)]
    scale = HEAD_DIM**-0.5
    fns: dict[str, Callable[[], Any]] = {
        "mx.quantize 4/64": lambda: [mx.quantize(x, group_size=GROUP, bits=4) for x in (k, v)],
        "mx.dequantize 4/64": lambda: [mx.dequantize(*a, group_size=GROUP, bits=4) for a in affine],
        # The floor of any RHT codec built from MLX ops: the float32 Hadamard alone.
        "fwht only": lambda: [
            mx.hadamard_transform(x.astype(mx.float32), scale=scale) for x in (k, v)
        ],
    }
    for b in bits:
        kq, vq = quantizer_for(b, HEAD_DIM, "k"), quantizer_for(b, HEAD_DIM, "v")
        encoded = [kq.encode(k), vq.encode(v)]
        mx.eval(encoded)
        fns[f"tq{b}/{b} encode"] = lambda kq=kq, vq=vq: [kq.encode(k), vq.encode(v)]
        fns[f"tq{b}/{b} decode"] = lambda kq=kq, vq=vq, e=encoded: [
            kq.decode(*e[0], mx.bfloat16),
            vq.decode(*e[1], mx.bfloat16),
        ]
    mx.eval(k, v, affine)
    return fns


def measure(tokens: int, repeats: int, bits: tuple[int, ...]) -> dict[str, list[float]]:
    """Raw seconds per candidate, interleaved over ``repeats`` rounds (after one warm-up)."""
    fns = _candidates(tokens, bits)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: compile kernels, fault pages in
        _timed(fn)
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(_timed(fn))
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.turboquant_speed", description=__doc__
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 3, 2])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "p11_turboquant_speed.json")
    args = parser.parse_args(argv)
    if args.repeats < 5:
        parser.error("--repeats must be >= 5 (the figure is a median of >= 5)")
    mx.set_default_device(mx.cpu)
    rows, raw = [], {}
    for tokens in args.tokens:
        samples = measure(tokens, args.repeats, tuple(args.bits))
        raw[str(tokens)] = samples
        median = {name: statistics.median(s) for name, s in samples.items()}
        for b in args.bits:
            for op, peer in (("encode", "mx.quantize 4/64"), ("decode", "mx.dequantize 4/64")):
                ours = median[f"tq{b}/{b} {op}"]
                rows.append(
                    {
                        "tokens": tokens,
                        "config": f"tq{b}/{b}",
                        "op": op,
                        "ours_ms": ours * 1e3,
                        "peer_ms": median[peer] * 1e3,
                        "tokens_per_s": tokens / ours,
                        "ratio": median[peer] / ours,
                    }
                )
    for tokens in args.tokens:
        fwht = statistics.median(raw[str(tokens)]["fwht only"])
        peer = statistics.median(raw[str(tokens)]["mx.quantize 4/64"])
        rows.append(
            {
                "tokens": tokens,
                "config": "fwht",
                "op": "floor",
                "ours_ms": fwht * 1e3,
                "peer_ms": peer * 1e3,
                "tokens_per_s": tokens / fwht,
                "ratio": peer / fwht,
            }
        )
    print(
        f"{'tokens':>6} {'config':>7} {'op':>6} {'ours ms':>9} {'peer ms':>9} "
        f"{'tok/s':>10} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['tokens']:>6} {r['config']:>7} {r['op']:>6} {r['ours_ms']:>9.2f} "
            f"{r['peer_ms']:>9.2f} {r['tokens_per_s']:>10.0f} {r['ratio']:>6.2f}"
        )
    headline = [r for r in rows if r["config"] == "tq4/4" and r["tokens"] == max(args.tokens)]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "figure": "P11",
                "bar": BAR,
                "workload": f"llama8b layer: 1 x {HEADS} x T x {HEAD_DIM} bfloat16, K and V",
                "mlx": mx.__version__,
                "machine": platform.machine(),
                "blas": "OpenBLAS (LD_PRELOAD)"
                if "openblas" in os.environ.get("LD_PRELOAD", "")
                else "MLX bundled",
                "repeats": args.repeats,
                "rows": rows,
                "raw_seconds": raw,
            },
            indent=1,
        )
        + "\n"
    )
    summary = ", ".join(
        f"{r['op']} {r['ratio']:.2f}x ({'meets' if r['ratio'] >= BAR else 'below'} {BAR})"
        for r in headline
    )
    print(f"P11 tq4/4 vs mx 4-bit g64 at {max(args.tokens)} tokens: {summary}", file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
