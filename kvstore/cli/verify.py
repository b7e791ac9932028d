"""``kvstore verify URL [--fix]``: check every record's checksums and the chain structure.

Reports corrupt records, records a newer kvstore wrote (kept: a newer reader
reads them), orphans (blocks whose parent is gone), dangling keys and
namespace totals that disagree with the blocks. Only ``--fix`` changes the
store: it removes corrupt blocks and orphans with everything stored after
them, removes dangling keys and rewrites the totals, in one transaction.
Exit status 0 when the store is clean (after ``--fix``), 1 when problems remain.
"""

from __future__ import annotations

import argparse

from kvstore.abc.store import VerifyReport
from kvstore.cli.options import add_json, command_parser
from kvstore.cli.output import human_bytes, print_json, print_table
from kvstore.store.maintenance.inventory import open_existing

EXIT_PROBLEMS = 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = command_parser(sub, "verify", "check checksums and chains; repair only with --fix", __doc__)
    p.add_argument(
        "--fix", action="store_true", help="remove corrupt blocks, orphans and dangling keys"
    )
    add_json(p)
    p.set_defaults(run=run)


def _problems(report: VerifyReport) -> list[tuple[str, tuple[object, ...]]]:
    return [
        ("corrupt", report.corrupt),
        ("orphans", report.orphans),
        ("dangling", report.dangling),
        ("totals mismatch", report.totals_mismatch),
    ]


def run(args: argparse.Namespace) -> int:
    with open_existing(args.url, writable=args.fix, operation="verify") as store:
        found = store.verify(repair=args.fix)
        after = store.verify() if found.repaired else found
    status = 0 if after.clean else EXIT_PROBLEMS
    if args.json:
        print_json({"store": store.url, "found": found, "after": after, "clean": after.clean})
        return status
    print(f"checked {found.blocks} records ({human_bytes(found.bytes)}) in {store.url}")
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
    if found.repaired:
        state = "the store is clean." if after.clean else "problems remain."
        print(f"fixed: removed or rewrote {count} problems; {state}")
    elif count:
        print(f"{count} problems; run 'kvstore verify {args.url} --fix' to remove them.")
    else:
        print("clean.")
    return status


def _text(item: object) -> str:
    return item.decode() if isinstance(item, bytes) else str(item)
