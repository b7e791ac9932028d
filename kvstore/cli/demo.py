"""``kvstore demo [--store URL] [--model DIR | --config NAME]``: sessions in fresh processes
share a long context through a prefix store; a table shows what each reused and how much
sooner its first token came, then what each answered.

A first session prefills a system prompt and a document of a few thousand tokens
plus a question, answers and saves; further sessions, each a fresh process, ask
other questions over the same context, and one follows up an earlier turn. The
model is the small one kvstore ships (a llama trained on the standard library's
sources, 4-bit, ~7 MB: it writes Python); ``--model DIR`` takes any mlx-lm
directory, ``--config small`` seeded weights that answer in token ids;
``--shipped-model-dir`` prints the shipped model's directory for other tools. Answers
are greedy with a presence penalty (``--presence-penalty``, 0 for plain greedy). The
store (by default the LMDB directory ./kvstore-demo) is kept, so a second run
starts warm. Model runs use Debian's OpenBLAS when it is installed (LD_PRELOAD
in the sessions' environment) and a smaller context on MLX's bundled BLAS.
"""

from __future__ import annotations

import argparse
import sys

from kvstore.cli.options import DEFAULT_STORE, add_json, command_parser
from kvstore.demo.script import PENALTY_CONTEXT, PRESENCE_PENALTY


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes a whole number >= 1; received {text!r}")
    return value


def _penalty(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"takes a number >= 0; received {text!r}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = command_parser(
        sub, "demo", "sessions in fresh processes reuse a shared context", __doc__, store=False
    )
    p.add_argument(
        "--store",
        metavar="URL",
        default=DEFAULT_STORE,
        help=f"the store (default: the LMDB directory ./{DEFAULT_STORE}, created on first use)",
    )
    p.add_argument(
        "--model",
        metavar="DIR",
        help="an mlx-lm model directory (its tokenizer, or UTF-8 bytes for a byte-level "
        "model) instead of the shipped model",
    )
    p.add_argument(
        "--config",
        metavar="NAME",
        help="seeded weights of a named config (small, tiny, ...) instead of the shipped "
        "model: answers in token ids",
    )
    p.add_argument(
        "--context-tokens",
        type=_positive,
        metavar="N",
        help="shared-context length (default 4096 with OpenBLAS or on macOS, else 1024)",
    )
    p.add_argument(
        "--answer-tokens",
        type=_positive,
        default=48,
        metavar="N",
        help="answer length at most (default 48)",
    )
    p.add_argument(
        "--presence-penalty",
        type=_penalty,
        default=PRESENCE_PENALTY,
        metavar="P",
        help=f"greedy answers with mlx-lm's presence penalty P over the newest "
        f"{PENALTY_CONTEXT} tokens (default {PRESENCE_PENALTY:g}; 0: plain greedy)",
    )
    p.add_argument(
        "--blas",
        choices=("auto", "bundled"),
        default="auto",
        help="auto: preload Debian's OpenBLAS for the sessions when installed; bundled: MLX's own",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--shipped-model-dir",
        action="store_true",
        help="print the shipped model's directory (an mlx-lm directory, for mlx_lm and "
        'kvstore serve: --model "$(kvstore demo --shipped-model-dir)") and exit',
    )
    add_json(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.shipped_model_dir:
        from kvstore.demo.shipped import shipped_model_dir

        print(shipped_model_dir())
        return 0

    from kvstore.cli.output import print_json
    from kvstore.demo.report import print_report
    from kvstore.demo.runner import DemoOptions, SessionFailed, run_demo

    options = DemoOptions(
        store=args.store,
        model_dir=args.model,
        config=args.config,
        context_tokens=args.context_tokens,
        answer_tokens=args.answer_tokens,
        presence_penalty=args.presence_penalty,
        blas=args.blas,
        progress=not args.no_progress,
    )
    # With --json, stdout carries only the JSON document; the running commentary goes to stderr.
    say = (lambda line: print(line, file=sys.stderr)) if args.json else print
    try:
        report = run_demo(options, say=say)
    except SessionFailed as exc:
        print(f"kvstore demo: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print_json(report)
    else:
        print(flush=True)
        print_report(report)
    return 0
