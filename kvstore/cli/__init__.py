"""The ``kvstore`` console script: one module per subcommand under ``kvstore.cli``.

Each subcommand module exposes ``add_parser(subparsers)`` (which sets
``run=`` as the parser default) and ``run(args) -> int``. A subcommand that
hands options it does not know to another program (``serve`` to
``mlx_lm.server``) also sets ``passthrough=True``; it finds them in
``args.extra``. Errors of our own tree, and bad input the subcommand reports as
such, end in one line on stderr and exit status 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from kvstore.errors import KVStoreError

__all__ = ["main", "build_parser", "SUBCOMMANDS", "EXIT_USAGE"]

#: Subcommand modules under kvstore.cli, in help order (a module registers its
#: command's name: import_cache is ``kvstore import``, as ``import`` is a keyword).
SUBCOMMANDS: tuple[str, ...] = (
    "demo",
    "ls",
    "stats",
    "inspect",
    "verify",
    "gc",
    "delete",
    "migrate",
    "tune",
    "import_cache",
    "export_cache",
    "bench",
    "serve",
)

#: Exit status for bad input (missing store, bad URL, corrupt file, ...).
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstore", description="Persistent KV-cache storage for MLX language models."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"kvstore.cli.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        return int(args.run(args))
    except (KVStoreError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
        if args.debug:
            raise
        print(f"kvstore {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `kvstore ls | head`: the reader left; not an error
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        return 0
    except KeyboardInterrupt:
        print(f"kvstore {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
