"""``kvstore serve [--store URL] [--tenant T] [mlx_lm.server options]``: mlx-lm's
OpenAI-compatible server whose prompt cache survives restarts and is shared.

Every option kvstore does not know goes to ``mlx_lm.server`` (``--model``,
``--port``, ``--kv-bits``, ``--chat-template``...; ``mlx_lm.server --help``
lists them). Prompts are saved behind the generating thread into the store (an
LMDB directory under the user's cache by default; Redis and tiered URLs too), and
any later server process on the same store -- after a restart, or beside this
one -- reuses the longest stored prefix of each prompt. ``GET /metrics`` is
Prometheus text, ``GET /v1/kvstore/stats`` JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvstore.cli.options import command_parser

#: Where the server's store lives by default: an LMDB directory in the user's cache.
DEFAULT_SERVE_STORE = str(
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvstore" / "serve"
)

#: This subcommand hands the options it does not know to mlx_lm.server.
PASSES_THROUGH = True


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = command_parser(
        sub,
        "serve",
        "mlx-lm's server with a persistent, shared prompt cache",
        __doc__,
        store=False,
    )
    p.add_argument(
        "--store",
        metavar="URL",
        default=None,
        help=f"the store: lmdb:///path, redis://host:6379/0, tiered://?tiers=... "
        f"(default: the LMDB directory {DEFAULT_SERVE_STORE})",
    )
    p.add_argument(
        "--tenant",
        metavar="NAME",
        help="a salt keeping this server's prompts apart in a shared store",
    )
    p.add_argument(
        "--save-queue",
        type=int,
        default=32,
        metavar="N",
        help="saves waiting for the store's writer thread at most; more are dropped (default 32)",
    )
    p.add_argument(
        "--no-warmup",
        dest="warm_up",
        action="store_false",
        help="do not run each model once as it loads (by default its kernels are built "
        "before the first request, not during it)",
    )
    p.add_argument(
        "--warm-decode",
        type=int,
        default=0,
        metavar="TOKENS",
        help="on a CUDA GPU, also build the decode graphs of conversations up to TOKENS "
        "as the model loads (cuDNN builds a graph per 256 tokens of context, the first "
        "time a process meets each: ~35-45 ms a size ahead on an H100; default 0: as "
        "requests meet them). Only requests served one at a time (a seed, a draft model) "
        "take cuDNN's decode: a batched step's mask keeps MLX off it",
    )
    p.set_defaults(run=run, passthrough=PASSES_THROUGH)


def run(args: argparse.Namespace) -> int:
    try:
        import mlx_lm  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError as exc:
        print(
            f"kvstore serve: {exc.name} is not installed; install the server's extra: "
            f"pip install 'mlx-kvstore[serve]'",
            file=sys.stderr,
        )
        return 1
    from kvstore.mlx_lm import check_mlx_lm_version
    from kvstore.serve.server import serve
    from kvstore.store import open_store

    check_mlx_lm_version("kvstore serve")
    store = open_store(args.store or DEFAULT_SERVE_STORE)
    return serve(
        list(getattr(args, "extra", [])),
        store,
        tenant=args.tenant,
        save_queue=args.save_queue,
        warm_up=args.warm_up,
        warm_decode=args.warm_decode,
    )
