"""``kvstore export URL --namespace N --tokens TOKENS_FILE --out FILE [--format mlx-lm|kvstore]``:
write the longest stored prefix of some tokens to a prompt-cache file.

The caches are restored in the families the store's records hold. ``--format
mlx-lm`` (the default) writes a file stock ``mlx_lm.models.cache.load_prompt_cache``
loads (plain, quantized and sliding-window plain caches), in the layout of the
installed mlx-lm (``--mlx-lm-layout``: mlx-lm 0.32 changed it, and Python 3.10 gets
0.31); ``--format kvstore`` a kvstore ``.safetensors`` snapshot file (any family;
``kvstore import`` reads both).
"""

from __future__ import annotations

import argparse

from kvstore.cli.options import add_json, command_parser, read_tokens
from kvstore.cli.output import human_bytes, print_json
from kvstore.codecs.prompt_cache import LAYOUTS, LOADED_BY, installed_file_layout

OPERATION = "export"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = command_parser(
        sub, "export", "write a stored prefix as an mlx-lm prompt-cache file", __doc__
    )
    p.add_argument("--namespace", "-n", metavar="N", required=True, help="the namespace")
    p.add_argument("--tokens", metavar="FILE", required=True, help="the prompt's token ids")
    p.add_argument("--out", metavar="FILE", required=True, help="the file to write")
    p.add_argument(
        "--format",
        choices=("mlx-lm", "kvstore"),
        default="mlx-lm",
        help="mlx-lm: a prompt-cache file (default); kvstore: a snapshot file",
    )
    p.add_argument(
        "--mlx-lm-layout",
        choices=("auto", *LAYOUTS),
        default="auto",
        help=f"an mlx-lm file's layout: current ({LOADED_BY['current']}), legacy "
        f"({LOADED_BY['legacy']}); auto (default): the installed mlx-lm's, current without one",
    )
    add_json(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvstore.store.maintenance.cache_files import export_cache_file
    from kvstore.store.maintenance.inventory import open_existing

    tokens = read_tokens(args.tokens, OPERATION)
    layout = args.mlx_lm_layout
    if layout == "auto":
        layout = installed_file_layout()
    with open_existing(args.url, operation=OPERATION) as store:
        result = export_cache_file(store, args.namespace, tokens, args.out, args.format, layout)
    if args.json:
        print_json(
            {
                "store": store.url,
                "namespace": args.namespace,
                **vars(result),
                "path": str(result.path),
            }
        )
        return 0
    scope = "all" if result.tokens == result.requested else "the longest stored prefix"
    families = ", ".join(sorted(set(result.families)))
    print(
        f"exported {result.tokens} of the {result.requested} tokens in {args.tokens} ({scope}) "
        f"from namespace {args.namespace}"
    )
    print(
        f"to {result.path}: {result.format} file, {len(result.families)} layers of {families}, "
        f"{human_bytes(result.bytes)}"
    )
    if result.format == "mlx-lm":
        print(f"load it with mlx_lm.models.cache.load_prompt_cache(path) ({LOADED_BY[layout]})")
    return 0
