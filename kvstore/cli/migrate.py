"""``kvstore migrate SRC [DST] --to SIGNATURE``: re-encode a store's records into
another family (``kv:plain`` -> ``kv:quant:8:64`` halves a store), or
``--format-version N`` into another record format; with neither, copy every record
as it is (checked) into a store of today's layout (an LMDB store written before large
values went to a file beside it moves to that layout: ``--in-place`` does it in place).

SRC is only read; DST gets the same keys, prompts and settings (where its large values
live is DST's own: a new LMDB store keeps them in its value file). Lossy
conversions are named before anything is written and their measured error
(relative MSE of K and V) is reported per layer at the end. An interrupted
migration resumes when run again with the same arguments. ``--in-place``
(LMDB only) migrates into a sibling directory and swaps it in atomically.
Exit status 0 when every block was migrated, 1 when some were skipped
(corrupt or newer-format records in SRC), 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvstore.cli.options import add_json, command_parser, layout_argument, parse_size
from kvstore.cli.output import human_bytes, print_fields, print_json, print_table
from kvstore.store.maintenance.migrate import (
    DEFAULT_BATCH_BYTES,
    MigrationPlan,
    MigrationReport,
    migrate,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = command_parser(
        sub,
        "migrate",
        "re-encode a store into another family (or record format), or copy it into today's layout",
        __doc__,
        store=False,
    )
    p.add_argument("src", metavar="SRC", help="the store to read (lmdb:///path, redis://...)")
    p.add_argument("dst", metavar="DST", nargs="?", help="where the migrated store goes")
    p.add_argument(
        "--to",
        metavar="SIGNATURE|LAYOUT|FILE",
        help="target family, e.g. kv:quant:8:64; or one per layer: a layout such as "
        "'default=kv:quant:4:64;sliding=kv:quant:8:64;0=kv:quant:8:64', or a layout file "
        "(kvstore tune --out)",
    )
    p.add_argument(
        "--layers",
        metavar="SPEC",
        help="layers to convert: all (default), global, sliding, or indices like 0-3,7",
    )
    p.add_argument(
        "--format-version", type=int, metavar="N", help="re-encode records in format N (only 1)"
    )
    p.add_argument("--dry-run", action="store_true", help="write nothing; say what would be done")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty DST")
    p.add_argument(
        "--in-place", action="store_true", help="replace SRC (LMDB) with its migrated copy"
    )
    p.add_argument(
        "--batch-bytes",
        metavar="SIZE",
        default=None,
        help=f"new record bytes per DST commit (default {human_bytes(DEFAULT_BATCH_BYTES)})",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    batch = (
        DEFAULT_BATCH_BYTES
        if args.batch_bytes is None
        else parse_size(args.batch_bytes, "--batch-bytes", "migrate")
    )
    bar: Any = None

    def on_plan(plan: MigrationPlan) -> None:
        nonlocal bar
        line = plan.lossy_line()
        if line:
            print(line, file=sys.stderr, flush=True)
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(
                total=plan.blocks,
                unit="block",
                desc="dry run" if args.dry_run else "migrate",
                disable=None,  # only on a terminal
                file=sys.stderr,
            )

    def progress(blocks: int, nbytes: int) -> None:
        if bar is not None:
            bar.update(blocks)

    def notice(line: str) -> None:
        if bar is not None:
            bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    try:
        report = migrate(
            args.src,
            args.dst,
            to=None if args.to is None else layout_argument(args.to, "migrate"),
            layers=args.layers,
            format_version=args.format_version,
            dry_run=args.dry_run,
            overwrite=args.overwrite,
            in_place=args.in_place,
            batch_bytes=batch,
            on_plan=on_plan,
            progress=progress,
            notice=notice,
        )
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print_json(_as_json(report))
    else:
        _print(report)
    return 1 if report.skipped else 0


def _as_json(report: MigrationReport) -> dict[str, Any]:
    plan = report.plan
    return {
        "source": plan.source,
        "destination": plan.destination,
        "dry_run": report.dry_run,
        "to": plan.to,
        "layers": plan.layers.spec,
        "format_version": plan.format_version,
        "destination_state": plan.destination_state,
        "blocks": report.blocks,
        "resumed": report.resumed,
        "skipped": [{"key": k, "reason": r} for k, r in report.skipped],
        "left_out": report.left_out,
        "pruned": report.pruned,
        "bytes_before": report.bytes_before,
        "bytes_after": report.bytes_after,
        "bytes_after_estimated": report.dry_run,
        "ratio": report.ratio,
        "conversions": [
            {"source": d.source, "target": d.target, "layers": list(d.layers), "lossy": d.lossy}
            for d in report.directions
        ],
        "errors": [
            {
                "layer": e.layer,
                "source": e.source,
                "target": e.target,
                "tokens": e.tokens,
                "rel_mse_keys": e.mean_keys,
                "rel_mse_values": e.mean_values,
                "max_rel_mse_keys": e.max_keys,
                "max_rel_mse_values": e.max_values,
            }
            for e in report.errors
        ],
        "settings": plan.settings,
        "swapped": report.swapped,
    }


_STATES = {
    "absent": "absent: it will be created",
    "empty": "an empty store",
    "resumable": "an interrupted migration: it resumes",
    "overwrite": "not empty: --overwrite replaces its contents",
}


def _print(report: MigrationReport) -> None:
    plan = report.plan
    approx = "~" if report.dry_run else ""
    where = f"{plan.source} in place" if plan.in_place else f"{plan.source} -> {plan.destination}"
    fields: list[tuple[str, Any]] = [
        ("migration", where),
        ("re-encode", _what(plan)),
        ("destination", _STATES[plan.destination_state]),
        (
            "blocks",
            f"{report.blocks}"
            + (f" ({report.resumed} from an interrupted run)" if report.resumed else ""),
        ),
        (
            "bytes",
            f"{human_bytes(report.bytes_before)} -> {approx}{human_bytes(report.bytes_after)} "
            f"({approx}{report.ratio:.2f}x)"
            + (" estimated by converting one record per layout" if report.dry_run else ""),
        ),
        ("storage policy", plan.settings.storage_policy),
    ]
    if report.pruned:
        fields.append(("pruned", f"{report.pruned} blocks SRC no longer holds"))
    if report.skipped:
        reasons = ", ".join(sorted({r for _, r in report.skipped}))
        fields.append(
            (
                "skipped",
                f"{len(report.skipped)} records ({reasons}) and the {report.left_out} blocks "
                f"after them; run 'kvstore verify {plan.source}'",
            )
        )
    if report.dry_run:
        fields.insert(0, ("dry run", "nothing was written"))
    print_fields(fields)
    if report.directions:
        print()
        print_table(
            ["conversion", "layers", "lossy"],
            [
                [
                    f"{d.source} -> {d.target}",
                    ",".join(map(str, d.layers)),
                    "yes" if d.lossy else "no",
                ]
                for d in report.directions
            ],
        )
    if report.errors:
        print()
        print_table(
            ["layer", "conversion", "tokens", "rel MSE K", "rel MSE V", "max K", "max V"],
            [
                [
                    e.layer,
                    f"{e.source} -> {e.target}",
                    e.tokens,
                    f"{e.mean_keys:.3e}",
                    f"{e.mean_values:.3e}",
                    f"{e.max_keys:.3e}",
                    f"{e.max_values:.3e}",
                ]
                for e in report.errors
            ],
        )


def _what(plan: MigrationPlan) -> str:
    parts = []
    if plan.to is not None:
        parts.append(f"layers {plan.layers.spec} to {plan.to}")
    if plan.format_version is not None:
        parts.append(f"records in format {plan.format_version}")
    return "; ".join(parts) or "nothing: records copied as they are (checked)"
