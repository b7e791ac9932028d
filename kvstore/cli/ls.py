"""``kvstore ls URL [--namespace N]``: the namespaces of a store, or one namespace's
prompts and blocks."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from kvstore.abc.store import NamespaceStats
from kvstore.cli.options import add_json, command_parser
from kvstore.cli.output import human_bytes, print_fields, print_json, print_table, short, when
from kvstore.store.maintenance.inventory import (
    BlockInfo,
    list_blocks,
    list_prompts,
    open_existing,
    require_namespace,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = command_parser(
        sub, "ls", "list namespaces (or one namespace's prompts and blocks)", __doc__
    )
    p.add_argument(
        "--namespace", "-n", metavar="N", help="list this namespace's prompts and blocks"
    )
    add_json(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    with open_existing(args.url, operation="ls") as store:
        if args.namespace is not None:
            blocks = list_blocks(store, require_namespace(store, args.namespace, "ls"))
            return _namespace(args, blocks)
        namespaces = store.stats().namespaces
        block_size = store.block_size
    return _store(args, store.url, block_size, namespaces)


def _store(
    args: argparse.Namespace, url: str, block_size: int, namespaces: Mapping[str, NamespaceStats]
) -> int:
    if args.json:
        rows = [
            {"namespace": ns, "blocks": s.blocks, "bytes": s.bytes, "max_bytes": s.max_bytes}
            for ns, s in sorted(namespaces.items())
        ]
        print_json({"store": url, "block_size": block_size, "namespaces": rows})
        return 0
    print_fields(
        [("store", url), ("block size", f"{block_size} tokens"), ("namespaces", len(namespaces))]
    )
    if namespaces:
        print()
        print_table(
            ["namespace", "blocks", "bytes", "budget"],
            [
                [ns, s.blocks, human_bytes(s.bytes), human_bytes(s.max_bytes)]
                for ns, s in sorted(namespaces.items())
            ],
        )
    return 0


def _namespace(args: argparse.Namespace, blocks: list[BlockInfo]) -> int:
    prompts = list_prompts(blocks)
    if args.json:
        print_json({"namespace": args.namespace, "prompts": prompts, "blocks": blocks})
        return 0
    total = human_bytes(sum(b.bytes for b in blocks))
    print(f"{len(prompts)} prompts in {len(blocks)} blocks ({total})")
    print()
    print_table(
        ["tokens", "blocks", "bytes", "last use", "last block"],
        [
            [p.tokens, p.blocks, human_bytes(p.bytes), when(p.last_use), short(p.leaf_key[-64:])]
            for p in prompts
        ],
    )
    print()
    print_table(
        ["block", "index", "tokens", "kind", "bytes", "family", "last use", "parent"],
        [
            [
                short(b.digest),
                b.index,
                f"{b.start}-{b.start + b.tokens}",
                "full" if b.full else "tail",
                human_bytes(b.bytes),
                b.family or "-",
                when(b.last_use),
                short(b.parent) if b.parent else "-",
            ]
            for b in blocks
        ],
    )
    return 0
