"""A decode step's attention over quantized caches, by route, on the default device.

    python3 tools/bench/gpu/qdecode_probe.py [--rows 4096] [--layers 32] [--repeats 50]

The llama-8B shape (8 KV heads, 32 query heads, head_dim 128), ``--layers`` layers of
``--rows`` cached rows, one query: the median time of one step's attention over every
layer (evaluated together, as a model's step is), for

- ``quantized``: :func:`kvstore.model.attention.quantized_attention` (the packed rows
  through ``quantized_matmul``; on CUDA copied whole first): the decode route;
- ``dequantized``: :func:`~kvstore.model.attention.dequantized_attention` (the rows
  dequantized, then MLX's fused kernel): a prefill's route on CUDA;
- ``plain``: the fused kernel over bf16 rows (what a plain cache costs).

G5 on an H100 (``results/gpu/6fc8851-h100/``): a mixed 4/8 layout decoded at 50.9
tokens/s against plain's 89.6. If ``dequantized`` beats ``quantized`` here, the decode
step on CUDA should take it too. Each route's output is compared with ``plain``'s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from kvstore.model.attention import dense_attention, dequantized_attention, quantized_attention


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    heads, q_heads, dim, room = 8, 32, 128, (args.rows // 256 + 1) * 256
    scale = dim**-0.5
    print(f"{mx.default_device()}: {args.layers} layers x {args.rows} rows, one query")
    dense = []
    for i in range(args.layers):
        k, v = (
            mx.random.normal((1, heads, room, dim), key=mx.random.key(2 * i + j)) for j in (0, 1)
        )
        dense.append((k.astype(mx.bfloat16), v.astype(mx.bfloat16)))
    queries = [
        mx.random.normal((1, q_heads, 1, dim), key=mx.random.key(1000 + i)).astype(mx.bfloat16)
        for i in range(args.layers)
    ]
    mx.eval(dense, queries)

    def rows(x):  # type: ignore[no-untyped-def]
        return x[..., : args.rows, :]  # a view of the buffer, as update_and_fetch returns

    def timed(step) -> tuple[float, mx.array]:  # type: ignore[no-untyped-def]
        out = step()
        mx.eval(out)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            mx.eval(step())
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3, out

    plain_ms, plain = timed(
        lambda: [
            dense_attention(q, rows(k), rows(v), scale, None)
            for q, (k, v) in zip(queries, dense, strict=True)
        ]
    )
    print(f"  plain (bf16 rows, fused): {plain_ms:.3f} ms")
    for bits in (4, 8):
        packed = [tuple(mx.quantize(x, group_size=64, bits=bits) for x in layer) for layer in dense]
        mx.eval(packed)
        routes = (("quantized", quantized_attention), ("dequantized", dequantized_attention))
        for name, attend in routes:

            def step(attend=attend, packed=packed, bits=bits):  # type: ignore[no-untyped-def]
                return [
                    attend(
                        q,
                        tuple(map(rows, k)),
                        tuple(map(rows, v)),
                        scale,
                        None,
                        group_size=64,
                        bits=bits,
                    )
                    for q, (k, v) in zip(queries, packed, strict=True)
                ]

            try:
                ms, out = timed(step)
                diff = max(
                    float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item())
                    for a, b in zip(out, plain, strict=True)
                )
                print(
                    f"  {bits}-bit {name}: {ms:.3f} ms ({ms / plain_ms:.2f}x plain; "
                    f"largest difference from plain {diff:.3g})",
                    flush=True,
                )
            except (RuntimeError, ValueError) as exc:
                print(f"  {bits}-bit {name}: {str(exc)[:160]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
