"""Which part of TurboQuant's encode kernel costs a launch its ~20 us (P11's floor).

On an H200 (``results/gpu/9bdcf87/floor-probe.txt``) the pair encode kernel over one
row of keys and one of values took 55.8 us to evaluate against 31.5 for an empty kernel
of the same inputs, outputs and grid, and 16 launches over a 512-token layer in one
evaluation 490 us: a launch costs the device ~25-30 us whatever its rows, where the
decode kernel's one-row launch costs ~5 us over an empty one. This times variants of
the pair kernel, each with one part of the row encode taken out or replaced (their
outputs are not the encode's; only their times matter), on one row of each tensor and
on a 512-token llama-8B layer:

* ``as is``: :func:`cuda_rht._encode`'s kernel;
* ``no packing``: the codes not packed through the warp's shared words (no shared
  memory, no atomics);
* ``l2 scale``: the scale mode's two warp sums left out (``MODE == 0``);
* ``constant thresholds``: the cells' thresholds from ``__constant__`` memory;
* ``no staging``: the row's values read from ``x`` directly, not through the 16-byte
  loads into a local array;
* ``all four``;

then the verdict: each row's byte reduced by ``mx.max`` and read back (as
``encode_many``), against the kernel keeping the worst verdict per tensor itself
(``atomicMax`` where a row is not fine, the output zeroed by MLX's ``init_value``)::

    python3 tools/bench/gpu/encode_variants.py [--verdicts]

(``--verdicts``: the verdict's cases alone.)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from tools.bench.gpu.probe import timed, with_and_without_graphs

REPEATS = 60


def _replaced(t: str, first: str, last: str, replacement: str) -> str:
    """``t`` with the text from line ``first`` through line ``last`` replaced."""
    start = t.index(first)
    end = t.index(last, start) + len(last)
    return t[:start] + replacement + t[end:]


def variants() -> dict[str, Callable[[str], str]]:
    def no_packing(t: str) -> str:
        return _replaced(
            t,
            "    for (unsigned int w = lane; w < WORDS; w += 32) packed[warp][w] = 0u;",
            "codes[row * WORDS + w] = packed[warp][w];\n",
            "    if (lane < WORDS) codes[row * WORDS + lane] = idx[0];\n",
        )

    def l2_scale(t: str) -> str:
        return t.replace("if (MODE == 0) {", "if (true) {")

    def constant_thresholds(t: str) -> str:
        return t.replace("(z > thresholds[k])", "(z > kvstore_probe_thresholds[k])")

    def no_staging(t: str) -> str:
        return _replaced(
            t,
            "    alignas(16) unsigned char raw[NB];",
            "    const auto* t = reinterpret_cast<decltype(src)>(raw);\n",
            "    const auto* t = src;\n",
        )

    def all_four(t: str) -> str:
        return no_staging(constant_thresholds(l2_scale(no_packing(t))))

    return {
        "as is": lambda t: t,
        "no packing": no_packing,
        "l2 scale": l2_scale,
        "constant thresholds": constant_thresholds,
        "no staging": no_staging,
        "all four": all_four,
    }


def kernel_of(label: str, template: str, configs: Any, limit: float, atomic: bool = False) -> Any:
    from kvstore.turboquant import cuda_rht
    from kvstore.turboquant.codebook import codebook

    if atomic:
        template = template.replace("unsigned char* verdicts)", "unsigned int* verdicts)")
        template = template.replace(
            "        verdicts[row] = (n - n == 0.0f)",
            "        const unsigned int worst = (n - n == 0.0f)",
        )
        template = template.replace(
            ": NOT_FINITE;\n", ": NOT_FINITE;\n        if (worst) atomicMax(verdicts, worst);\n"
        )
    saved = cuda_rht._ENCODE
    cuda_rht._ENCODE = template
    try:
        name, inputs, outputs, header, body = cuda_rht.encode_parts(configs, limit)
    finally:
        cuda_rht._ENCODE = saved
    thresholds = ", ".join(f"{float(t)!r}f" for t in codebook(configs[0][0]).thresholds)
    header = f"__constant__ float kvstore_probe_thresholds[] = {{{thresholds}}};\n" + header
    if atomic:
        for s in range(len(configs)):
            body = body.replace(
                f"scale16_{s}, verdicts + start); return; }}",
                f"scale16_{s}, verdicts + {s}); return; }}",
            )
    slug = "".join(c if c.isalnum() else "_" for c in label)
    return mx.fast.cuda_kernel(
        name=f"kvstore_probe_{slug}_{abs(hash(header + body)) % 10**8}",
        input_names=inputs,
        output_names=outputs,
        source=body,
        header=header,
    )


def probe() -> None:
    from kvstore.turboquant import cuda_rht
    from kvstore.turboquant.quantizer import FLOAT16_SCALE_LIMIT as LIMIT
    from kvstore.turboquant.quantizer import encode_many, quantizer_for

    graphs = os.environ.get("MLX_USE_CUDA_GRAPHS", "(default)")
    print(f"device {mx.default_device()}; MLX_USE_CUDA_GRAPHS={graphs}", flush=True)
    shape = (1, 8, 512, 128)
    keys = mx.random.normal(shape, key=mx.random.key(1)).astype(mx.bfloat16)
    values = mx.random.normal(shape, key=mx.random.key(2)).astype(mx.bfloat16)
    mx.eval(keys, values)
    kq, vq = quantizer_for(4, 128, "k"), quantizer_for(4, 128, "v")
    krows, vrows = keys.reshape(-1, 128), values.reshape(-1, 128)
    configs = (cuda_rht._config(krows, kq), cuda_rht._config(vrows, vq))

    def launch(kernel: Any, k: mx.array, v: mx.array, atomic: bool = False) -> list[mx.array]:
        inputs, shapes, dtypes = [], [], []
        for x, q in ((k, kq), (v, vq)):
            t, lead = cuda_rht._tables(q), (int(x.shape[0]),)
            inputs += [x, t.signs, t.thresholds, t.centroids]
            shapes += [(*lead, 16), lead, lead]
            dtypes += [mx.uint32, mx.float32, mx.float16]
        total = int(k.shape[0] + v.shape[0])
        extra = {"init_value": 0} if atomic else {}
        return kernel(
            inputs=inputs,
            output_shapes=[*shapes, (2,) if atomic else (total,)],
            output_dtypes=[*dtypes, mx.uint32 if atomic else mx.uint8],
            grid=cuda_rht._grid(total),
            threadgroup=(256, 1, 1),
            **extra,
        )

    cases: dict[str, Callable[[], Any]] = {
        "mx.quantize keys+values": lambda: mx.eval(
            [mx.quantize(x, group_size=64, bits=4) for x in (keys, values)]
        ),
    }
    for label, change in variants().items() if "--verdicts" not in sys.argv else ():
        kernel = kernel_of(label, change(cuda_rht._ENCODE), configs, LIMIT)
        mx.eval(launch(kernel, krows, vrows))
        cases[f"{label}: one row of each"] = lambda kernel=kernel: mx.eval(
            launch(kernel, krows[:1], vrows[:1])
        )
        cases[f"{label}: 512 tokens"] = lambda kernel=kernel: mx.eval(launch(kernel, krows, vrows))
        cases[f"{label}: 16 launches in one evaluation"] = lambda kernel=kernel: mx.eval(
            [launch(kernel, krows, vrows) for _ in range(16)]
        )
    plain = kernel_of("as is", cuda_rht._ENCODE, configs, LIMIT)
    atomic = kernel_of("atomic verdict", cuda_rht._ENCODE, configs, LIMIT, atomic=True)
    worst = launch(atomic, krows, vrows, atomic=True)[-1]
    mx.eval(worst)
    print(f"atomic verdicts of a fine layer: {worst.tolist()}", flush=True)

    def with_max() -> Any:
        out = launch(plain, krows, vrows)
        top = mx.max(out[-1])
        mx.eval(out, top)
        return top.item()

    def with_atomic() -> Any:
        out = launch(atomic, krows, vrows, atomic=True)
        mx.eval(out)
        return out[-1].tolist()

    def with_wide_max() -> Any:
        # The maximum over 16 bytes, not 1: an output past MLX's 8-byte scalar pool
        # (managed memory the host's reads may pull over) is device memory.
        out = launch(plain, krows, vrows)
        top = mx.max(out[-1].reshape(16, -1), axis=1)
        mx.eval(out, top)
        return max(top.tolist())

    def lazy_max() -> Any:
        out = launch(plain, krows, vrows)
        mx.eval(out, mx.max(out[-1]))

    cases["verdict: mx.max + item"] = with_max
    cases["verdict: mx.max over 16 bytes + tolist"] = with_wide_max
    cases["verdict: mx.max, not read"] = lazy_max
    cases["verdict: atomicMax + init_value + tolist"] = with_atomic
    cases["encode_many (for reference)"] = lambda: encode_many(
        [(kq, keys, None), (vq, values, None)]
    )
    times: dict[str, list[float]] = {}
    for _ in range(3):  # interleaved rounds
        for name, fn in cases.items():
            times.setdefault(name, []).append(timed(fn, REPEATS, warmup=5) * 1e6)
    for name, samples in times.items():
        print(f"  {name:48s} {min(samples):8.1f} us", flush=True)


def main() -> int:
    return with_and_without_graphs(probe, __file__)


if __name__ == "__main__":
    raise SystemExit(main())
