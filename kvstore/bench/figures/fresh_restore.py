"""One fresh process of D2: a new session's first restore, or mlx-lm's first load.

    python -m kvstore.bench.figures.fresh_restore SPEC_JSON

``SPEC_JSON``: ``case`` (``"ours"``: the LMDB store at ``url``, holding the workload's
prompt under ``namespace``; ``"mlx-lm"``: the ``save_prompt_cache`` file at ``file``),
the ``workload`` and its ``tokens``. Before the clock starts, as in a server that has
just started: everything imported, MLX's first evaluation made, and (ours) the store
opened read-only. Timed: ours, lookup + restore + the arrays evaluated; mlx-lm's,
``load_prompt_cache`` + its arrays evaluated; each side's arrays as attention reads
them (:func:`~kvstore.bench.workloads.attended_arrays`: a restored cache's room past its
rows is left to the steps that write it, as P1's restores leave it). Then, timed apart,
the first decode step (:func:`~kvstore.bench.workloads.first_step`). Prints one JSON
line: the seconds of each, and the tokens the caches hold.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    from kvstore.bench.figures.store_cases import fresh_caches, prompt_tokens
    from kvstore.bench.workloads import attended_arrays, first_step, synthetic_kv
    from kvstore.store import open_store

    kv = synthetic_kv(spec["workload"], spec["tokens"])
    tokens = prompt_tokens(kv)
    caches = fresh_caches(kv)
    step = first_step(kv)
    mx.eval(mx.ones(4) + 1)  # MLX's own first evaluation, before the clock
    if spec["case"] == "ours":
        with open_store(spec["url"], readonly=True) as store:
            start = time.perf_counter()
            restored = store.restore(store.lookup(spec["namespace"], tokens), caches)
            mx.eval(attended_arrays(restored))
            seconds = time.perf_counter() - start
    else:
        start = time.perf_counter()
        restored = load_prompt_cache(spec["file"])
        mx.eval(attended_arrays(restored))
        seconds = time.perf_counter() - start
    tokens_held = int(restored[0].offset)
    start = time.perf_counter()
    step(restored)
    return {
        "seconds": seconds,
        "step_seconds": time.perf_counter() - start,
        "tokens": tokens_held,
    }


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
