"""``kvstore delete URL --namespace N [--tokens FILE]``: forget a namespace, or the
blocks of every stored prompt that starts with the given tokens.

Blocks shared with prompts that do not start with those tokens stay, so the
remaining chains stay whole. The value file's freed end goes back to the filesystem at
once, where no other process's read still sees it.
"""

from __future__ import annotations

import argparse

from kvstore.cli.options import add_json, command_parser, read_tokens
from kvstore.cli.output import human_bytes, print_json
from kvstore.store.maintenance.inventory import (
    give_back_space,
    open_existing,
    require_namespace,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = command_parser(
        sub, "delete", "forget a namespace, or the prompts starting with some tokens", __doc__
    )
    p.add_argument("--namespace", "-n", metavar="N", required=True, help="the namespace")
    p.add_argument("--tokens", metavar="FILE", help="only prompts starting with these token ids")
    add_json(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    tokens = () if args.tokens is None else read_tokens(args.tokens, "delete")
    with open_existing(args.url, writable=True, operation="delete") as store:
        require_namespace(store, args.namespace, "delete")
        before = store.stats().namespaces.get(args.namespace)
        removed = store.delete(args.namespace, tokens)
        given_back = give_back_space(store)
        after = store.stats().namespaces.get(args.namespace)
    freed = (before.bytes if before else 0) - (after.bytes if after else 0)
    if args.json:
        print_json(
            {
                "store": store.url,
                "namespace": args.namespace,
                "blocks": removed,
                "bytes": freed,
                "file_bytes_given_back": given_back,
            }
        )
        return 0
    scope = (
        "" if args.tokens is None else f" starting with the {len(tokens)} tokens of {args.tokens}"
    )
    print(f"deleted {removed} blocks ({human_bytes(freed)}) from namespace {args.namespace}{scope}")
    if given_back:
        print(f"gave {human_bytes(given_back)} of the value file back to the filesystem")
    return 0
