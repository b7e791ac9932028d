"""P8: two processes restoring concurrently from one LMDB store, against one process.

A 2048-token prompt of the workload is saved into an LMDB store. Worker
processes (:mod:`kvstore.bench.figures.concurrent_worker`) open the store,
restore the prompt once (warm: imports, page cache, header parses as a
serving process would have them) and wait; that part is untimed. Timed:
from the "go" to the last worker's end, each worker doing ``RESTORES``
restores (lookup + read + checksum + caches built and evaluated).

* ``2 processes``: two workers at once (2 x ``RESTORES`` restores);
* ``1 process``: one worker.

The figure is the aggregate throughput of two over that of one:
``2 x t(1) / t(2)``. Bar (BENCHMARKS.md): >= 1.6x. Readers never block each
other in LMDB; what can cap it is the machine (two cores, shared).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from kvstore.bench.figures.common import MIB
from kvstore.bench.figures.store_cases import NS, open_bench_store, prompt_tokens
from kvstore.bench.harness import BenchContext, Case, Figure, Ratio, at_least
from kvstore.bench.results import FigureResult, Row
from kvstore.bench.workloads import cache_nbytes, synthetic_kv

__all__ = ["FIGURE", "TOKENS", "RESTORES"]

TOKENS = 2048
RESTORES = 10
AGGREGATE = "aggregate vs 1 process"


class _Workers:
    """Worker processes spawned and warmed (untimed), then started together (timed)."""

    def __init__(self, count: int, args: list[str]) -> None:
        self.count = count
        self.args = args
        self.procs: list[subprocess.Popen[str]] = []

    def spawn(self) -> None:
        self.stop()
        command = [sys.executable, "-m", "kvstore.bench.figures.concurrent_worker", *self.args]
        self.procs = [
            subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for _ in range(self.count)
        ]
        for proc in self.procs:
            line = proc.stdout.readline() if proc.stdout else ""
            if line.strip() != "READY":
                raise RuntimeError(f"[bench] a P8 worker failed to start: {line!r}")

    def run(self) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for proc in self.procs:
            out, _ = proc.communicate(timeout=600)
            if proc.returncode or not out.startswith("DONE"):
                raise RuntimeError(
                    f"[bench] a P8 worker failed (exit status {proc.returncode}): {out!r}"
                )
        self.procs = []

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        self.procs = []


@contextmanager
def _cases(ctx: BenchContext, workload: str) -> Iterator[tuple[list[Case], int]]:
    kv = synthetic_kv(workload, TOKENS)
    caches = kv.ours()
    nbytes = cache_nbytes(caches)
    with open_bench_store(ctx, f"p8-{workload}", nbytes) as store:
        store.save(NS, prompt_tokens(kv)[:TOKENS], caches)
        del caches
        url = store.url
        store.flush()
        args = [url, workload, str(TOKENS), str(ctx.sizes.block_tokens), str(RESTORES)]
        one, two = _Workers(1, args), _Workers(2, args)
        try:
            yield (
                [
                    Case("1 process", "peer", one.run, reset=one.spawn),
                    Case("2 processes", "ours", two.run, reset=two.spawn),
                ],
                nbytes,
            )
        finally:
            one.stop()
            two.stop()


def run(ctx: BenchContext) -> FigureResult:
    rows = []
    for workload in ctx.sizes.workloads[:1]:
        with _cases(ctx, workload) as (cases, nbytes):
            row: Row = ctx.measure(
                f"{workload} {TOKENS}",
                {"workload": workload, "tokens": TOKENS, "mib": nbytes / MIB, "restores": RESTORES},
                cases,
                [Ratio("2 vs 1 time", "2 processes", "1 process")],
            )
        row.values[AGGREGATE] = 2 * row.ratios["2 vs 1 time"].median
        rows.append(row)
    notes = [f"each worker restores the prompt {RESTORES} times; 2 workers do twice the work"]
    return FigureResult(rows, notes=notes)


FIGURE = Figure(
    "P8",
    "2 processes restoring concurrently from one LMDB store",
    "1 process doing half the restores",
    (at_least(AGGREGATE, 1.6),),
    run,
)
