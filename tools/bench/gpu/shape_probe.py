"""What a prompt length the process has not run before costs a forward, and where.

    python3 tools/bench/gpu/shape_probe.py [--prefix 4096] [--suffixes 7,19,45,100,230,600]
                                           [--quick] [--decode N] [--ops] [--skip-c]

A server's warm request restores a prefix of P tokens and prefills the S new ones; both
P and S differ from one request to the next. ``tools/bench/results/gpu/warmup-h100``
measured ~50-150 ms more for a prompt length the process had not run, with or without
MLX's CUDA graphs. MLX's CUDA attention builds a cuDNN graph per query/key shape and
strides (``sdpa_cache`` in ``mlx/backend/cuda/scaled_dot_product_attention.cpp``) for
every call of 4 or more queries, so the suspicion is that build. Three parts, each a
first call of a shape against a repeat of it, milliseconds:

A. ``mx.fast.scaled_dot_product_attention`` alone (32 query / 8 KV heads of 128, bf16,
   causal, keys a slice of a 256-row-step buffer as a cache's are) against the same
   attention by plain ops (``kvstore.model.attention.unfused_attention``, and a first form
   that broadcast the keys to every query head), each on shapes it has not seen.
B. The llama-8B-shaped reference model: a P-token prefix prefilled, then for each S a
   suffix forward on it (trimmed back to P after each), ``KVSTORE_UNFUSED_ATTENTION``
   ``never`` against ``auto``.
C. mlx-lm's own llama model of the same shape (random weights), its suffix forwards
   (what ``kvstore serve`` runs), as mlx-lm has them and with
   ``kvstore.mlx_lm.attention.unfused_for_model``.
D. (``--decode N``) N one-token decode steps after the prefix, caches growing by 256 rows
   (cuDNN decodes, a graph per buffer size) and by 255 (MLX's vector kernel): each step's
   pace, and the steps that cross into a new buffer size.
E. (``--ops``) each op of a layer (llama-8B's, or the tiny stand-in's) and the head on S
   new rows, timed the first time its shape runs and again: which op charges a new shape.

Two warm-ups a server could run at start, each timed, to see what they take out of B and D:
``--spread 1,2,4,...`` runs a suffix forward of each of those lengths before B (cuBLAS
loads a kernel the first time its heuristic picks it: do a spread of row counts load the
kernels other counts pick?); ``--decode-warm`` builds cuDNN's decode graph of every buffer
size D will meet (``kvstore.serve.warmup.build_decode_graphs``: a decode step over caches
of each size) before D.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from typing import Any

import mlx.core as mx
import numpy as np


def broadcast(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """Plain ops with the keys broadcast to every query head (the probe's first form)."""
    B, n_q, L, D = queries.shape
    n_kv, T = keys.shape[1], keys.shape[2]
    q = (queries * scale).reshape(B, n_kv, n_q // n_kv, L, D)
    scores = q @ mx.expand_dims(keys, 2).swapaxes(-1, -2)
    causal = mx.arange(T - L, T)[:, None] >= mx.arange(T)[None]
    scores = mx.where(causal, scores, mx.finfo(scores.dtype).min)
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ mx.expand_dims(values, 2)).reshape(B, n_q, L, D)


def bfloat16_weights(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """The plain ops as first landed: the softmax weights rounded to the values' dtype for
    the second matmul (1.5-2x the output's own rounding error off float32 attention)."""
    B, n_q, L, D = queries.shape
    n_kv, T = keys.shape[-3], keys.shape[-2]
    repeats = n_q // n_kv
    folded = (queries.astype(mx.float32) * scale).reshape(B, n_kv, repeats * L, D)
    scores = folded @ keys.astype(mx.float32).swapaxes(-1, -2)
    rows = mx.arange(repeats * L) % L + (T - L)
    scores = mx.where(rows[:, None] >= mx.arange(T)[None], scores, mx.finfo(mx.float32).min)
    weights = mx.softmax(scores, axis=-1).astype(values.dtype)
    return (weights @ values).reshape(B, n_q, L, values.shape[-1])


def reference(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """Float32 attention of the same inputs on the CPU (no TF32): the yardstick."""
    with mx.stream(mx.cpu):
        f32 = [a.astype(mx.float32) for a in (queries, keys, values)]
        out = broadcast(*f32, scale, mask)
        mx.eval(out)
    return out


def fused(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def timed(fn: Any) -> float:
    mx.synchronize()
    t = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t) * 1e3


def part_a(shapes: list[tuple[int, int]], out: dict[str, Any]) -> None:
    rows = []
    from kvstore.model.attention import unfused_attention

    for name, attend in (
        ("fused", fused),
        ("unfused", unfused_attention),
        ("broadcast", broadcast),
        ("bf16weights", bfloat16_weights),
    ):
        for index, (S, P) in enumerate(shapes):
            T = P + S
            room = (T + 255) // 256 * 256
            # The same inputs of a shape for every form, so their errors compare.
            keys = mx.random.split(mx.random.key(index), 3)
            k, v = (
                mx.random.normal((1, 8, room, 128), key=key).astype(mx.bfloat16) for key in keys[:2]
            )
            q = mx.random.normal((1, 32, S, 128), key=keys[2]).astype(mx.bfloat16)
            mx.eval(k, v, q)
            ks, vs = k[:, :, :T], v[:, :, :T]
            call = functools.partial(attend, q, ks, vs, 128**-0.5, "causal")
            first, again = timed(call), timed(call)
            # How far from the fused kernel's output, relative to its largest value.
            want = fused(q, ks, vs, 128**-0.5, "causal").astype(mx.float32)
            got = call().astype(mx.float32)
            off = mx.abs(got - want).max() / mx.abs(want).max()
            exact = reference(q, ks, vs, 128**-0.5, "causal")
            scale = mx.abs(exact).max()
            off32 = (mx.abs(got - exact).max() / scale).item()
            rounded = exact.astype(mx.bfloat16).astype(mx.float32)
            floor = (mx.abs(rounded - exact).max() / scale).item()
            row = {"attend": name, "S": S, "P": P, "first": first, "again": again}
            rows.append({**row, "off": off.item(), "off_f32": off32, "floor": floor})
            print(
                f"A {name:10s} S={S:5d} P={P:5d}: first {first:8.2f} ms, again {again:7.2f} ms"
                f" (off the fused output by {off.item():.2e} of its largest, off float32 by"
                f" {off32:.2e}, bfloat16 floor {floor:.2e})",
                flush=True,
            )
    out["A"] = rows


def last_logits(model: Any, tokens: mx.array, caches: list[Any]) -> mx.array:
    return model(tokens, cache=caches)[:, -1]


def logits_rows(
    model: Any, caches: list[Any], prefix: int, suffixes: list[int], vocab: int
) -> list[dict[str, Any]]:
    """How far a suffix's logits by plain-op attention are from the fused kernel's, and
    how often their top token agrees."""
    rows = []
    for S in suffixes:
        tokens = mx.array(np.random.default_rng(S + 7).integers(0, vocab, (1, S)))
        got = {}
        for mode in ("never", "auto"):
            os.environ["KVSTORE_UNFUSED_ATTENTION"] = mode
            got[mode] = model(tokens, cache=caches)[0].astype(mx.float32)
            mx.eval(got[mode])
            for c in caches:
                c.trim(c.offset - prefix)
        off = (mx.abs(got["auto"] - got["never"]).max() / mx.abs(got["never"]).max()).item()
        agree = mx.mean(mx.argmax(got["auto"], -1) == mx.argmax(got["never"], -1)).item()
        rows.append({"S": S, "off": off, "top_token_agrees": agree})
        print(
            f"logits S={S} on {prefix}: off by {off:.2e} of the largest,"
            f" top token agrees at {agree:.0%}",
            flush=True,
        )
    return rows


def decode_rows(model: Any, prompt: mx.array, steps: int, vocab: int) -> list[dict[str, Any]]:
    """D: one-token steps after the prefix, on caches growing by 256 rows (MLX decodes a
    buffer of 256 rows or more, a multiple of 256, with cuDNN: a graph per buffer size) and
    by 255 (never a multiple: MLX's vector kernel). Each step timed; the steps that cross
    into a new buffer size are reported apart."""
    from kvstore.bench.figures.gpu_common import prefill

    rows = []
    for step in (256, 255):
        caches = model.make_cache()
        for c in caches:
            c.step = step  # the instance's growth, shadowing the class's
        prefill(model, prompt, caches)
        token = mx.array([[1]])
        times, crossing = [], []
        for _ in range(steps):
            grows = caches[0].offset % step == 0  # this step's row needs a larger buffer
            t = timed(functools.partial(last_logits, model, token, caches))
            (crossing if grows else times).append(t)
        times.sort()
        row = {
            "step": step,
            "median": times[len(times) // 2],
            "p90": times[int(len(times) * 0.9)],
            "max": times[-1],
            "crossing": crossing,
        }
        rows.append(row)
        print(
            f"D growth {step}: step median {row['median']:.2f} ms, p90 {row['p90']:.2f}, "
            f"max {row['max']:.2f}; at a new buffer size "
            + ", ".join(f"{t:.1f}" for t in crossing),
            flush=True,
        )
    return rows


def layer_ops(
    w: dict[str, mx.array],
    norm: mx.array,
    k_buf: mx.array,
    v_buf: mx.array,
    x: mx.array,
    q: mx.array,
    g: mx.array,
    prefix: int,
) -> dict[str, Any]:
    """E's ops on one suffix's rows ``x`` (hidden), ``q`` (queries), ``g`` (MLP)."""
    import mlx.nn as nn

    from kvstore.model.attention import unfused_attention

    T, dim = prefix + x.shape[1], q.shape[-1]
    return {
        "rms_norm": lambda: mx.fast.rms_norm(x, norm, 1e-5),
        "q_proj": lambda: x @ w["q"].T,
        "k_proj": lambda: x @ w["kv"].T,
        "gate_proj": lambda: x @ w["up"].T,
        "down_proj": lambda: g @ w["down"].T,
        "rope": lambda: mx.fast.rope(
            q, dim, traditional=False, base=500000.0, scale=1.0, offset=prefix
        ),
        "silu_mul": lambda: nn.silu(g) * g,
        "cache_write": lambda: k_buf.at[:, :, prefix:T].add(0),  # a slice update
        "attention": lambda: unfused_attention(
            q, k_buf[:, :, :T], v_buf[:, :, :T], dim**-0.5, "causal"
        ),
        "head_last": lambda: x[:, -1:] @ w["head"].T,
        "head_all": lambda: x @ w["head"].T,
    }


def op_rows(config: dict[str, Any], suffixes: list[int], prefix: int) -> list[dict[str, Any]]:
    """E: the ops of one layer of ``config``'s shape (and the head) on S new rows, each
    timed the first time its shape runs and again: which of them charges a new shape."""

    def weight(rows: int, cols: int) -> mx.array:
        return (0.02 * mx.random.normal((rows, cols))).astype(mx.bfloat16)

    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    w = {"q": weight(heads * dim, hidden), "kv": weight(kv_heads * dim, hidden)}
    w["up"], w["down"] = weight(inner, hidden), weight(hidden, inner)
    w["head"] = weight(config["vocab_size"], hidden)
    norm = mx.ones((hidden,), dtype=mx.bfloat16)
    room = (prefix + max(suffixes) + 255) // 256 * 256
    k_buf = mx.random.normal((1, kv_heads, room, dim)).astype(mx.bfloat16)
    v_buf = mx.random.normal((1, kv_heads, room, dim)).astype(mx.bfloat16)
    mx.eval(list(w.values()), norm, k_buf, v_buf)
    rows = []
    for S in suffixes:
        x = (0.1 * mx.random.normal((1, S, hidden))).astype(mx.bfloat16)
        q = mx.random.normal((1, heads, S, dim)).astype(mx.bfloat16)
        g = mx.random.normal((1, S, inner)).astype(mx.bfloat16)
        mx.eval(x, q, g)
        ops = layer_ops(w, norm, k_buf, v_buf, x, q, g, prefix)
        row: dict[str, Any] = {"S": S}
        for name, op in ops.items():
            row[name] = (round(timed(op), 3), round(timed(op), 3))
        rows.append(row)
        print(
            f"E S={S:5d}: "
            + ", ".join(f"{n} {a:.2f}/{b:.2f}" for n, (a, b) in list(row.items())[1:]),
            flush=True,
        )
    return rows


def suffix_rows(
    label: str,
    model: Any,
    caches: list[Any],
    prefix: int,
    suffixes: list[int],
    vocab: int,
    unfused: str = "never",
) -> list[dict[str, Any]]:
    os.environ["KVSTORE_UNFUSED_ATTENTION"] = unfused
    rows = []
    for S in suffixes:
        tokens = mx.array(np.random.default_rng(S).integers(0, vocab, (1, S)))
        times = []
        for _ in range(2):
            times.append(timed(functools.partial(last_logits, model, tokens, caches)))
            for c in caches:
                c.trim(c.offset - prefix)
        rows.append(
            {"mode": label, "S": S, "first": round(times[0], 2), "again": round(times[1], 2)}
        )
        print(
            f"{label:18s} S={S:5d} on {prefix}: first {times[0]:8.2f} ms, again {times[1]:7.2f} ms",
            flush=True,
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--suffixes", default="7,19,45,100,230,600")
    parser.add_argument("--quick", action="store_true", help="the tiny stand-in (a CPU)")
    parser.add_argument("--out", default=None, help="also write the rows here as JSON")
    parser.add_argument("--max", type=int, default=None, help="UNFUSED_SCORES_MAX for B and C")
    parser.add_argument(
        "--decode", type=int, default=0, help="D: this many one-token steps after the prefix"
    )
    parser.add_argument(
        "--ops", action="store_true", help="E: a layer's ops timed on new shapes one by one"
    )
    parser.add_argument("--skip-c", action="store_true", help="leave out C (mlx-lm's model)")
    parser.add_argument(
        "--spread", default="", help="warm-up: suffix forwards of these lengths before B"
    )
    parser.add_argument(
        "--decode-warm", action="store_true", help="warm-up: D's decode graphs built first"
    )
    args = parser.parse_args()
    suffixes = [int(s) for s in args.suffixes.split(",")]
    mx.random.seed(0)  # the same inputs every run
    if args.max is not None:
        from kvstore.model import attention as attention_module

        attention_module.UNFUSED_SCORES_MAX = args.max
    out: dict[str, Any] = {"device": str(mx.default_device()), "prefix": args.prefix}

    part_a([(s, args.prefix + 17 * i) for i, s in enumerate(suffixes)], out)

    from kvstore.bench.figures.gpu_common import LLAMA8B, TINY, build, prefill

    config = TINY if args.quick else LLAMA8B
    model = build(config)
    mx.eval(model.parameters())
    vocab = config["vocab_size"]
    prompt = mx.array(np.random.default_rng(0).integers(0, vocab, (1, args.prefix)))
    # The kernels of the warm-up's own shapes, so no part below pays for them; and a
    # 32-token prefill on fresh caches by plain ops, as `kvstore serve`'s warm-up runs it.
    caches = model.make_cache()
    prefill(model, prompt, caches)
    mx.eval(model(prompt[:, :1], cache=caches))
    os.environ["KVSTORE_UNFUSED_ATTENTION"] = "auto"
    mx.eval(model(prompt[:, :32], cache=model.make_cache()))
    for c in caches:
        c.trim(c.offset - args.prefix)
    if args.spread:
        spread = [int(n) for n in args.spread.split(",")]
        start = time.perf_counter()
        out["spread"] = suffix_rows("spread never", model, caches, args.prefix, spread, vocab)
        out["spread"] += suffix_rows(
            "spread auto", model, caches, args.prefix, spread, vocab, "auto"
        )
        out["spread_ms"] = round((time.perf_counter() - start) * 1e3, 1)
        print(f"spread warm-up of {len(spread)} lengths, both modes: {out['spread_ms']} ms")
    rows = suffix_rows("ours fused", model, caches, args.prefix, suffixes, vocab)
    shifted = [s + 1 for s in suffixes]  # lengths neither mode has run
    rows += suffix_rows("ours unfused", model, caches, args.prefix, shifted, vocab, "auto")
    out["B"] = rows
    out["logits"] = logits_rows(model, caches, args.prefix, [20, 100], vocab)
    if args.decode and args.decode_warm:
        from kvstore.serve.warmup import build_decode_graphs

        start = time.perf_counter()
        sizes = build_decode_graphs(model, args.prefix + args.decode)
        out["decode_warm_ms"] = round((time.perf_counter() - start) * 1e3, 1)
        out["decode_warm_sizes"] = sizes
        print(f"decode graphs of {sizes} buffer sizes built: {out['decode_warm_ms']} ms")
    if args.decode:
        out["D"] = decode_rows(model, prompt, args.decode, vocab)
    if args.ops:
        out["E"] = op_rows(config, [s + 5 for s in suffixes], args.prefix)
    del model, caches
    if args.skip_c:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
        return 0

    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    dtype = mx.float32 if args.quick else mx.bfloat16
    peer = llama.Model(llama.ModelArgs.from_dict(dict(config)))
    peer.set_dtype(dtype)
    mx.eval(peer.parameters())
    caches = make_prompt_cache(peer)
    for start in range(0, args.prefix, 2048):
        mx.eval(peer(prompt[:, start : start + 2048], cache=caches)[:, -1])
    out["C"] = suffix_rows(
        "mlx-lm fused", peer, caches, args.prefix, [s + 2 for s in suffixes], vocab
    )
    from kvstore.mlx_lm.attention import unfused_for_model

    unfused_for_model(peer)
    mx.eval(peer(prompt[:, :32], cache=make_prompt_cache(peer)))  # the warm-up's
    out["C"] += suffix_rows(
        "mlx-lm unfused", peer, caches, args.prefix, [s + 3 for s in suffixes], vocab, "auto"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
