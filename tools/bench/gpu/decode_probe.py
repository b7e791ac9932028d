"""Where a lossy restore's decode spends its time on the device, step by step.

A ``kv:turboquant:4:4`` restore of 4096 tokens of llama-8B on the H200 spent ~24 ms
after its rows had crossed the bus (``tools/bench/results/gpu/86b1f33/ab-env.txt``):
the decode of 64 tensors (keys and values of 32 layers) and their joins. This times,
on device-resident inputs of that shape, each step of that decode over all 64 at once
(one evaluation, as a restore does), and the same steps over the 32 layers stacked
into one tensor per side (the decode a batched restore would run), against
``mx.dequantize`` of ``kv:quant:8:64`` rows. Medians of ``--repeats`` after a warm-up.

    python3 tools/bench/gpu/decode_probe.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mlx.core as mx

from kvstore.turboquant import cuda_decode
from kvstore.turboquant.packing import unpack_indices
from kvstore.turboquant.quantizer import lookup

LAYERS, HEADS, TOKENS, DIM = 32, 8, 4096, 128


def timed(make: Callable[[], list[mx.array]], repeats: int) -> float:
    """Median ms of building and evaluating ``make()``'s arrays."""
    mx.eval(make())  # compiles and warms
    spent = []
    for _ in range(repeats):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(make())
        mx.synchronize()
        spent.append(1e3 * (time.perf_counter() - start))
    return statistics.median(spent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    from kvstore.codecs.turboquant_params import TurboQuantParams

    kq, vq = TurboQuantParams.defaults(4, 4, DIM).quantizers()
    rows = mx.random.normal((1, HEADS, TOKENS, DIM)).astype(mx.bfloat16)
    codes, scales = kq.encode(rows)
    vcodes, vscales = vq.encode(rows)
    mx.eval(codes, scales, vcodes, vscales)
    sides = [(kq, codes, scales), (vq, vcodes, vscales)] * LAYERS
    # Distinct inputs per tensor (as a restore's are): copies, evaluated.
    inputs = [(q, c + 0, s + 0) for q, c, s in sides]
    mx.eval([a for _, c, s in inputs for a in (c, s)])
    stacked = [
        (
            q,
            mx.concatenate([c for qq, c, _ in inputs if qq is q]),
            mx.concatenate([s for qq, _, s in inputs if qq is q]),
        )
        for q in (kq, vq)
    ]
    mx.eval([a for _, c, s in stacked for a in (c, s)])
    q8 = [
        mx.quantize(rows.reshape(-1, DIM) + i * 0, group_size=64, bits=8) for i in range(2 * LAYERS)
    ]
    mx.eval(q8)
    bf16 = mx.bfloat16

    def unpack(which):
        return [unpack_indices(c.reshape(-1, q.words), q.bits, DIM) for q, c, _ in which]

    def looked(which):
        return [
            lookup(q.centroids, unpack_indices(c.reshape(-1, q.words), q.bits, DIM))
            * s.reshape(-1, 1).astype(mx.float32)
            for q, c, s in which
        ]

    steps: list[tuple[str, Callable[[], list[mx.array]]]] = [
        ("tq 4/4 decode, 64 tensors", lambda: [q.decode(c, s, bf16) for q, c, s in inputs]),
        ("  unpack only", lambda: unpack(inputs)),
        ("  unpack + lookup * scale", lambda: looked(inputs)),
        (
            "  + inverse rotation",
            lambda: [q.rotation.inverse(y) for (q, _, _), y in zip(inputs, looked(inputs))],
        ),
        (
            "  decode + join (concatenate, as join_on_device)",
            lambda: [
                mx.concatenate([q.decode(c, s, bf16), mx.zeros((1, HEADS, 0, DIM), bf16)], axis=2)
                for q, c, s in inputs
            ],
        ),
        ("tq 4/4 decode, 2 stacked tensors", lambda: [q.decode(c, s, bf16) for q, c, s in stacked]),
        ("  unpack only, stacked", lambda: unpack(stacked)),
        (
            "q8 dequantize, 64 tensors",
            lambda: [mx.dequantize(*t, group_size=64, bits=8) for t in q8],
        ),
        (
            "bf16 copy, 64 tensors",
            lambda: [mx.concatenate([rows, rows[:, :, :0]], axis=2) for _ in q8],
        ),
    ]
    if mx.cuda.is_available():  # the kernel builds on a CUDA GPU only
        steps.insert(
            3,
            (
                "  unpack + lookup * scale, one kernel (cuda_decode)",
                lambda: [
                    cuda_decode._launch(
                        c.reshape(-1, q.words), s.reshape(-1, 1), q.centroids, 4, DIM
                    )
                    for q, c, s in inputs
                ],
            ),
        )
    print(f"device {mx.default_device()}; {2 * LAYERS} tensors of [1, {HEADS}, {TOKENS}, {DIM}]")
    for name, make in steps:
        print(f"{name:52} {timed(make, args.repeats):8.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
