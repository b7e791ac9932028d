"""The benchmark harness: cases timed side by side, bars judged, a run assembled.

A figure (:class:`Figure`) pits competing :class:`Case` s against each other
-- ours, a peer, the physical limit -- on the same data in one process.
:func:`measure_interleaved` times them in turn, repetition after
repetition, the first case rotating each repetition so no case always
follows the same neighbour; one untimed warm-up round comes first. Every
ratio is taken per repetition (the pair shares that moment's machine load)
and then its median is reported. Noise on this shared 2-core machine is
large, so a figure is a ratio, never an absolute time.

Figures are registered in :data:`kvstore.bench.figures.FIGURES`; each
declares its bars (:func:`at_least` / :func:`at_most` over a named metric of
its rows), and :func:`run_figures` runs them, judges the bars and builds the
:class:`~kvstore.bench.results.BenchResults`.
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from kvstore.bench.results import (
    MET,
    MISSED,
    NOT_MEASURED,
    BenchResults,
    Check,
    CheckStatus,
    FigureRecord,
    FigureResult,
    RatioResult,
    Row,
)

__all__ = [
    "MIN_REPEATS",
    "Case",
    "Ratio",
    "Bar",
    "at_least",
    "at_most",
    "Figure",
    "Sizes",
    "QUICK",
    "FULL",
    "BenchContext",
    "measure_interleaved",
    "ratio",
    "evaluate",
    "figure_status",
    "run_figures",
]

#: The fewest timed repetitions a figure may rest on (BENCHMARKS.md: median of >= 5).
MIN_REPEATS = 5

Role = Literal["ours", "peer", "limit"]


@dataclass(frozen=True)
class Case:
    """One competitor: a call timed from start to finish.

    Attributes:
        name: how tables and ratios name it (``"mlx-lm load"``).
        role: ``ours``, ``peer`` or ``limit``.
        run: one timed call; it must finish its work (``mx.eval``) before
            returning. What it returns is dropped after the clock stops.
        reset: untimed, before every call (remove the file a save writes...).
    """

    name: str
    role: Role
    run: Callable[[], object]
    reset: Callable[[], None] | None = None


@dataclass(frozen=True)
class Ratio:
    """``reference`` time / ``subject`` time per repetition, called ``name``.

    Above 1 the subject is faster.
    """

    name: str
    subject: str
    reference: str


@dataclass(frozen=True)
class Bar:
    """A bar of BENCHMARKS.md: a predicate over one metric of the rows it applies to.

    Attributes:
        metric: a ratio or value name of the figure's rows.
        text: the bar as the table prints it (``"vs mlx-lm load >= 1.5x"``).
        check: the predicate over the measured number.
        where: params a row must have for the bar to judge it (``{"family": ...}``).
    """

    metric: str
    text: str
    check: Callable[[float], bool]
    where: Mapping[str, Any] = field(default_factory=dict)

    def applies(self, row: Row) -> bool:
        return all(row.params.get(k) == v for k, v in self.where.items())

    def describe(self) -> dict[str, Any]:
        return {"text": self.text, "metric": self.metric, "where": dict(self.where)}


def at_least(
    metric: str, bound: float, *, where: Mapping[str, Any] | None = None, unit: str = "x"
) -> Bar:
    """A bar met when ``metric >= bound`` (on the rows matching ``where``)."""
    return _bar(metric, ">=", bound, lambda v: v >= bound, where, unit)


def at_most(
    metric: str, bound: float, *, where: Mapping[str, Any] | None = None, unit: str = "x"
) -> Bar:
    """A bar met when ``metric <= bound`` (on the rows matching ``where``)."""
    return _bar(metric, "<=", bound, lambda v: v <= bound, where, unit)


def _bar(
    metric: str,
    op: str,
    bound: float,
    check: Callable[[float], bool],
    where: Mapping[str, Any] | None,
    unit: str,
) -> Bar:
    # The rows' selector goes into the text: bars of one figure must read apart.
    scope = f" [{' '.join(str(v) for v in where.values())}]" if where else ""
    return Bar(metric, f"{metric} {op} {bound:g}{unit}{scope}", check, dict(where or {}))


@dataclass(frozen=True)
class Figure:
    """A figure of BENCHMARKS.md: what it measures, against what, its bars, how to run it."""

    id: str
    title: str
    peer: str
    bars: tuple[Bar, ...]
    run: Callable[[BenchContext], FigureResult]


@dataclass(frozen=True)
class Sizes:
    """How big a run is.

    Attributes:
        workloads: the workload shapes timed figures use.
        prompt_lengths: the prompt lengths timed figures use.
        block_tokens: tokens per stored block (the store's default block size).
    """

    workloads: tuple[str, ...]
    prompt_lengths: tuple[int, ...]
    block_tokens: int = 256


#: A smoke run: every figure, small data: one small workload, since building caches costs
#: more than timing. The whole run took 3 min 8 s on the shared 2-core CI VM at
#: ``0b486f9``, 115 s of it P5's reference-model prefills (reference BLAS) and 25 s D2's
#: fresh processes.
QUICK = Sizes(workloads=("qwen0.5b",), prompt_lengths=(512, 2048))
#: The figures of record: BENCHMARKS.md's workloads and prompt lengths.
FULL = Sizes(workloads=("llama8b", "qwen0.5b", "gemma-swa"), prompt_lengths=(512, 2048, 8192))


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class BenchContext:
    """What a figure's ``run`` gets: sizes, repetitions, a scratch directory, a log.

    Attributes:
        sizes: :data:`QUICK` or :data:`FULL` (or a test's own).
        repeats: timed repetitions per case (>= :data:`MIN_REPEATS`).
        scratch: a directory for files a figure writes (removed after the run).
        quick: True for a smoke run.
        warmup: untimed rounds before the timed ones.
        log: progress lines (stderr by default; the table goes to stdout).
        clock: seconds, monotonic (tests substitute a deterministic one).
    """

    sizes: Sizes
    repeats: int
    scratch: Path
    quick: bool = False
    warmup: int = 1
    log: Callable[[str], None] = _stderr
    clock: Callable[[], float] = time.perf_counter

    def __post_init__(self) -> None:
        if self.repeats < MIN_REPEATS:
            raise ValueError(
                f"[bench] A figure is a median of at least {MIN_REPEATS} repetitions; "
                f"received repeats={self.repeats}."
            )

    def measure(
        self,
        label: str,
        params: Mapping[str, Any],
        cases: Sequence[Case],
        ratios: Iterable[Ratio] = (),
        *,
        pending: str | None = None,
    ) -> Row:
        """Time ``cases`` interleaved and return the row, with every ratio whose two cases ran.

        A ratio naming a case that is not in ``cases`` (ours, not built yet)
        is left out; ``pending`` then says why.
        """
        self.log(f"  {label}: {', '.join(c.name for c in cases)} x {self.repeats}")
        samples = measure_interleaved(cases, self.repeats, warmup=self.warmup, clock=self.clock)
        computed = {
            r.name: ratio(samples, r.subject, r.reference)
            for r in ratios
            if r.subject in samples and r.reference in samples
        }
        roles: dict[str, str] = {c.name: c.role for c in cases}
        return Row(label, dict(params), samples, roles, computed, {}, pending)


def measure_interleaved(
    cases: Sequence[Case],
    repeats: int,
    *,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Seconds per call of each case: ``repeats`` samples each, taken in turn.

    ``warmup`` untimed rounds come first (imports, first allocations, page
    cache). Repetition ``i`` starts with case ``i mod len(cases)`` and goes
    round in order, so ``samples[name][i]`` of every case come from the same
    repetition. The young garbage generations are collected before each
    call and the collector is off during it (as :mod:`timeit` does).
    """
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"[bench] Case names must be unique; received {names}.")
    for _ in range(warmup):
        for case in cases:
            _call(case, clock)
    samples: dict[str, list[float]] = {c.name: [] for c in cases}
    for rep in range(repeats):
        shift = rep % len(cases) if cases else 0
        for case in [*cases[shift:], *cases[:shift]]:
            samples[case.name].append(_call(case, clock))
    return samples


def _call(case: Case, clock: Callable[[], float]) -> float:
    if case.reset is not None:
        case.reset()
    # The young generations hold the previous call's cycles; a full collection would
    # cost 20-100 ms per call in a process that imported mlx-lm, for nothing.
    gc.collect(1)
    gc.disable()
    try:
        start = clock()
        result = case.run()
        elapsed = clock() - start
    finally:
        gc.enable()
    del result
    return elapsed


def ratio(samples: Mapping[str, Sequence[float]], subject: str, reference: str) -> RatioResult:
    """Per repetition, ``reference`` time over ``subject`` time (> 1: subject faster)."""
    pairs = zip(samples[reference], samples[subject], strict=True)
    return RatioResult(subject, reference, tuple(ref / sub for ref, sub in pairs))


# -- judging -------------------------------------------------------------------------------


def evaluate(figure: Figure, result: FigureResult) -> list[Check]:
    """Every bar of ``figure`` judged on every row it applies to.

    A row with the bar's metric is met or missed; a row without it but
    with a ``pending`` reason is not measured yet; other rows are not the
    bar's business (a scaling row for a ratio bar). A bar no row judged is
    one ``not measured yet`` check carrying the figure's pending reason.
    """
    checks: list[Check] = []
    for bar in figure.bars:
        judged = []
        for row in result.rows:
            if not bar.applies(row):
                continue
            value = row.metric(bar.metric)
            if value is not None:
                status: CheckStatus = MET if bar.check(value) else MISSED
                judged.append(Check(bar.text, bar.metric, row.label, value, status))
            elif row.pending is not None:
                judged.append(
                    Check(bar.text, bar.metric, row.label, None, NOT_MEASURED, row.pending)
                )
        if not judged:
            reason = result.pending or "no row of this run measured it"
            judged.append(Check(bar.text, bar.metric, None, None, NOT_MEASURED, reason))
        checks.extend(judged)
    return checks


def figure_status(checks: Sequence[Check], result: FigureResult) -> str:
    """The figure's status from its checks (see :mod:`kvstore.bench.results`)."""
    statuses = {c.status for c in checks}
    if MISSED in statuses:
        return MISSED
    if statuses == {MET}:
        return MET
    if MET in statuses:
        return "partial"
    if not checks and result.rows:
        return "reported"
    return NOT_MEASURED


def run_figures(
    figures: Sequence[Figure],
    ctx: BenchContext,
    *,
    command: Sequence[str] = (),
    machine: Mapping[str, Any] | None = None,
    after: Callable[[BenchResults], object] | None = None,
) -> BenchResults:
    """Run ``figures`` in order and assemble the results.

    A figure that raises is recorded with status ``error`` and its
    message; the others still run.

    Args:
        figures: what to run (values of ``FIGURES``).
        ctx: sizes, repetitions, scratch directory.
        command: the command line, recorded in the results.
        machine: ``{"machine":, "versions":, "git":}`` as
            :func:`kvstore.bench.machine.describe` gives; collected when None.
        after: called with the results so far after each figure (a long run
            writes them as it goes, so a run cut short keeps what it measured).
    """
    if machine is None:
        from kvstore.bench.machine import describe

        machine = describe()
    results = BenchResults(
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        command=list(command),
        quick=ctx.quick,
        repeats=ctx.repeats,
        machine=dict(machine["machine"]),
        versions=dict(machine["versions"]),
        git=machine["git"],
    )
    for figure in figures:
        ctx.log(f"{figure.id}: {figure.title}")
        start = time.perf_counter()
        error = None
        try:
            result = figure.run(ctx)
        except Exception as exc:  # one broken figure must not cost the others
            ctx.log(traceback.format_exc())
            result, error = FigureResult(), f"{type(exc).__name__}: {exc}"
        checks = evaluate(figure, result)
        if error is not None:
            checks = [
                Check(c.bar, c.metric, None, None, NOT_MEASURED, f"the figure failed: {error}")
                for c in checks
            ]
        status = "error" if error is not None else figure_status(checks, result)
        results.figures.append(
            FigureRecord(
                id=figure.id,
                title=figure.title,
                peer=figure.peer,
                bars=[bar.describe() for bar in figure.bars],
                status=status,
                result=result,
                checks=checks,
                elapsed_s=time.perf_counter() - start,
                error=error,
            )
        )
        if after is not None:
            after(results)
    return results


def scratch_directory() -> tempfile.TemporaryDirectory[str]:
    """A temporary directory for a run's files (on disk, not tmpfs, where the system puts it)."""
    return tempfile.TemporaryDirectory(prefix="kvstore-bench-")
