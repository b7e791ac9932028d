"""P6: stored bytes for 64 sessions sharing a 2048-token prefix, each with 256 own tokens.

For each workload, 64 sessions of 2304 tokens (a shared 2048-token system
prompt, then 256 tokens of their own) are saved into one LMDB store with
``store.save`` (the caches: the workload's synthetic KV after a 2304-token
prefill). Measured, not timed:

* ``stored bytes``: what the store holds (``stats().bytes``: record bytes,
  headers and alignment included);
* ``unique bytes``: the bfloat16 K/V of the unique tokens (2048 + 64 x 256),
  the least any store could hold;
* ``mlx-lm files``: 64 ``save_prompt_cache`` files of the same sessions (one is
  written; they are all the same size).

Bar (BENCHMARKS.md): stored <= 1.05x the unique tokens' bytes (about 7x
smaller than the mlx-lm files). A sliding-window workload keeps only what its
windows hold at the end, so it may store less than the unique bytes.
"""

from __future__ import annotations

import numpy as np

from kvstore.bench.figures.common import MIB
from kvstore.bench.figures.store_cases import NS, open_bench_store
from kvstore.bench.harness import BenchContext, Figure, at_most
from kvstore.bench.results import FigureResult, Row
from kvstore.bench.workloads import cache_nbytes, synthetic_kv

__all__ = ["FIGURE", "SESSIONS", "SHARED", "OWN"]

SESSIONS, SHARED, OWN = 64, 2048, 256
#: The workloads P6 measures (llama8b's 64 sessions would write 2.3 GB for a size;
#: gemma-swa's 1.7 GB, so a quick run leaves it out).
WORKLOADS = {"full": ("qwen0.5b", "gemma-swa"), "quick": ("qwen0.5b",)}


def measure(ctx: BenchContext, workload: str) -> Row:
    from mlx_lm.models.cache import save_prompt_cache

    kv = synthetic_kv(workload, SHARED + OWN)
    caches = kv.ours()
    rng = np.random.default_rng(6)
    shared = rng.integers(0, 150_000, SHARED, dtype=np.uint32)
    with open_bench_store(ctx, f"p6-{workload}", SESSIONS * cache_nbytes(caches) // 4) as store:
        for _ in range(SESSIONS):
            own = rng.integers(0, 150_000, OWN, dtype=np.uint32)
            store.save(NS, np.concatenate([shared, own]), caches)
        stats = store.stats()
    path = ctx.scratch / f"p6-{workload}.safetensors"
    save_prompt_cache(str(path), kv.mlx_lm())
    files = SESSIONS * path.stat().st_size
    path.unlink()
    unique = (SHARED + SESSIONS * OWN) * kv.shape.bytes_per_token
    values = {
        "stored MiB": stats.bytes / MIB,
        "unique MiB": unique / MIB,
        "mlx-lm files MiB": files / MIB,
        "vs unique bytes": stats.bytes / unique,
        "mlx-lm files vs stored": files / stats.bytes,
    }
    params = {"workload": workload, "sessions": SESSIONS, "blocks": stats.blocks}
    return Row(f"{workload} {SESSIONS} x ({SHARED} + {OWN})", params, values=values)


def run(ctx: BenchContext) -> FigureResult:
    rows = []
    for workload in WORKLOADS["quick" if ctx.quick else "full"]:
        ctx.log(f"  {workload}: {SESSIONS} sessions saved")
        rows.append(measure(ctx, workload))
    notes = ["sizes, not times: one run is the figure"]
    return FigureResult(rows, notes=notes)


FIGURE = Figure(
    "P6",
    "stored bytes, 64 sessions sharing a 2048-token prefix + 256 own tokens each",
    "the unique tokens' bytes; the 64 mlx-lm prompt-cache files of the same sessions",
    (at_most("vs unique bytes", 1.05),),
    run,
)
