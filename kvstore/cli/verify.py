"""``kvstore verify URL [--fix]``: check every record's checksums and the chain structure.

Reports corrupt records, records a newer kvstore wrote (kept: a newer reader
reads them), orphans (blocks whose parent is gone), dangling keys and
namespace totals that disagree with the blocks. Only ``--fix`` changes the
store: it removes corrupt blocks and orphans with everything stored after
them, removes dangling keys and rewrites the totals, in one transaction.
Exit status 0 when the store is clean (after ``--fix``), 1 when problems remain.
An LMDB file with damage in its own structures (B-trees, free list) is
reported without being opened through LMDB, and ``--fix`` rebuilds it from
every key that reads intact (``--rebuild``: even where none is found).

The scan runs in a child process: a damaged LMDB page that LMDB itself reads
can still fault the process that reads it (the README's reliability notes),
and a crash of the scan is then reported as damage, in one line with exit
status 2, instead of killing the command.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

from kvstore.abc.store import VerifyReport
from kvstore.cli.options import add_json, command_parser
from kvstore.cli.output import human_bytes, print_json, print_table
from kvstore.errors import CorruptEntryError
from kvstore.store.maintenance.repair import verify_store

__all__ = ["add_parser", "run"]

EXIT_PROBLEMS = 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = command_parser(sub, "verify", "check checksums and chains; repair only with --fix", __doc__)
    p.add_argument(
        "--fix", action="store_true", help="remove corrupt blocks, orphans and dangling keys"
    )
    p.add_argument(
        "--rebuild",
        action="store_true",
        help="with --fix (LMDB): rebuild the file from every key that reads intact, even "
        "where no damage is found (after a crashed scan)",
    )
    # The child process the command runs the scan in (see the module docstring).
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    add_json(p)
    p.set_defaults(run=run)


def _problems(report: VerifyReport) -> list[tuple[str, tuple[object, ...]]]:
    return [
        ("engine", report.engine),
        ("settings", report.settings),
        ("corrupt", report.corrupt),
        ("orphans", report.orphans),
        ("dangling", report.dangling),
        ("totals mismatch", report.totals_mismatch),
    ]


def run(args: argparse.Namespace) -> int:
    if not args.in_process:
        return _run_child(args)
    result = verify_store(args.url, repair=args.fix, rebuild=args.rebuild)
    found, after = result.found, result.after
    status = 0 if after.clean else EXIT_PROBLEMS
    if args.json:
        print_json(
            {"store": result.store, "found": found, "after": after, "clean": result.clean}
            | ({"rebuilt": result.rebuilt} if result.rebuilt else {})
        )
        return status
    print(f"checked {found.blocks} records ({human_bytes(found.bytes)}) in {result.store}")
    rows = [
        [
            name,
            len(items),
            ", ".join(_text(i) for i in items[:3]) + (" ..." if len(items) > 3 else ""),
        ]
        for name, items in [*_problems(found), ("newer format", found.newer_format)]
    ]
    print_table(["problem", "count", "first"], rows)
    if found.newer_format:
        print(
            f"note: {len(found.newer_format)} records were written by a newer kvstore; they "
            f"are kept (this reader serves them as misses)."
        )
    count = sum(len(items) for _, items in _problems(found))
    if result.rebuilt is not None:
        r = result.rebuilt
        print(
            f"rebuilt the damaged file: kept {r.keys} keys ({human_bytes(r.bytes)}) that read "
            f"intact; what the damage made unreadable is recomputed when next needed."
        )
    if found.repaired:
        state = "the store is clean." if after.clean else "problems remain."
        print(f"fixed: removed or rewrote {count} problems; {state}")
    elif count:
        print(f"{count} problems; run 'kvstore verify {args.url} --fix' to remove them.")
    else:
        print("clean.")
    return status


def _run_child(args: argparse.Namespace) -> int:
    """Run this command again with ``--in-process`` in a child; its crash is damage."""
    argv = [sys.executable, "-m", "kvstore.cli"]
    argv += ["--debug"] if getattr(args, "debug", False) else []
    argv += ["verify", args.url, "--in-process"]
    argv += ["--fix"] if args.fix else []
    argv += ["--rebuild"] if args.rebuild else []
    argv += ["--json"] if args.json else []
    # Output is relayed through this process's streams (they may not be its fds).
    child = subprocess.run(argv, capture_output=True, text=True)
    sys.stdout.write(child.stdout)
    sys.stderr.write(child.stderr)
    code = child.returncode
    if code >= 0:
        return code
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    raise CorruptEntryError(
        f"[verify] Reading {args.url} crashed the scan ({name}): its file is damaged where "
        f"the storage engine itself reads it. Run 'kvstore verify {args.url} --fix "
        f"--rebuild', which rebuilds the file from what reads intact without the engine "
        f"(or move the store aside: it is a cache, and what it held is recomputed).",
        url=args.url,
        signal=name,
    )


def _text(item: object) -> str:
    return item.decode("utf-8", "backslashreplace") if isinstance(item, bytes) else str(item)
