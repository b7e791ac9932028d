"""``kvstore gc URL [--max-bytes SIZE] [--namespace N]``: evict least-recently-used
leaf blocks until the store (or one namespace) holds at most SIZE bytes.

Without ``--max-bytes``, enforce the budgets the store was configured with.
Only leaves go (blocks nothing is stored after), so stored chains stay whole. The
value file's freed end goes back to the filesystem at once, where no other process's
read still sees it.
"""

from __future__ import annotations

import argparse

from kvstore.cli.options import add_json, command_parser, parse_size
from kvstore.cli.output import human_bytes, print_fields, print_json
from kvstore.store.maintenance.inventory import (
    give_back_space,
    open_existing,
    require_namespace,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = command_parser(sub, "gc", "evict least-recently-used blocks down to a size", __doc__)
    p.add_argument(
        "--max-bytes",
        metavar="SIZE",
        help="target size: 10GB, 512MiB, 1048576 (default: the configured budgets)",
    )
    p.add_argument("--namespace", "-n", metavar="N", help="only this namespace")
    add_json(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    limit = None if args.max_bytes is None else parse_size(args.max_bytes, "--max-bytes", "gc")
    with open_existing(args.url, writable=True, operation="gc") as store:
        if args.namespace is not None:
            require_namespace(store, args.namespace, "gc")
        before = store.stats()
        freed = store.evict(namespace=args.namespace, max_bytes=limit)
        given_back = give_back_space(store)
        after = store.stats()
    result = {
        "store": store.url,
        "namespace": args.namespace,
        "max_bytes": limit,
        "freed_bytes": freed,
        "blocks_before": before.blocks,
        "blocks_after": after.blocks,
        "bytes_before": before.bytes,
        "bytes_after": after.bytes,
        "file_bytes_given_back": given_back,
    }
    if args.json:
        print_json(result)
        return 0
    print_fields(
        [
            ("target", human_bytes(limit) if limit is not None else "the configured budgets"),
            ("evicted", f"{before.blocks - after.blocks} blocks, {human_bytes(freed)}"),
            ("store now", f"{after.blocks} blocks, {human_bytes(after.bytes)}"),
            *(
                [("given back", f"{human_bytes(given_back)} of the value file")]
                if given_back
                else []
            ),
        ]
    )
    return 0
