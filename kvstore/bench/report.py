"""The printed table of a run; its last line is the one-line summary of bars met/missed."""

from __future__ import annotations

from kvstore.bench.results import NOT_MEASURED, BenchResults, FigureRecord, Row

__all__ = ["format_table", "format_seconds", "format_number"]

_INDENT = "    "


def format_seconds(seconds: float) -> str:
    """``seconds`` in the unit that keeps three significant digits readable."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def format_number(value: float) -> str:
    """Whole thousands with separators, smaller numbers to four significant digits."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def format_table(results: BenchResults) -> str:
    """The whole table: machine line, each figure, and the summary line last."""
    m = results.machine
    blas = (m.get("blas") or {}).get("mlx", "?")
    rev = (results.git or {}).get("revision", "not a checkout")[:12]
    dirty = " (dirty)" if (results.git or {}).get("dirty") else ""
    touch = m.get("memory_touch")
    memory = (
        f"; new memory faulted in at {touch['first']:.2g} GB/s ({touch['reused']:.2g} reused)"
        if touch
        else ""
    )
    lines = [
        f"kvstore bench{' --quick' if results.quick else ''}: {results.repeats} repetitions, "
        f"median [IQR]; ratios are medians of per-repetition ratios (>1: ours faster)",
        f"machine: {m.get('cpu')}, {m.get('usable_cpus')} cpus, "
        f"{(m.get('memory_bytes') or 0) / 2**30:.0f} GiB, {m.get('os')}, {m.get('python')}; "
        f"mlx BLAS: {blas}; git {rev}{dirty}{memory}",
    ]
    for record in results.figures:
        lines.append("")
        lines.extend(_figure_lines(record))
    lines.append("")
    lines.append(results.summary_line())
    return "\n".join(lines)


def _figure_lines(record: FigureRecord) -> list[str]:
    lines = [f"{record.id}  {record.title}  [{record.status}]"]
    if record.peer:
        lines.append(f"{_INDENT}against: {record.peer}")
    statuses = record.bar_statuses()
    if statuses:
        lines.append(
            f"{_INDENT}bars: " + "; ".join(f"{text} ({s})" for text, s in statuses.items())
        )
    if record.error:
        lines.append(f"{_INDENT}error: {record.error}")
    elif record.result.pending:
        lines.append(f"{_INDENT}{NOT_MEASURED}: {record.result.pending}")
    for row in record.result.rows:
        lines.append(_INDENT + _row_line(row, record))
    lines.extend(f"{_INDENT}note: {note}" for note in record.result.notes)
    return lines


def _row_line(row: Row, record: FigureRecord) -> str:
    parts = [row.label]
    for case in row.samples:
        s = row.spread(case)
        parts.append(
            f"{case} {format_seconds(s.median)} [{format_seconds(s.q1)}-{format_seconds(s.q3)}]"
        )
    for name, r in row.ratios.items():
        parts.append(f"{name} {r.median:.3g}x [{min(r.per_rep):.3g}-{max(r.per_rep):.3g}]")
    for name, value in row.values.items():
        parts.append(f"{name} {format_number(value)}")
    verdicts = [
        f"{c.bar}: {c.status}"
        for c in record.checks
        if c.row == row.label and c.status != NOT_MEASURED
    ]
    if verdicts:
        parts.append("<- " + ", ".join(verdicts))
    if row.pending:
        parts.append(f"({NOT_MEASURED}: {row.pending})")
    return "  ".join(parts)
