"""``python -m tools.demo_model train|verify``: train the demo model, or check an export.

python -m tools.demo_model train --recipe toy --out /tmp/demo-model
python -m tools.demo_model verify kvstore/demo/model
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .recipes import RECIPES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.demo_model", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a recipe and write its mlx-lm directory")
    t.add_argument("--recipe", choices=sorted(RECIPES), default="h200")
    t.add_argument("--out", type=Path, required=True, help="the export directory")
    t.add_argument("--tokenizer", type=Path, help="reuse this tokenizer.json")
    t.add_argument("--time-budget", type=float, help="seconds of training (recipe's default)")
    t.add_argument("--max-steps", type=int, help="steps at most (recipe's default)")
    t.add_argument("--max-epochs", type=float, help="passes over the corpus at most")
    t.add_argument(
        "--corpus", type=Path, help="a standard library's directory (this Python's by default)"
    )
    t.add_argument("--no-verify", action="store_true", help="skip the check of the export")
    v = sub.add_parser("verify", help="check an export (size, tokenizer, both loaders)")
    v.add_argument("dir", type=Path)
    args = parser.parse_args(argv)

    if args.command == "verify":
        from .verify import ExportCheckError, check

        try:
            for line in check(args.dir):
                print(line)
        except ExportCheckError as exc:
            print(exc, file=sys.stderr)
            return 1
        return 0

    import dataclasses

    from .pipeline import run

    recipe = RECIPES[args.recipe]
    overrides = {
        k: v
        for k, v in (
            ("time_budget_s", args.time_budget),
            ("max_steps", args.max_steps),
            ("max_epochs", args.max_epochs),
        )
        if v is not None
    }
    if overrides:
        recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, **overrides))
    run(
        recipe,
        args.recipe,
        args.out,
        tokenizer_file=args.tokenizer,
        corpus_root=args.corpus,
        verify=not args.no_verify,
        say=lambda line: print(line, flush=True),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
