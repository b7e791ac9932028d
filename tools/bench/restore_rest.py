"""A restore, then the prompt's rest through its caches: what a new turn does to them.

    .venv/bin/python tools/bench/restore_rest.py [--restored 4069] [--rest 66] [--repeats 7]

llama-8B-shaped mlx-lm ``KVCache`` s (32 layers, 8 KV heads, head_dim 128, bf16) of
``--restored`` tokens are saved to a fresh LMDB store; each repeat looks up a prompt of
``--rest`` more tokens, restores it and writes the rest's rows into every layer with
``update_and_fetch`` (as the rest's prefill does), evaluated. Prints the medians of the
restore, of the rest's update and of both, and the buffer's rows after the rest.

Until the restore left room for the whole prompt (``kvstore.codecs.growing.room_for``),
a rest crossing the restored rows' 256-row step made mlx-lm copy the whole cache into
a buffer of a size no fresh prefill makes (4069 + 66 -> 4325 rows). Compare revisions
by running an older one's checkout on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restored", type=int, default=4069)
    parser.add_argument("--rest", type=int, default=66)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from kvstore.store import open_store

    heads, dim = 8, 128
    caches = []
    for _ in range(args.layers):
        cache = KVCache()
        rows = mx.random.normal((1, heads, args.restored, dim)).astype(mx.bfloat16)
        cache.update_and_fetch(rows, rows)
        caches.append(cache)
    mx.eval([c.keys for c in caches])
    stored = list(range(1, args.restored + 1))
    prompt = stored + list(range(10**6, 10**6 + args.rest))
    new = mx.random.normal((1, heads, args.rest, dim)).astype(mx.bfloat16)
    mx.eval(new)
    timings = []
    with tempfile.TemporaryDirectory() as scratch:
        size = 4 * args.layers * heads * dim * (args.restored + args.rest) + (64 << 20)
        with open_store(f"lmdb://{Path(scratch) / 's'}", map_size=size) as store:
            store.save("rest", stored, caches)
            for _ in range(args.repeats):
                start = time.perf_counter()
                match = store.lookup("rest", prompt)
                restored = store.restore(match, [KVCache() for _ in range(args.layers)])
                mid = time.perf_counter()
                for cache in restored:
                    cache.update_and_fetch(new, new)
                mx.eval([c.keys for c in restored] + [c.values for c in restored])
                end = time.perf_counter()
                timings.append((mid - start, end - mid, end - start))
                rows = restored[0].keys.shape[2]
                del restored
    for name, k in (("restore", 0), ("the rest's update", 1), ("both", 2)):
        print(f"{name}: {statistics.median(t[k] for t in timings) * 1e3:.1f} ms")
    print(f"restored {match.tokens} of {match.prompt_tokens} tokens; buffer rows after: {rows}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
