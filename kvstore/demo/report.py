"""The demo's table and summary: every figure as a session measured it."""

from __future__ import annotations

from collections import Counter
from typing import TextIO

from kvstore.cli.output import human_bytes, print_fields, print_table
from kvstore.demo.runner import DemoReport, SessionRow, seconds

__all__ = ["print_report", "answer_lines", "speedup", "TABLE_HEADERS"]

#: Lines of an answer shown under the table (answers are at most --answer-tokens long).
ANSWER_LINES = 8

TABLE_HEADERS = (
    "session",
    "turn",
    "prompt",
    "reused",
    "TTFT no store",
    "TTFT",
    "speed-up",
    "lookup",
    "saved",
    "mlx-lm file",
)


def speedup(report: DemoReport, row: SessionRow) -> float:
    """The baseline's TTFT over the session's (both measured)."""
    return report.baseline.ttft_s / row.result.ttft_s


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('s') else 's'}"


def _turn(row: SessionRow) -> str:
    return "new" if row.follows is None else f"follows {row.follows + 1}"


def _lookup(row: SessionRow) -> str:
    r = row.result
    misses = sum(r.misses.values())
    if r.hits and not misses:
        return "hit"
    reasons = ",".join(sorted(r.misses)) or "-"
    return f"miss ({reasons})" if not r.hits else f"hit, miss ({reasons})"


def answer_lines(report: DemoReport) -> list[str]:
    """Each session's question and, indented under it, its answer as the model wrote it."""
    if any(row.answer_text is None for row in report.sessions):
        return [
            "answers: token ids only (seeded weights write no text; drop --config for the "
            "shipped model)"
        ]
    lines = [
        f"answers ({report.decoding}; the code the model wrote into answers.py, not a "
        f"checked answer):"
    ]
    for row in report.sessions:
        lines.append(f"{row.index + 1:>3}  {row.question}")
        text = "".join(c if c.isprintable() or c == "\n" else " " for c in row.answer_text or "")
        shown = [line.rstrip() for line in text.expandtabs(4).split("\n")]
        while shown and not shown[-1]:
            shown.pop()
        while shown and not shown[0]:  # the blank lines a new file's code starts with
            shown.pop(0)
        if not shown:
            shown = ["(whitespace only)" if text else "(nothing: the model ended at once)"]
        if len(shown) > ANSWER_LINES:
            shown = shown[:ANSWER_LINES] + ["..."]
        lines.extend(f"       {line}" for line in shown)
    return lines


def print_report(report: DemoReport, out: TextIO | None = None) -> None:
    """The table, each session's answer, then what the store holds against the mlx-lm
    files, lookups, BLAS, time."""
    base = seconds(report.baseline.ttft_s)
    print_table(
        TABLE_HEADERS,
        [
            [
                row.index + 1,
                _turn(row),
                row.result.prompt_tokens,
                row.result.reused_tokens,
                base,
                seconds(row.result.ttft_s),
                f"{speedup(report, row):6.1f}x",
                _lookup(row),
                human_bytes(row.result.saved_bytes),
                human_bytes(row.result.mlx_lm_file_bytes),
            ]
            for row in report.sessions
        ],
        out,
    )
    print(file=out)
    for line in answer_lines(report):
        print(line, file=out)
    print(file=out)
    results = [row.result for row in report.sessions]
    misses: Counter[str] = Counter()
    for r in results:
        misses.update(r.misses)
    added = report.bytes_after - report.bytes_before
    files = report.mlx_lm_files_bytes
    ratio = f"{files / report.bytes_after:.1f}x the store" if report.bytes_after else "-"
    hits = sum(r.hits for r in results)
    miss_text = ", ".join(f"{reason} {n}" for reason, n in sorted(misses.items())) or "none"
    print_fields(
        [
            (
                "stored",
                f"{human_bytes(report.bytes_after)} in {report.blocks_after} blocks for this "
                f"model ({human_bytes(added)} added by this run)",
            ),
            (
                "mlx-lm",
                f"{human_bytes(files)} for the {len(results)} sessions' prompt-cache files "
                f"({ratio}; written by {report.mlx_lm_writer} and measured)",
            ),
            (
                "lookups",
                f"{sum(r.lookups for r in results)}: {_count(hits, 'hit')}, "
                f"{_count(sum(misses.values()), 'miss')} ({miss_text})",
            ),
            ("BLAS", "; ".join(report.blas_ran) + " (as the session processes reported)"),
            (
                "baseline",
                f"TTFT without a store measured once, in a fresh process, on the "
                f"{report.baseline.prompt_tokens}-token prompt of session "
                f"{report.baseline_of + 1}, the shortest (longer prompts take longer, so "
                f"their speed-ups are if anything understated)",
            ),
            ("time", f"{report.seconds:.0f} s for the whole demo"),
        ],
        out,
    )
    print(file=out)
    if report.warm:
        print(
            f"This run started warm: {report.store} already held this model's blocks, so "
            f"session 1 reused its prompt too.",
            file=out,
        )
    else:
        print(
            f"Run it again (make demo): the store stays in {report.store}, so the next run "
            f"starts warm.",
            file=out,
        )
