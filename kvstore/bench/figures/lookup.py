"""P4 (lookup latency) and P10 (open time) on an LMDB store holding many blocks.

One store is filled with ``blocks`` blocks (``FULL``: 100k, the bar's size;
``--quick``: 20k) as random 128-block prompts, plus the prompts looked up,
each stored whole. Filler records are 4 KiB: every record above LMDB's half
page lives on overflow pages, so the B-tree a lookup walks has the same shape
as with megabyte records; only disk use differs.

P4: ``store.lookup`` of prompts of 1k, 8k and 32k tokens stored whole (chain
walk, child search, recency touch), interleaved; also a cold miss at 32k.
Bar: median <= 2 ms at 32k tokens, linear in blocks walked, not in blocks
stored (the 1k/8k/32k rows show the walk).

P10: ``open_store`` + ``close`` of the big store against a store of 10
blocks, interleaved. Bar: <= 2x (no scan on open).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.harness import BenchContext, Case, Figure, Ratio, at_most, measure_interleaved
from kvstore.bench.results import FigureResult, Row

__all__ = ["P4", "P10", "FILL_BLOCKS", "fill_store"]

NS = "bench"
LOOKUP_TOKENS = (1024, 8192, 32768)
RECORD = bytes(4096)


def fill_store(store: Any, blocks: int, prompt_blocks: int, seed: int) -> None:
    """Store about ``blocks`` blocks as random prompts of ``prompt_blocks`` blocks each."""
    rng = np.random.default_rng(seed)
    done = 0
    while done < blocks:
        n = min(prompt_blocks, blocks - done)
        tokens = rng.integers(0, 150_000, n * store.block_size, dtype=np.uint32)
        store.put_blocks(NS, tokens, lambda spans: [RECORD] * len(spans))
        done += n


#: Filler blocks stored: the bar's 100k in a full run, fewer in a quick one.
FILL_BLOCKS = {"full": 100_000, "quick": 20_000}


def _blocks(ctx: BenchContext) -> int:
    return FILL_BLOCKS["quick" if ctx.quick else "full"]


@contextmanager
def _stores(ctx: BenchContext) -> Iterator[tuple[Path, Path, dict[int, np.ndarray], int]]:
    """(big store, small store, prompts stored whole by length, blocks in the big one)."""
    from kvstore.store import open_store

    big, small = ctx.scratch / "p4-big", ctx.scratch / "p4-small"
    rng = np.random.default_rng(1)
    prompts = {n: rng.integers(0, 150_000, n, dtype=np.uint32) for n in LOOKUP_TOKENS}
    try:
        ctx.log(f"  filling an LMDB store with {_blocks(ctx)} blocks")
        with open_store(f"lmdb://{big}", sync=False, touch_interval=0, verify=None) as store:
            fill_store(store, _blocks(ctx), 128, seed=2)
            for tokens in prompts.values():
                store.put_blocks(NS, tokens, lambda spans: [RECORD] * len(spans))
            stored = store.stats().blocks
        with open_store(f"lmdb://{small}", sync=False, verify=None) as store:
            fill_store(store, 10, 10, seed=3)
        yield big, small, prompts, stored
    finally:
        shutil.rmtree(big, ignore_errors=True)
        shutil.rmtree(small, ignore_errors=True)


def _lookup_rows(
    ctx: BenchContext, big: Path, prompts: dict[int, np.ndarray], stored: int
) -> list[Row]:
    from kvstore.store import open_store

    cold = np.random.default_rng(4).integers(0, 150_000, LOOKUP_TOKENS[-1], dtype=np.uint32)
    # The default background recency writer runs as in production; lookups never wait for it.
    with open_store(f"lmdb://{big}", verify=None) as store:
        for n, tokens in prompts.items():
            if store.lookup(NS, tokens).tokens != n - 1:
                raise AssertionError(f"[bench] the {n}-token prompt is not stored whole")
        cases = [Case(f"{n}", "ours", partial(store.lookup, NS, t)) for n, t in prompts.items()]
        cases.append(Case("cold", "ours", lambda: store.lookup(NS, cold)))
        repeats = max(ctx.repeats, 50)  # each call is a millisecond: many are cheap
        ctx.log(f"  lookups of {', '.join(c.name for c in cases)} tokens x {repeats}")
        samples = measure_interleaved(cases, repeats, warmup=5, clock=ctx.clock)
    rows = []
    for case in cases:
        n = prompts[int(case.name)].size if case.name != "cold" else LOOKUP_TOKENS[-1]
        label = f"{n // 1024}k tokens" + (" (cold miss)" if case.name == "cold" else "")
        params = {"tokens": n, "stored_blocks": stored, "miss": case.name == "cold"}
        median = float(np.median(samples[case.name]))
        rows.append(
            Row(
                label,
                params,
                {case.name: samples[case.name]},
                {case.name: "ours"},
                values={"lookup ms": 1e3 * median, "us per block walked": 1e6 * median / (n / 256)},
            )
        )
    return rows


def run_p4(ctx: BenchContext) -> FigureResult:
    with _stores(ctx) as (big, _, prompts, stored):
        rows = _lookup_rows(ctx, big, prompts, stored)
    notes = [f"LMDB store of {stored} blocks (block 256); each prompt stored whole"]
    if ctx.quick:
        notes.append(f"--quick: {stored} blocks stored; the bar is defined at >= 100k (full run)")
    return FigureResult(rows, notes=notes)


def run_p10(ctx: BenchContext) -> FigureResult:
    from kvstore.store import open_store

    with _stores(ctx) as (big, small, _, stored):
        cases = [
            Case("big", "ours", lambda: open_store(f"lmdb://{big}").close()),
            Case("small", "peer", lambda: open_store(f"lmdb://{small}").close()),
        ]
        row = ctx.measure(
            f"open with {stored} vs 10 blocks",
            {"stored_blocks": stored},
            cases,
            [Ratio("small vs big", "big", "small")],
        )
    # The bar is big/small <= 2: the inverse of the ratio the harness takes.
    row.values["open big vs small"] = 1.0 / row.ratios["small vs big"].median
    return FigureResult([row])


P4 = Figure(
    "P4",
    "lookup latency, 32k-token prompt, store holding >= 100k blocks (1k/8k/32k tokens)",
    "none (absolute median)",
    (at_most("lookup ms", 2.0, where={"tokens": 32768, "miss": False}, unit=" ms"),),
    run_p4,
)
P10 = Figure(
    "P10",
    "store open time with 100k blocks stored",
    "open with 10 blocks stored",
    (at_most("open big vs small", 2.0),),
    run_p10,
)
