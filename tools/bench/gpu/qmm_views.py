"""Does MLX's CUDA ``quantized_matmul`` run over a quantized cache's rows, and copied whole?

    python3 tools/bench/gpu/qmm_views.py

A decode step's attention over a 4-bit cache, the llama-8B shape (8 KV heads, 4 query
heads each, head_dim 128), 301 of 512 buffer rows: ``mx.quantized_matmul`` on the rows
as views of the buffer (what ``update_and_fetch`` returns), then on the same rows made
contiguous (``kvstore.model.attention.quantized_attention`` on CUDA); then mlx-lm's own
``QuantizedKVCache`` through its ``quantized_scaled_dot_product_attention`` (stock
``mlx_lm.server --kv-bits``). One line each: runs, or MLX's error.
"""

from __future__ import annotations

import mlx.core as mx


def attempt(label: str, run) -> None:  # type: ignore[no-untyped-def]
    try:
        mx.eval(run())
        print(f"{label}: runs", flush=True)
    except (RuntimeError, ValueError) as exc:
        print(f"{label}: {str(exc)[:200]}", flush=True)


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
    from tools.bench.gpu.check import _quantized_attention_runs

    print("kvstore's model over kv:quant caches:", _quantized_attention_runs(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
