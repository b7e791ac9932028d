"""P2 and P3: saving a prefix against mlx-lm's ``save_prompt_cache`` of the same cache.

P2, per workload and prompt length, side by side:

* ``ours``: a new prefix saved into an LMDB prefix store and committed
  durably (:func:`~.store_cases.save`);
* ``mlx-lm save``: ``save_prompt_cache`` to a fresh file (the bar's peer);
* ``mlx-lm save+fsync``: the same, then ``fsync``: what a durable commit
  costs mlx-lm (context for the bar, not the bar).

P3 saves a prefix the store already holds (dedup: hashing and one read,
:func:`~.store_cases.resave`) against the same peer.
"""

from __future__ import annotations

from contextlib import ExitStack

from kvstore.bench.figures import store_cases
from kvstore.bench.figures.common import (
    OursCase,
    per_prompt,
    prompt_params,
    scaling_metric,
)
from kvstore.bench.harness import BenchContext, Figure, Ratio, at_least, at_most
from kvstore.bench.results import FigureResult, Row
from kvstore.bench.workloads import SyntheticKV, cache_nbytes, mlx_lm_save_case

__all__ = ["P2", "P3", "OURS_NEW", "OURS_DEDUP"]

#: Our durable save of a new prefix (see :data:`~.common.OursCase`).
OURS_NEW: OursCase | None = store_cases.save
#: Our save of a prefix already stored.
OURS_DEDUP: OursCase = store_cases.resave
PENDING = (
    "ours (save of a new prefix, committed durably) needs the LMDB prefix store "
    "(kvstore.store, issue 5); the peers below are measured"
)
PEER = "mlx-lm save_prompt_cache of the same cache"

RATIOS = (
    Ratio("vs mlx-lm save", "ours", "mlx-lm save"),
    Ratio("vs mlx-lm save+fsync", "ours", "mlx-lm save+fsync"),
)


def measure(ctx: BenchContext, kv: SyntheticKV, ours: OursCase | None = None) -> Row:
    with ExitStack() as stack:
        caches = kv.mlx_lm()
        plain, durable = (
            ctx.scratch / f"p2-{kv.shape.name}-{kv.tokens}{suffix}.safetensors"
            for suffix in ("", "-fsync")
        )
        for path in (plain, durable):  # the files go when the row is done
            stack.callback(path.unlink, missing_ok=True)
        cases = [
            mlx_lm_save_case(caches, plain),
            mlx_lm_save_case(caches, durable, durable=True),
        ]
        if ours is not None:
            cases.insert(0, stack.enter_context(ours(ctx, kv)))
        return ctx.measure(kv.label, prompt_params(kv, cache_nbytes(caches)), cases, RATIOS)


def run(ctx: BenchContext) -> FigureResult:
    rows = per_prompt(ctx, lambda kv: measure(ctx, kv, OURS_NEW))
    return FigureResult(rows, pending=None if OURS_NEW is not None else PENDING)


def run_dedup(ctx: BenchContext) -> FigureResult:
    return FigureResult(per_prompt(ctx, lambda kv: measure(ctx, kv, OURS_DEDUP)))


P2 = Figure(
    "P2",
    "save throughput, new prefix, committed durably",
    PEER + " (and, for context, the same plus fsync)",
    (at_least("vs mlx-lm save", 1.0), at_most(scaling_metric("ours"), 1.25)),
    run,
)

P3 = Figure(
    "P3",
    "save of an already-stored prefix (dedup)",
    PEER,
    (at_least("vs mlx-lm save", 20.0),),
    run_dedup,
)
