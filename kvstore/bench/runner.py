"""One benchmark run end to end: pick figures, measure, write ``bench-results.json``."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from kvstore.bench.figures import FIGURES
from kvstore.bench.harness import (
    FULL,
    MIN_REPEATS,
    QUICK,
    BenchContext,
    Figure,
    run_figures,
    scratch_directory,
)
from kvstore.bench.results import BenchResults

__all__ = ["DEFAULT_REPEATS", "select_figures", "run_bench"]

#: Timed repetitions per case unless told: the minimum for a smoke run, a few more otherwise.
DEFAULT_REPEATS = {True: MIN_REPEATS, False: 7}


def select_figures(ids: Sequence[str] | None) -> list[Figure]:
    """The figures called ``ids`` (any case), in table order; all of them for None.

    Raises:
        ValueError: an id no figure has; the message lists the known ones.
    """
    if ids is None:
        return list(FIGURES.values())
    wanted = {i.strip().upper() for i in ids if i.strip()}
    unknown = sorted(wanted - set(FIGURES))
    if unknown or not wanted:
        raise ValueError(
            f"[bench] Unknown figure(s) {', '.join(unknown) or '(none given)'}; "
            f"known: {', '.join(FIGURES)}."
        )
    return [figure for fid, figure in FIGURES.items() if fid in wanted]


def run_bench(
    ids: Sequence[str] | None = None,
    *,
    quick: bool = False,
    repeats: int | None = None,
    out_dir: str | os.PathLike[str] = ".",
    command: Sequence[str] = (),
    log: Callable[[str], None] | None = None,
) -> tuple[BenchResults, Path]:
    """Measure the figures ``ids`` (all by default) and write the results file.

    Args:
        ids: figure ids (``["P1", "P7"]``); None for every figure.
        quick: small sizes, a smoke run (:data:`~kvstore.bench.harness.QUICK`).
        repeats: timed repetitions per case (default :data:`DEFAULT_REPEATS`).
        out_dir: where ``bench-results.json`` goes.
        command: the command line, recorded in the results.
        log: progress lines (stderr by default).

    Returns:
        The results and the path of the file written.
    """
    figures = select_figures(ids)
    with scratch_directory() as scratch:
        ctx = BenchContext(
            sizes=QUICK if quick else FULL,
            repeats=DEFAULT_REPEATS[quick] if repeats is None else repeats,
            scratch=Path(scratch),
            quick=quick,
        )
        if log is not None:
            ctx.log = log
        results = run_figures(figures, ctx, command=command, after=lambda r: r.write(out_dir))
    return results, results.write(out_dir)
