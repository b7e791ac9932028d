"""Decode steps after a restore, the way ``mlx_lm.server`` batches them, each step timed.

    python3 tools/bench/gpu/batch_decode.py [--quick] [--steps 40] [--variants V,...]

Each variant in a fresh process: mlx-lm's llama at the 8B shape (random bfloat16
weights, built in memory), ``kvstore serve``'s warm-up (``build_kernels`` and
``build_batch_kernels``), a 4069-token prefill standing in for a restore, then the
prompt's 66 more tokens and ``--steps`` decode steps (greedy, evaluated one by one):

- ``batched``: the caches merged as ``BatchGenerator`` merges a request's
  (``BatchKVCache.merge``: a buffer of exactly the cached rows), so every step passes
  an array mask (``BatchKVCache.make_mask``), which on MLX's CUDA backend neither
  cuDNN's nor the vector attention takes (``supports_sdpa_vector``: no array mask):
  the ops' attention runs;
- ``unmasked``: the same, a one-token step over a batch of one with no padding given no
  mask (every key is visible to it: the same logits);
- ``plain``: mlx-lm's own caches, as ``mlx_lm.generate`` and ``kvstore.mlx_lm`` run.

Prints, per variant, the rest's prefill, each of the first steps and the median and
longest step (which one): where a fresh server's first tokens wait (``next.sh
warmdecode``: the longest gap at the third streamed token, ~57 ms, stock's too) and what
a token costs through each attention.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

#: The restored tokens and the prompt's rest after them (next.sh warmdecode's turn 2).
CACHED, REST = 4069, 66


def run(
    variant: str, quick: bool, steps: int, cached: int = CACHED, rest: int = REST
) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    from kvstore.bench.figures.gpu_common import LLAMA8B, TINY
    from kvstore.serve.warmup import build_batch_kernels, build_kernels

    config = TINY if quick else LLAMA8B
    mx.random.seed(0)  # the same weights and prompt in every variant's process: the same tokens
    model = llama.Model(llama.ModelArgs.from_dict(dict(config)))
    if not quick:
        model.set_dtype(mx.bfloat16)
    model.apply(lambda p: p * 0.05 if p.ndim > 1 else p)
    mx.eval(model.parameters())
    build_kernels(model)
    build_batch_kernels(model)
    mx.synchronize()

    vocab = config["vocab_size"]
    tokens = mx.random.randint(0, vocab, (1, cached + rest), key=mx.random.key(1))
    caches = make_prompt_cache(model)
    for start in range(0, cached, 2048):
        stop = min(start + 2048, cached)
        mx.eval(model(tokens[:, start:stop], cache=caches), [c.keys for c in caches])
    if variant in ("batched", "unmasked"):
        caches = [c.merge([c]) for c in caches]  # BatchGenerator's _merge_caches
        if variant == "unmasked":
            masked = BatchKVCache.make_mask

            def make_mask(self: Any, n: int, **kwargs: Any) -> Any:
                return None if n == 1 else masked(self, n, **kwargs)

            BatchKVCache.make_mask = make_mask  # type: ignore[method-assign]
    mx.eval([c.keys for c in caches])
    mx.synchronize()

    start = time.perf_counter()
    logits = model(tokens[:, cached:], cache=caches)[:, -1]
    token = mx.argmax(logits, axis=-1)
    mx.eval(token)
    rest_ms = (time.perf_counter() - start) * 1e3
    times, generated = [], []
    for _ in range(steps):
        start = time.perf_counter()
        token = mx.argmax(model(token[:, None], cache=caches)[:, -1], axis=-1)
        mx.eval(token)
        times.append((time.perf_counter() - start) * 1e3)
        generated.append(int(token.item()))
    longest = max(range(steps), key=times.__getitem__)
    rows = caches[0].keys.shape[2]
    return {
        "variant": variant,
        "rest_ms": round(rest_ms, 2),
        "first_steps_ms": [round(t, 2) for t in times[:6]],
        "median_step_ms": round(statistics.median(times), 2),
        "longest_step": [longest, round(times[longest], 2)],
        "buffer_rows": rows,
        "tokens": generated[:8],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny stand-in (a CPU)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--variants", default="batched,unmasked,plain,batched")
    parser.add_argument("--cached", type=int, default=CACHED, help="tokens standing for a restore")
    parser.add_argument("--rest", type=int, default=REST, help="the prompt's tokens after them")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        done = run(args.child, args.quick, args.steps, args.cached, args.rest)
        print(json.dumps(done), flush=True)
        return 0
    for variant in args.variants.split(","):
        command = [sys.executable, __file__, "--child", variant, "--steps", str(args.steps)]
        command += ["--cached", str(args.cached), "--rest", str(args.rest)]
        done = subprocess.run(
            command + (["--quick"] if args.quick else []),
            capture_output=True,
            text=True,
            check=False,
        )
        lines = done.stdout.strip().splitlines()
        if done.returncode or not lines:
            print(f"{variant}: failed ({done.returncode}): {done.stderr.strip()[-800:]}")
            continue
        print(lines[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
