"""What a server's warm-up saves its first request (``kvstore serve``'s
:func:`kvstore.serve.warmup.warm_up`), in fresh processes.

    python3 tools/bench/gpu/warmup_probe.py [--tokens 512] [--other 1500] [--warm-tokens 32,512]
                                            [--rounds 2] [--quick]

Each round starts a process per warm-up (none, then each of ``--warm-tokens``), one
after another. Each builds the llama-8B-shaped model (bf16, seeded; ``--quick``: the tiny
stand-in, for a CPU), runs ``warm_up(model, tokens)`` where it has one (and says how long
it took), then serves three "requests" -- a prefill and one decode step, evaluated, on
fresh caches each: ``--tokens`` twice, then ``--other`` -- and prints how long each took.
Without a warm-up the first request pays for building the process's kernels. Last,
the decode's pace: the mean of 32 one-token steps after the last request.
Environment variables pass to the processes (``MLX_USE_CUDA_GRAPHS=0``...).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

_CHILD = """
import json, sys, time
import mlx.core as mx
import numpy as np
from kvstore.bench.figures.gpu_common import LLAMA8B, TINY, build
from kvstore.serve.warmup import warm_up
from mlx_lm.models.cache import make_prompt_cache
tokens, warm, quick = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
other = int(sys.argv[4])
config = TINY if quick else LLAMA8B
t = time.perf_counter()
model = build(config)
mx.eval(model.parameters())
built = time.perf_counter() - t
out = {"device": str(mx.default_device()), "build_s": built}
if warm:
    out["warm_up_s"] = warm_up(model, warm)
for name, n in (("first", tokens), ("second", tokens), ("other", other)):
    caches = make_prompt_cache(model)
    prompt = mx.array(np.random.default_rng(n).integers(0, config["vocab_size"], (1, n)))
    t = time.perf_counter()
    logits = model(prompt, cache=caches)
    mx.eval(logits)
    token = mx.argmax(logits[:, -1:], axis=-1)
    mx.eval(model(token, cache=caches))
    out[name + "_s"] = time.perf_counter() - t
# The decode's pace: 32 steps after the last request, one token each, evaluated each.
t = time.perf_counter()
for _ in range(32):
    token = mx.argmax(model(token, cache=caches)[:, -1:], axis=-1)
    mx.eval(token)
out["decode_step_s"] = (time.perf_counter() - t) / 32
print(json.dumps(out))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--other", type=int, default=1500)
    parser.add_argument("--warm-tokens", default="32", help="comma-separated warm-up lengths")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    warm_ups = [0, *(int(n) for n in args.warm_tokens.split(","))]
    for r in range(args.rounds):
        for warm in warm_ups:
            t = time.perf_counter()
            argv = [sys.executable, "-c", _CHILD, str(args.tokens), str(warm)]
            argv += [str(int(args.quick)), str(args.other)]
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode:
                print(done.stderr[-2000:], file=sys.stderr)
                return done.returncode
            got = json.loads(done.stdout.strip().splitlines()[-1])
            ms = {k: round(v * 1e3, 1) for k, v in got.items() if k.endswith("_s") and v}
            took = time.perf_counter() - t
            print(f"round {r} warm-up {warm} tokens, {got['device']}: {ms} (process {took:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
