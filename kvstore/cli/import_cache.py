"""``kvstore import FILE (--namespace N | --model DIR) --tokens TOKENS_FILE [--store URL]``:
save a prompt cache from a file into a store.

FILE is an mlx-lm prompt-cache file (``save_prompt_cache``, current or older
layout) or a kvstore ``.safetensors`` snapshot file. mlx-lm stores no token ids,
so TOKENS_FILE gives them (a JSON array, a .npy array, or integers separated by
spaces or newlines): exactly as many as the cache holds. The namespace is one the
store already holds (``kvstore ls URL``), or the one ``--model DIR`` computes for
that model directory and the file's cache families (created if new).
"""

from __future__ import annotations

import argparse

from kvstore.cli.options import DEFAULT_STORE, add_json, command_parser, read_tokens
from kvstore.cli.output import human_bytes, print_json

OPERATION = "import"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = command_parser(
        sub, "import", "save an mlx-lm prompt-cache or kvstore snapshot file", __doc__, store=False
    )
    p.add_argument("file", metavar="FILE", help="the prompt-cache file (.safetensors)")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--namespace", "-n", metavar="N", help="a namespace the store holds")
    target.add_argument(
        "--model", metavar="DIR", help="the model directory whose namespace to import into"
    )
    p.add_argument("--tokens", metavar="FILE", required=True, help="the cache's token ids")
    p.add_argument(
        "--store",
        metavar="URL",
        default=DEFAULT_STORE,
        help=f"the store (default ./{DEFAULT_STORE})",
    )
    add_json(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvstore.store import open_store
    from kvstore.store.maintenance.cache_files import (
        check_tokens,
        import_cache_file,
        model_namespace,
        read_cache_file,
    )
    from kvstore.store.maintenance.inventory import open_existing, require_namespace

    tokens = read_tokens(args.tokens, OPERATION)
    cache_file = read_cache_file(args.file, OPERATION)
    check_tokens(cache_file, tokens, args.tokens)
    if args.model is not None:
        namespace = model_namespace(args.model, cache_file.caches, OPERATION)
        store = open_store(args.store)
    else:
        namespace = args.namespace
        store = open_existing(args.store, writable=True, operation=OPERATION)
    with store:
        if args.model is None:
            require_namespace(store, namespace, OPERATION)
        result = import_cache_file(store, namespace, tokens, cache_file)
    saved = result.saved
    if args.json:
        print_json({"store": store.url, "file": str(cache_file.path), **vars(result)})
        return 0
    families = ", ".join(sorted(set(result.families)))
    print(
        f"imported {cache_file.path} ({result.format}: {result.tokens} tokens, "
        f"{len(result.families)} layers of {families})"
    )
    print(
        f"into namespace {namespace} of {store.url}: {len(saved.written)} blocks written "
        f"({human_bytes(saved.written_bytes)}), {saved.deduplicated} already stored"
    )
    print(f"a lookup of these tokens restores {result.served} of them")
    if result.served < result.tokens:
        print(
            "(a sliding-window layer past its window keeps only the whole blocks its window "
            "still held; a prefix restores where every such layer has the blocks it needs)"
        )
    return 0
