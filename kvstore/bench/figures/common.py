"""What several figures share: rows per workload and prompt length, scaling rows,
the mlx-lm prompt-cache file a load reads, and figures still waiting for their parts."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from kvstore.bench.harness import Bar, BenchContext, Case, Figure
from kvstore.bench.results import FigureResult, Row
from kvstore.bench.workloads import SyntheticKV, synthetic_kv

__all__ = [
    "OursCase",
    "MIB",
    "prompt_params",
    "per_prompt",
    "per_prompt_run",
    "scaling_rows",
    "scaling_metric",
    "prompt_cache_file",
    "pending_figure",
]

MIB = 1 << 20

#: How a figure gets its "ours" case once the part it measures exists: given the
#: context and the workload, a context manager that sets up (a store holding
#: the prefix, say), yields the timed case (role ``ours``, name ``ours``) and
#: cleans up after the row is measured.
OursCase = Callable[[BenchContext, SyntheticKV], AbstractContextManager[Case]]


def prompt_params(kv: SyntheticKV, nbytes: int) -> dict[str, Any]:
    """A row's params for ``kv``: workload, tokens, and the MiB each call moves."""
    return {"workload": kv.shape.name, "tokens": kv.tokens, "mib": nbytes / MIB}


def per_prompt(ctx: BenchContext, measure: Callable[[SyntheticKV], Row | list[Row]]) -> list[Row]:
    """``measure`` at every workload and prompt length of the run, then the scaling rows."""
    rows: list[Row] = []
    for workload in ctx.sizes.workloads:
        for tokens in ctx.sizes.prompt_lengths:
            measured = measure(synthetic_kv(workload, tokens))
            rows.extend(measured if isinstance(measured, list) else [measured])
    return rows + scaling_rows(rows)


def per_prompt_run(
    measure: Callable[[BenchContext, SyntheticKV], Row | list[Row]],
) -> Callable[[BenchContext], FigureResult]:
    """A figure's ``run``: :func:`per_prompt` of ``measure(ctx, kv)``."""
    return lambda ctx: FigureResult(per_prompt(ctx, lambda kv: measure(ctx, kv)))


def scaling_metric(case: str) -> str:
    """Name of the value: ``case``'s largest time per MiB over its smallest, across prompts."""
    return f"{case} s/MiB max/min"


def scaling_rows(rows: Sequence[Row]) -> list[Row]:
    """How flat each case's time per MiB is across prompt lengths, per series.

    BENCHMARKS.md: restore and save must be linear in tokens, time per MiB
    flat within 25% from 512 to 8192 tokens; the value is ``max / min`` of
    the median time per MiB (1.0 = perfectly linear). A series is the rows
    whose params agree but for ``tokens`` and ``mib`` (a workload, or a
    workload in one mode); one measured at fewer than two lengths gets no row.
    """
    series: dict[tuple[tuple[str, Any], ...], list[Row]] = {}
    for row in rows:
        if "mib" in row.params and "tokens" in row.params:
            key = tuple((k, v) for k, v in row.params.items() if k not in ("tokens", "mib"))
            series.setdefault(key, []).append(row)
    out = []
    for key, mine in series.items():
        tokens = sorted({r.params["tokens"] for r in mine})
        if len(tokens) < 2:
            continue
        values = {}
        for case in [c for c in mine[0].samples if all(c in r.samples for r in mine)]:
            per_mib = [r.spread(case).median / r.params["mib"] for r in mine]
            values[scaling_metric(case)] = max(per_mib) / min(per_mib)
        name = " ".join(str(v) for _, v in key)
        label = f"{name} per-MiB time, {tokens[0]}-{tokens[-1]} tokens"
        out.append(Row(label, {**dict(key), "scaling": True, "tokens": tokens}, values=values))
    return out


@contextmanager
def prompt_cache_file(ctx: BenchContext, caches: list[Any], name: str) -> Iterator[Path]:
    """``caches`` saved by mlx-lm's ``save_prompt_cache`` in the scratch directory;
    the file is removed afterwards."""
    from mlx_lm.models.cache import save_prompt_cache

    path = ctx.scratch / f"{name}.safetensors"
    save_prompt_cache(str(path), caches)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def pending_figure(
    figure_id: str, title: str, peer: str, bars: Sequence[Bar], reason: str
) -> Figure:
    """A figure whose parts are not on main yet: listed with its bars as not measured yet."""

    def run(ctx: BenchContext) -> FigureResult:
        return FigureResult(pending=reason)

    return Figure(figure_id, title, peer, tuple(bars), run)
