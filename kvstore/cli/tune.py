"""``kvstore tune MODEL_DIR --budget BITS_PER_VALUE|BYTES_PER_TOKEN --text FILE``: pick
each layer's cache family by measured sensitivity, within a budget.

Per layer and per candidate family, the next-token KL of encoding that layer
alone in the family, on FILE (BENCHMARKS.md's protocol: the model in float32,
``--windows`` windows of ``--prefill`` tokens then ``--continuation`` as one
chunk, KL against plain caches); then one family per layer meeting the budget
with the least summed KL (an exact multiple-choice knapsack), measured as a
whole beside uniform layouts of the same budget. Prints the table and writes
the layout to ``--out`` (a layout file: ``CachePolicy.from_file`` for generate,
``kvstore migrate --to FILE``). ``--budget 4.5`` is average bits per value;
``--budget 1152B`` bytes per token over all layers; ``--budget 3.5,4.5`` chooses
for each budget from one sweep, into ``layout-3.5.json`` and ``layout-4.5.json``
(``--out``'s name with the budget).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvstore.cli.options import add_json, command_parser
from kvstore.cli.output import print_fields, print_json, print_table

__all__ = ["add_parser", "run", "text_tokens"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = command_parser(
        sub, "tune", "choose per-layer cache families by measured sensitivity", __doc__, store=False
    )
    p.add_argument("model", metavar="MODEL_DIR", help="an mlx-lm model directory")
    p.add_argument(
        "--budget",
        required=True,
        metavar="BITS|BYTES",
        help="average bits per value (4.5) or bytes per token over all layers (1152B); "
        "several, comma-separated, share one sweep",
    )
    p.add_argument("--text", required=True, metavar="FILE", help="the text to measure on")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("layout.json"),
        metavar="FILE",
        help="where the layout file goes (default: layout.json)",
    )
    p.add_argument(
        "--candidates",
        metavar="KINDS",
        help="families to consider: kinds or signatures, comma-separated (default: every "
        "registered growing family)",
    )
    p.add_argument(
        "--compare",
        metavar="SIGNATURES",
        help="uniform layouts to measure beside the choice (default: the best of each kind "
        "within the budget)",
    )
    p.add_argument("--windows", type=int, default=4, metavar="N", help="text windows (4)")
    p.add_argument("--prefill", type=int, default=1024, metavar="N", help="prefill tokens (1024)")
    p.add_argument(
        "--continuation", type=int, default=256, metavar="N", help="continuation tokens (256)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json(p)
    p.set_defaults(run=run)


def text_tokens(path: Path, tokenizer: Any, vocab_size: int) -> list[int]:
    """The token ids of the text in ``path``: the model's tokenizer, or its bytes for a
    byte-level model (vocabulary of 256 or more) without one.

    Raises:
        FileNotFoundError: no such file.
        ValueError: no tokenizer and a vocabulary too small for bytes.
    """
    raw = path.read_bytes()
    if tokenizer is not None:
        return list(tokenizer.encode(raw.decode("utf-8", errors="replace")))
    if vocab_size < 256:
        raise ValueError(
            f"[tune] {path}: the model has no tokenizer and {vocab_size} token ids, too few "
            f"for bytes. Give a model directory with tokenizer files."
        )
    return list(raw)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ValueError as exc:  # bad budget, short text, unknown candidates
        if args.debug or isinstance(exc, _ours()):
            raise
        print(f"kvstore tune: error: {exc}", file=sys.stderr)
        return 2


def _ours() -> type[Exception]:
    from kvstore.errors import KVStoreError

    return KVStoreError


def _run(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from kvstore.model import load_model
    from kvstore.model.tune import Sweep, parse_budget

    budgets = [parse_budget(b) for b in _split(args.budget) or [args.budget]]
    text = Path(args.text)
    if not text.is_file():
        raise FileNotFoundError(f"[tune] No text file at {text}.")
    model, tokenizer = load_model(args.model, dtype=mx.float32)  # the protocol's dtype
    tokens = text_tokens(text, tokenizer, model.args.vocab_size)
    sweep = Sweep.plan(model, _split(args.candidates))
    for budget in budgets:
        sweep.check(budget)  # before the sweep, which takes minutes
    bar: Any = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=sweep.runs, unit="run", desc="tune", disable=None, file=sys.stderr)

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.update(done - bar.n)

    try:
        sweep.measure(
            tokens,
            windows=args.windows,
            prefill=args.prefill,
            continuation=args.continuation,
            progress=progress,
        )
    finally:
        if bar is not None:
            bar.close()
    results = [sweep.choose(budget, _split(args.compare)) for budget in budgets]
    run_info = {
        "model": str(Path(args.model).resolve()),
        "text": str(text.resolve()),
        "windows": args.windows,
        "prefill": args.prefill,
        "continuation": args.continuation,
    }
    documents = []
    for result in results:
        out = _out_path(args.out, result.budget, len(results))
        record = {**run_info, **result.to_dict()}
        result.policy.to_file(out, tune=record)
        documents.append({"layout": result.policy.to_layout().text(), "out": str(out), **record})
    if args.json:
        print_json(documents[0] if len(documents) == 1 else documents)
        return 0
    _print_table(results[0])
    for result, doc in zip(results, documents):
        print()
        _print_choice(result, Path(doc["out"]))
    for (i, s), why in sweep.skipped.items():
        print(f"note: layer {i} {s} skipped: {why}", file=sys.stderr)
    return 0


def _out_path(out: Path, budget: Any, count: int) -> Path:
    if count == 1:
        return out
    unit = "" if budget.unit == "bits" else "B"
    return out.with_name(f"{out.stem}-{budget.value:g}{unit}{out.suffix or '.json'}")


def _split(text: str | None) -> list[str] | None:
    return None if text is None else [t.strip() for t in text.split(",") if t.strip()]


def _print_table(result: Any) -> None:
    sweep = result.sweep
    layers = sweep.layers
    rows = []
    for s in sorted(
        {s for i in layers for s in sweep.kl[i]}, key=lambda s: (result.uniform_bits(s), s)
    ):
        cells = [f"{sweep.kl[i][s]:.4f}" if s in sweep.kl[i] else "-" for i in layers]
        rows.append([s, f"{result.uniform_bits(s):.3f}", *cells])
    print("next-token KL of each family on one layer alone")
    print_table(["family", "bits/value", *(f"layer {i}" for i in layers)], rows)


def _print_choice(result: Any, out: Path) -> None:
    measured = result.measured
    fields = [
        ("budget", str(result.budget)),
        ("layout", result.policy.to_layout().text()),
        (
            "cost",
            f"{result.bits_per_value():.3f} bits per value, {result.bytes_per_token()} B/token",
        ),
        (
            "KL",
            f"{measured.kl:.4f} measured (top-1 {measured.top1:.2%}); "
            f"{result.predicted_kl:.4f} summed over layers alone",
        ),
    ]
    for s, m in result.uniform.items():
        line = f"KL {m.kl:.4f} (top-1 {m.top1:.2%}) at {result.uniform_bits(s):.3f} bits per value"
        if m.kl > 0:
            line += f"; the layout's KL is {1 - measured.kl / m.kl:.0%} lower"
        fields.append((f"uniform {s}", line))
    fields.append(("wrote", str(out)))
    print_fields(fields)
