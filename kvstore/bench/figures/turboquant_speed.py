"""P11: TurboQuant encode/decode throughput against ``mx.quantize``/``mx.dequantize`` 4-bit g64.

Per workload and prompt length, one layer's keys and values (the workload's
bfloat16 rows, ``[1, kv_heads, T, head_dim]``) are encoded and decoded; each
repetition times, interleaved, to ``mx.eval``:

* ``mx.quantize 4/64`` / ``mx.dequantize 4/64`` of keys and values -- the
  peer, what mlx-lm's ``QuantizedKVCache`` does with the same rows;
* ``encode``: keys and values through their TurboQuant quantizers together
  (``encode_many``), as caches and codecs encode (keys ``matched``, values
  ``ls``, codes packed, float16 scales, the NaN/Inf check);
* ``decode``: those codes and scales back to bfloat16 rows together (``decode_many``),
  as caches and codecs decode;
* ``fwht`` (tq 4/4 rows only, a limit): the float32 Hadamard transform of
  keys and values alone, the floor of an RHT codec built from MLX ops.

One row per TurboQuant width (4/4, 3/3, 2/2), each with its own peer cases so
every ratio pairs samples of the same moment. Bars (BENCHMARKS.md): encode
>= 0.5x ``mx.quantize``, decode >= 0.5x ``mx.dequantize``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvstore.bench.figures.common import per_prompt, prompt_params
from kvstore.bench.harness import BenchContext, Case, Figure, Ratio, at_least
from kvstore.bench.results import FigureResult, Row
from kvstore.bench.workloads import SyntheticKV

__all__ = ["FIGURE", "TQ_BITS", "GROUP", "ENCODE", "DECODE", "layer_rows"]

#: TurboQuant widths measured (keys and values alike).
TQ_BITS = (4, 3, 2)
#: The peer's affine group and width.
GROUP, PEER_BITS = 64, 4
ENCODE, DECODE = "encode vs mx.quantize", "decode vs mx.dequantize"
_QUANTIZE, _DEQUANTIZE = f"mx.quantize {PEER_BITS}/{GROUP}", f"mx.dequantize {PEER_BITS}/{GROUP}"


def layer_rows(kv: SyntheticKV, layer: int = 0) -> tuple[mx.array, mx.array]:
    """One layer's keys and values ``[1, kv_heads, tokens, head_dim]``, evaluated."""
    chunks = kv.chunks(layer)
    keys = mx.concatenate([k for k, _ in chunks], axis=2)
    values = mx.concatenate([v for _, v in chunks], axis=2)
    mx.eval(keys, values)
    return keys, values


def cases(keys: mx.array, values: mx.array, bits: int) -> list[Case]:
    """The peer's and TurboQuant ``bits``/``bits``'s cases on the same rows."""
    from kvstore.turboquant.quantizer import decode_many, encode_many, quantizer_for

    dim = int(keys.shape[-1])
    affine = [mx.quantize(x, group_size=GROUP, bits=PEER_BITS) for x in (keys, values)]
    kq, vq = quantizer_for(bits, dim, "k"), quantizer_for(bits, dim, "v")

    def encode() -> list[tuple[mx.array, mx.array]]:
        return encode_many([(kq, keys, None), (vq, values, None)])

    encoded = encode()
    mx.eval(affine, encoded)

    def run(make: Any) -> Any:
        return lambda: mx.eval(make())

    out = [
        Case(
            _QUANTIZE,
            "peer",
            run(lambda: [mx.quantize(x, group_size=GROUP, bits=PEER_BITS) for x in (keys, values)]),
        ),
        Case(
            _DEQUANTIZE,
            "peer",
            run(lambda: [mx.dequantize(*a, group_size=GROUP, bits=PEER_BITS) for a in affine]),
        ),
        Case("encode", "ours", run(encode)),
        Case(
            "decode",
            "ours",
            run(
                lambda: decode_many(
                    [
                        (kq, *encoded[0], mx.bfloat16, None),
                        (vq, *encoded[1], mx.bfloat16, None),
                    ]
                )
            ),
        ),
    ]
    if bits == TQ_BITS[0]:
        out.append(Case("fwht", "limit", run(lambda: _fwht(keys, values))))
    return out


def _fwht(keys: mx.array, values: mx.array) -> list[mx.array]:
    scale = int(keys.shape[-1]) ** -0.5
    return [mx.hadamard_transform(x.astype(mx.float32), scale=scale) for x in (keys, values)]


RATIOS = (
    Ratio(ENCODE, "encode", _QUANTIZE),
    Ratio(DECODE, "decode", _DEQUANTIZE),
    Ratio("fwht vs mx.quantize", "fwht", _QUANTIZE),
)


def measure(ctx: BenchContext, kv: SyntheticKV) -> list[Row]:
    keys, values = layer_rows(kv)
    nbytes = int(keys.nbytes + values.nbytes)
    rows = []
    for bits in TQ_BITS:
        config = f"tq{bits}/{bits}"
        params = {**prompt_params(kv, nbytes), "config": config}
        rows.append(ctx.measure(f"{kv.label} {config}", params, cases(keys, values, bits), RATIOS))
    return rows


def run(ctx: BenchContext) -> FigureResult:
    notes = [
        "one layer's bfloat16 keys and values; encode = both through TurboQuant (codes "
        "packed, float16 scales), decode = back to bfloat16",
    ]
    return FigureResult(per_prompt(ctx, lambda kv: measure(ctx, kv)), notes=notes)


FIGURE = Figure(
    "P11",
    "TurboQuant encode / decode throughput",
    "mx.quantize / mx.dequantize 4-bit g64 on the same tensors",
    (at_least(ENCODE, 0.5), at_least(DECODE, 0.5)),
    run,
)
