"""P1: restore throughput against mlx-lm's ``load_prompt_cache`` and the memcpy limit.

Per workload and prompt length, side by side on the same cache:

* ``ours``: lookup + read + checksum + live caches built and evaluated,
  from an LMDB prefix store (:func:`~.store_cases.restore`);
* ``mlx-lm load``: ``load_prompt_cache`` + ``mx.eval`` of the file mlx-lm's
  ``save_prompt_cache`` wrote for the same cache, read from the page cache;
* ``memcpy``: ``numpy.copyto`` of as many bytes into an already-touched buffer;
* ``ours + step`` and ``mlx-lm load + step``: each, then the first decode step (one
  token into every layer's cache, evaluated): a cache that must copy its arrays to
  take that token pays it there (no bar; ``with the first step vs mlx-lm``).

Bars (BENCHMARKS.md): ours >= 1.0x mlx-lm, >= 40% of memcpy, and time per
MiB flat within 25% across prompt lengths.
"""

from __future__ import annotations

from contextlib import ExitStack

from kvstore.bench.figures import store_cases
from kvstore.bench.figures.common import (
    OursCase,
    per_prompt,
    prompt_cache_file,
    prompt_params,
    scaling_metric,
)
from kvstore.bench.harness import BenchContext, Figure, Ratio, at_least, at_most
from kvstore.bench.results import FigureResult, Row
from kvstore.bench.workloads import (
    SyntheticKV,
    cache_nbytes,
    memcpy_case,
    mlx_lm_load_case,
    with_first_step,
)

__all__ = ["FIGURE", "OURS", "PENDING"]

#: Our restore (see :data:`~.common.OursCase`).
OURS: OursCase | None = store_cases.restore
PENDING = (
    "ours (lookup + read + checksum + caches built) needs the LMDB prefix store "
    "(kvstore.store, issue 5); the peers below are measured"
)

RATIOS = (
    Ratio("vs mlx-lm", "ours", "mlx-lm load"),
    Ratio("vs memcpy", "ours", "memcpy"),
    Ratio("mlx-lm vs memcpy", "mlx-lm load", "memcpy"),
    Ratio("with the first step vs mlx-lm", "ours + step", "mlx-lm load + step"),
)


def measure(ctx: BenchContext, kv: SyntheticKV) -> Row:
    with ExitStack() as stack:
        caches = kv.mlx_lm()
        nbytes = cache_nbytes(caches)
        path = stack.enter_context(
            prompt_cache_file(ctx, caches, f"p1-{kv.shape.name}-{kv.tokens}")
        )
        del caches  # the peer loads its own copy from the file
        load = mlx_lm_load_case(path)
        cases = [load, memcpy_case(nbytes), with_first_step(load, kv)]
        if OURS is not None:
            ours = stack.enter_context(OURS(ctx, kv))
            cases[:0] = [ours]
            cases.append(with_first_step(ours, kv))
        return ctx.measure(kv.label, prompt_params(kv, nbytes), cases, RATIOS)


def run(ctx: BenchContext) -> FigureResult:
    rows = per_prompt(ctx, lambda kv: measure(ctx, kv))
    return FigureResult(rows, pending=None if OURS is not None else PENDING)


FIGURE = Figure(
    "P1",
    "restore throughput: lookup + read + checksum + live caches built and evaluated",
    "mlx-lm load_prompt_cache + mx.eval of the same cache (file in the page cache); "
    "numpy.copyto into a touched buffer of the same size (memcpy)",
    (
        at_least("vs mlx-lm", 1.0),
        at_least("vs memcpy", 0.4),
        at_most(scaling_metric("ours"), 1.25),
    ),
    run,
)
