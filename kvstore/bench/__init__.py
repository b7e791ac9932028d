"""The benchmark harness: BENCHMARKS.md's figures, measured as ratios side by side.

``kvstore bench`` (or ``tools/bench/run.py``) runs it. The parts:

* :mod:`~kvstore.bench.harness` -- cases, interleaved timing, bars, a run;
* :mod:`~kvstore.bench.results` -- the results model and ``bench-results.json``;
* :mod:`~kvstore.bench.figures` -- ``FIGURES``, one module per figure;
* :mod:`~kvstore.bench.workloads` -- synthetic KV in real models' shapes, the peers' cases;
* :mod:`~kvstore.bench.machine` -- CPU, memory, versions, BLAS, git revision;
* :mod:`~kvstore.bench.report` -- the printed table; :mod:`~kvstore.bench.plot` -- the PNG.
"""

from __future__ import annotations

from kvstore.bench.figures import FIGURES
from kvstore.bench.harness import (
    FULL,
    MIN_REPEATS,
    QUICK,
    Bar,
    BenchContext,
    Case,
    Figure,
    Ratio,
    Sizes,
    at_least,
    at_most,
    measure_interleaved,
    run_figures,
)
from kvstore.bench.report import format_table
from kvstore.bench.results import BenchResults, FigureResult, Row
from kvstore.bench.runner import run_bench

__all__ = [
    "FIGURES",
    "FULL",
    "QUICK",
    "MIN_REPEATS",
    "Bar",
    "BenchContext",
    "BenchResults",
    "Case",
    "Figure",
    "FigureResult",
    "Ratio",
    "Row",
    "Sizes",
    "at_least",
    "at_most",
    "format_table",
    "measure_interleaved",
    "run_bench",
    "run_figures",
]
