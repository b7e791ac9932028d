"""``kvstore bench``: measure the performance figures of BENCHMARKS.md.

Every figure is a ratio measured side by side in this process (ours
against a peer or the memcpy limit, interleaved repetitions, median of
>= 5). Prints a table whose last line is the one-line summary of bars
met/missed, and writes every raw sample to ``DIR/bench-results.json``.
Exit status 0 when every figure ran (a missed bar is a result, not an
error), 1 when one raised.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvstore.bench.harness import MIN_REPEATS


def parse_only(text: str) -> list[str]:
    """``"P1,p4"`` -> ``["P1", "P4"]``, each a known figure id."""
    from kvstore.bench.runner import select_figures

    ids = [part.strip().upper() for part in text.split(",") if part.strip()]
    try:
        select_figures(ids)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return ids


def parse_repeats(text: str) -> int:
    """A repetition count of at least :data:`MIN_REPEATS`."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < MIN_REPEATS:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= {MIN_REPEATS} (a figure is a median of >= {MIN_REPEATS}); "
            f"received {text!r}"
        )
    return value


def command_line(args: argparse.Namespace) -> list[str]:
    """The command that reproduces this run (recorded in the results)."""
    cmd = ["kvstore", "bench"]
    if args.quick:
        cmd.append("--quick")
    if args.only:
        cmd += ["--only", ",".join(args.only)]
    if args.repeats is not None:
        cmd += ["--repeats", str(args.repeats)]
    return [*cmd, "--out", str(args.out)]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="measure the performance figures (BENCHMARKS.md)",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes: a smoke run (about three minutes on a 2-core machine)",
    )
    p.add_argument(
        "--only",
        type=parse_only,
        default=None,
        metavar="P1,P4",
        help="measure only these figures (comma-separated ids; see --list)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("."),
        metavar="DIR",
        help="directory for bench-results.json (and the plot); default: here",
    )
    p.add_argument(
        "--repeats",
        type=parse_repeats,
        default=None,
        metavar="N",
        help=f"timed repetitions per case, >= {MIN_REPEATS} (default {MIN_REPEATS} with "
        "--quick, else 7)",
    )
    p.add_argument(
        "--plot",
        action="store_true",
        help="also draw bench-scaling.png (needs matplotlib: mlx-kvstore[plot])",
    )
    p.add_argument("--list", action="store_true", help="list the figures and exit")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvstore.bench.figures import FIGURES
    from kvstore.bench.plot import PLOT_FILE, plot_scaling
    from kvstore.bench.report import format_table
    from kvstore.bench.runner import run_bench

    if args.list:
        for figure in FIGURES.values():
            print(f"{figure.id:<4} {figure.title}")
        return 0
    results, path = run_bench(
        args.only,
        quick=args.quick,
        repeats=args.repeats,
        out_dir=args.out,
        command=command_line(args),
    )
    print(format_table(results))
    print(f"wrote {path}", file=sys.stderr)
    if args.plot:
        try:
            print(f"wrote {plot_scaling(results, args.out / PLOT_FILE)}", file=sys.stderr)
        except (ImportError, ValueError) as exc:
            print(f"kvstore bench: no plot: {exc}", file=sys.stderr)
    return 1 if any(f.status == "error" for f in results.figures) else 0
