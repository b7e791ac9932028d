"""Does MLX's CUDA ``quantized_matmul`` run over a quantized cache's rows, and copied whole?

    python3 tools/bench/gpu/qmm_views.py

A decode step's attention over a 4-bit cache, the llama-8B shape (8 KV heads, 4 query
heads each, head_dim 128), 301 of 512 buffer rows: ``mx.quantized_matmul`` on the rows
as views of the buffer (what ``update_and_fetch`` returns), then on the same rows made
contiguous (``kvstore.model.attention.quantized_attention`` on CUDA); then mlx-lm's own
``QuantizedKVCache`` through its ``quantized_scaled_dot_product_attention`` (stock
``mlx_lm.server --kv-bits``). One line each: runs, or MLX's error. Then each
``quantized_matmul`` of that step on the rows copied whole, on the GPU against the CPU
(``stream=mx.cpu``) on the same inputs: the scores (``transpose=True``) and the values'
(``transpose=False``), each with the keys broadcast over a head's query heads as
mlx-lm's attention calls it, and with the query heads as rows instead (no broadcast).
On an H100 the broadcast calls differed (scores 65 from the CPU's), the rows calls did
not (``results/gpu/ffd1c4c-h100/``): kvstore's attention takes the rows form since
``6fc8851``. Last, kvstore's attention over the views against the CPU's, and its model
over ``kv:quant:4:64`` and ``8:64`` against plain caches (``check.py``'s line; the
CPU: 0.244 and 0.0508).
"""

from __future__ import annotations

import mlx.core as mx


def attempt(label: str, run) -> None:  # type: ignore[no-untyped-def]
    try:
        mx.eval(run())
        print(f"{label}: runs", flush=True)
    except (RuntimeError, ValueError) as exc:
        print(f"{label}: {str(exc)[:200]}", flush=True)


def compare_calls(queries, whole, heads: int, repeats: int, dim: int) -> None:  # type: ignore[no-untyped-def]
    """Each quantized_matmul of a decode step on ``whole`` (packed rows, contiguous),
    the default device against the CPU: the largest difference, in float32."""
    rows = whole[0].shape[-2]
    weights = mx.softmax(mx.random.normal((1, heads, repeats, 1, rows)), axis=-1).astype(
        mx.bfloat16
    )
    broadcast = [mx.expand_dims(x, -3) for x in whole]
    flat_queries = queries.reshape(1, heads, repeats, dim)
    flat_weights = weights.reshape(1, heads, repeats, rows)
    calls = {
        "scores, keys broadcast over query heads": (queries, broadcast, True),
        "scores, query heads as rows": (flat_queries, whole, True),
        "values, broadcast over query heads": (weights, broadcast, False),
        "values, query heads as rows": (flat_weights, whole, False),
    }
    for label, (x, packed, transpose) in calls.items():

        def call(stream, x=x, packed=packed, transpose=transpose):  # type: ignore[no-untyped-def]
            return mx.quantized_matmul(
                x, *packed, transpose=transpose, group_size=64, bits=4, stream=stream
            ).astype(mx.float32)

        try:
            here, cpu = call(mx.default_device()), call(mx.cpu)
            diff = float(mx.max(mx.abs(here - cpu)).item())
            scale = float(mx.max(mx.abs(cpu)).item())
            print(f"{label}: largest difference from the CPU's {diff:.4g} (up to {scale:.3g})")
        except (RuntimeError, ValueError) as exc:
            print(f"{label}: {str(exc)[:160]}", flush=True)


def main() -> int:
    from mlx_lm.models.base import quantized_scaled_dot_product_attention
    from mlx_lm.models.cache import QuantizedKVCache

    heads, repeats, dim, rows, room = 8, 4, 128, 301, 512
    buffer = mx.random.normal((1, heads, room, dim)).astype(mx.bfloat16)
    packed = mx.quantize(buffer, group_size=64, bits=4)
    mx.eval(packed)
    view = [p[..., :rows, :] for p in packed]
    whole = [mx.contiguous(v) for v in view]
    queries = mx.random.normal((1, heads, repeats, 1, dim)).astype(mx.bfloat16)

    def scores(operands):  # type: ignore[no-untyped-def]
        keys = [mx.expand_dims(x, -3) for x in operands]
        return mx.quantized_matmul(queries, *keys, transpose=True, group_size=64, bits=4)

    attempt("quantized_matmul over views of the buffer", lambda: scores(view))
    attempt("quantized_matmul over the rows copied whole", lambda: scores(whole))

    cache = QuantizedKVCache(group_size=64, bits=4)
    keys = mx.random.normal((1, heads, rows, dim)).astype(mx.bfloat16)
    cache.update_and_fetch(keys, keys)
    q = mx.random.normal((1, heads * repeats, 1, dim)).astype(mx.bfloat16)
    step = mx.random.normal((1, heads, 1, dim)).astype(mx.bfloat16)

    def mlx_lm_step():  # type: ignore[no-untyped-def]
        k, v = cache.update_and_fetch(step, step)
        return quantized_scaled_dot_product_attention(
            q, k, v, scale=dim**-0.5, mask=None, group_size=64, bits=4
        )

    attempt("mlx-lm's QuantizedKVCache decode step", mlx_lm_step)
    compare_calls(queries, whole, heads, repeats, dim)
    from kvstore.model.attention import quantized_attention

    def ours(stream):  # type: ignore[no-untyped-def]
        with mx.stream(stream):
            flat = queries.reshape(1, heads * repeats, 1, dim)
            out = quantized_attention(flat, view, view, dim**-0.5, None, group_size=64, bits=4)
            return out.astype(mx.float32)

    try:
        diff = float(mx.max(mx.abs(ours(mx.default_device()) - ours(mx.cpu))).item())
        print(f"kvstore's quantized_attention over the views, a step: {diff:.4g} from the CPU's")
    except (RuntimeError, ValueError) as exc:
        print(f"kvstore's quantized_attention over the views, a step: {str(exc)[:160]}")
    from tools.bench.gpu.check import _quantized_attention_runs

    print("kvstore's model over kv:quant caches:", _quantized_attention_runs(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
