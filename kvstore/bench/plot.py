"""The scaling plot: restore-from-store vs mlx-lm load vs full prefill, time against prompt length.

Drawn from a :class:`~kvstore.bench.results.BenchResults` (a fresh run or a
stored ``bench-results.json``), one panel per workload, log-log, medians
with their interquartile range. A series whose figure was not measured is
left out. Needs matplotlib (``pip install 'mlx-kvstore[plot]'``); it is
imported only here, and only the object-oriented API is used, so the
process's pyplot state and backend are left alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.bench.results import BenchResults, Row

__all__ = ["Series", "SCALING_SERIES", "PLOT_FILE", "scaling_points", "plot_scaling"]

#: The file ``kvstore bench --plot`` writes next to the results.
PLOT_FILE = "bench-scaling.png"


@dataclass(frozen=True)
class Series:
    """One line: a case of a figure, its median time per row against the row's ``tokens``."""

    figure: str
    case: str
    label: str


#: What the scaling plot draws. P5 rows without a ``workload`` param (the
#: reference model) are drawn in every panel.
SCALING_SERIES = (
    Series("P1", "ours", "restore from store"),
    Series("P1", "mlx-lm load", "mlx-lm load_prompt_cache + eval"),
    Series("P5", "full prefill", "full prefill (reference model)"),
)


def scaling_points(
    results: BenchResults, series: Series, workload: str
) -> list[tuple[int, float, float, float]]:
    """``(tokens, median, q1, q3)`` seconds of ``series`` for ``workload``, by prompt length."""
    record = results.figure(series.figure)
    if record is None:
        return []
    points = []
    for row in record.result.rows:
        if _plotted(row, series, workload):
            s = row.spread(series.case)
            points.append((int(row.params["tokens"]), s.median, s.q1, s.q3))
    return sorted(points)


def _plotted(row: Row, series: Series, workload: str) -> bool:
    return (
        series.case in row.samples
        and isinstance(row.params.get("tokens"), int)
        and row.params.get("workload", workload) == workload
    )


def plot_scaling(
    results: BenchResults,
    path: str | os.PathLike[str],
    *,
    series: tuple[Series, ...] = SCALING_SERIES,
) -> Path:
    """Write the scaling plot of ``results`` as a PNG at ``path``; returns the path.

    Raises:
        ImportError: matplotlib is not installed (the message names the extra).
        ValueError: none of ``series`` was measured in ``results``.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "[bench plot] The scaling plot needs matplotlib: pip install 'mlx-kvstore[plot]'."
        ) from exc
    workloads = _workloads(results, series)
    if not workloads:
        wanted = ", ".join(f"{s.figure} '{s.case}'" for s in series)
        raise ValueError(f"[bench plot] Nothing to plot: no rows of {wanted} in these results.")
    fig = Figure(figsize=(max(6.5, 5.0 * len(workloads)), 4.5), layout="constrained")
    axes = fig.subplots(1, len(workloads), squeeze=False)[0]
    for ax, workload in zip(axes, workloads):
        ticks: set[int] = set()
        for s in series:
            points = scaling_points(results, s, workload)
            if not points:
                continue
            tokens, med, q1, q3 = (list(col) for col in zip(*points))
            spread = [[m - lo for m, lo in zip(med, q1)], [hi - m for m, hi in zip(med, q3)]]
            ax.errorbar(tokens, med, yerr=spread, marker="o", capsize=3, label=s.label)
            ticks.update(tokens)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
        ax.tick_params(axis="x", which="minor", bottom=False)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("seconds (median, IQR)")
        ax.set_title(workload)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(_caption(results), fontsize="small")
    out = Path(path)
    fig.savefig(out, format="png", dpi=120)
    return out


def _workloads(results: BenchResults, series: tuple[Series, ...]) -> list[str]:
    found: dict[str, Any] = {}
    for s in series:
        record = results.figure(s.figure)
        for row in record.result.rows if record is not None else ():
            if s.case in row.samples and "workload" in row.params:
                found.setdefault(row.params["workload"], None)
    return list(found)


def _caption(results: BenchResults) -> str:
    m = results.machine
    blas = (m.get("blas") or {}).get("mlx", "?").split(" (")[0]  # without the caveat note
    rev = (results.git or {}).get("revision", "")[:12]
    return f"{m.get('cpu')}, {m.get('usable_cpus')} cpus; mlx BLAS: {blas}\n{results.created} {rev}"
