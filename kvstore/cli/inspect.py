"""``kvstore inspect URL KEY`` or ``kvstore inspect URL --tokens FILE``.

With KEY (``kvstore/v1/<ns>/<hash>``, ``<ns>/<hash>`` or a hash prefix): the
block's index entry and its record -- format, writer, checksum state
(verified, or why not), and per layer the family, codec, token range and
tensors with dtypes and shapes, and the layout (each layer's family, in the
layout grammar of :mod:`kvstore.layout`). Exit status 1 when the record fails
its check.

With ``--tokens FILE``: what a lookup of that prompt finds -- tokens reusable,
the blocks a restore would read (and which rows of each), and whether each
of them passes its check.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvstore.cli.options import add_json, command_parser, read_tokens
from kvstore.cli.output import human_bytes, print_fields, print_json, print_table, short, when
from kvstore.codecs.record import RecordHeader, read_header, verify_record
from kvstore.errors import CorruptEntryError, FormatVersionError, StoreConfigError
from kvstore.layout import LayerLayout
from kvstore.store import keys as K
from kvstore.store.blocks.index import decode_use
from kvstore.store.maintenance.inventory import find_block, open_existing, require_namespace
from kvstore.store.maintenance.transfer import namespaces_of


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = command_parser(
        sub, "inspect", "show one block's record, or what a prompt's lookup would read", __doc__
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("key", nargs="?", metavar="KEY", help="a block key or hash prefix")
    what.add_argument("--tokens", metavar="FILE", help="a prompt's token ids: show its lookup")
    p.add_argument("--namespace", "-n", metavar="N", help="namespace for --tokens (if several)")
    add_json(p)
    p.set_defaults(run=run)


def check_state(record: Any) -> tuple[str, str | None]:
    """``("verified" | "corrupt" | "newer-format", reason)`` of a record."""
    try:
        verify_record(record)
    except CorruptEntryError as exc:
        return "corrupt", str(exc)
    except FormatVersionError as exc:
        return "newer-format", str(exc)
    return "verified", None


def run(args: argparse.Namespace) -> int:
    if args.tokens is not None:
        return _lookup(args)
    with open_existing(args.url, operation="inspect") as store:
        block = find_block(store, args.key)
        record, use = store.backend.get_many([block.record_key, block.use_key])
        bsize = store.block_size
    entry = block.entry
    if record is None:
        raise StoreConfigError(
            f"[inspect] {block.record_key.decode()} has an index entry but no record (it was "
            f"removed meanwhile, or the index dangles). Run 'kvstore verify {args.url}'.",
        )
    state, reason = check_state(record)
    try:
        header: RecordHeader | None = read_header(record)
    except (CorruptEntryError, FormatVersionError):
        header = None
    start = entry.depth * bsize
    info: dict[str, Any] = {
        "key": block.record_key.decode(),
        "namespace": block.namespace.decode(),
        "index": entry.depth,
        "tokens": [start, start + entry.ntokens],
        "full": entry.full,
        "parent": None if entry.parent == K.ROOT else entry.parent.hex(),
        "family": entry.family,
        "bytes": len(record),
        "index_bytes": entry.nbytes,
        "created": entry.created,
        "last_use": None if use is None else decode_use(use)[0],
        "check": state,
        "check_error": reason,
        "header": None if header is None else _header(header),
        "layout": None if header is None else record_layout(header),
    }
    if args.json:
        print_json(info)
        return 0 if state == "verified" else 1
    check = {
        "verified": "verified (xxh3-64 header and payload checksums match)",
        "corrupt": f"CORRUPT: {reason}",
        "newer-format": f"not readable here: {reason}",
    }[state]
    print_fields(
        [
            ("key", info["key"]),
            (
                "block",
                f"{entry.depth} ({'full' if entry.full else 'tail'}), "
                f"tokens {start}-{start + entry.ntokens}",
            ),
            ("parent", short(info["parent"]) if info["parent"] else "- (first block)"),
            ("family", entry.family or "-"),
            *([("layout", info["layout"])] if info["layout"] else []),
            ("bytes", f"{human_bytes(len(record))} ({len(record)} B)"),
            ("created", when(entry.created)),
            ("last use", when(info["last_use"])),
            ("checksum", check),
            *(
                [
                    ("format", f"{header.format}, written by {header.writer}"),
                    (
                        "payload",
                        f"{human_bytes(header.payload_nbytes)} at offset {header.payload_offset}",
                    ),
                    ("meta", dict(header.meta) or "-"),
                ]
                if header is not None
                else []
            ),
        ]
    )
    if header is not None:
        print()
        print_table(
            ["layer", "family", "codec", "tokens", "tensor", "dtype", "shape", "bytes"],
            [row for i, layer in enumerate(header.layers) for row in _layer_rows(i, layer)],
        )
    if len(record) != entry.nbytes:
        print(f"warning: the index says {entry.nbytes} bytes; the record is {len(record)}")
    return 0 if state == "verified" else 1


def record_layout(header: RecordHeader) -> str:
    """The record's family per layer, in the layout grammar (:mod:`kvstore.layout`):
    ``0-1=kv:quant:4:64;2=kv:quant:8:64``, or the one family when every layer has it."""
    held = [(i, layer.signature) for i, layer in enumerate(header.layers) if layer is not None]
    if len({sig for _, sig in held}) == 1 and len(held) == len(header.layers):
        return held[0][1]
    return LayerLayout(layers=tuple(held)).text()


def _header(header: RecordHeader) -> dict[str, Any]:
    return {
        "format": header.format,
        "writer": header.writer,
        "meta": dict(header.meta),
        "payload_offset": header.payload_offset,
        "payload_bytes": header.payload_nbytes,
        "checksum": f"xxh3-64:{header.checksum:016x}",
        "layers": [
            None
            if layer is None
            else {
                "signature": layer.signature,
                "codec": layer.codec,
                "codec_version": layer.codec_version,
                "tokens": [layer.start, layer.stop],
                "meta": dict(layer.meta),
                "tensors": [
                    {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes}
                    for t in layer.tensors
                ],
            }
            for layer in header.layers
        ],
    }


def _layer_rows(i: int, layer: Any) -> list[list[Any]]:
    if layer is None:
        return [[i, "(absent)", "", "", "", "", "", ""]]
    rows = []
    for j, t in enumerate(layer.tensors):
        head = (
            [
                i,
                layer.signature,
                f"{layer.codec} v{layer.codec_version}",
                f"{layer.start}-{layer.stop}",
            ]
            if j == 0
            else ["", "", "", ""]
        )
        rows.append([*head, t.name, t.dtype, "x".join(map(str, t.shape)), t.nbytes])
    return rows or [
        [i, layer.signature, layer.codec, f"{layer.start}-{layer.stop}", "", "", "", ""]
    ]


def _lookup(args: argparse.Namespace) -> int:
    tokens = read_tokens(args.tokens, "inspect")
    with open_existing(args.url, operation="inspect") as store:
        namespace = args.namespace or _only_namespace(store, args.url)
        require_namespace(store, namespace, "inspect")
        before = dict(store.activity().get("misses", {}))
        match = store.lookup(namespace, tokens)
        after = dict(store.activity().get("misses", {}))
        miss = next((r for r in after if after[r] != before.get(r, 0)), None)
        with store.backend.view_many([b.key for b in match.blocks]) as values:
            sizes = [None if v is None else len(v) for v in values]
        with store.read(match.blocks) as views:
            readable = len(views)
    blocks: list[dict[str, Any]] = [
        {
            "key": b.key.decode(),
            "index": b.index,
            "tokens": [b.start, b.stop],
            "rows": b.rows,
            "stored_rows": b.stored_rows,
            "bytes": size,
            "readable": i < readable,
        }
        for i, (b, size) in enumerate(zip(match.blocks, sizes))
    ]
    result = {
        "namespace": namespace,
        "prompt_tokens": match.prompt_tokens,
        "reused_tokens": match.tokens,
        "to_prefill": match.prompt_tokens - match.tokens,
        "miss_reason": miss,
        "blocks": blocks,
        "readable_blocks": readable,
    }
    if args.json:
        print_json(result)
        return 0
    print_fields(
        [
            ("namespace", namespace),
            ("prompt", f"{match.prompt_tokens} tokens"),
            ("reusable", f"{match.tokens} tokens" + (f" (miss: {miss})" if miss else "")),
            ("to prefill", f"{match.prompt_tokens - match.tokens} tokens"),
            ("blocks read", f"{len(blocks)} ({readable} pass their check)"),
        ]
    )
    if blocks:
        print()
        print_table(
            ["block", "index", "tokens", "rows used", "bytes", "check"],
            [
                [
                    short(b["key"].rsplit("/", 1)[1]),
                    b["index"],
                    f"{b['tokens'][0]}-{b['tokens'][1]}",
                    f"{b['rows']}/{b['stored_rows']}",
                    human_bytes(b["bytes"]),
                    "ok" if b["readable"] else "FAILS (restore stops here)",
                ]
                for b in blocks
            ],
        )
    return 0


def _only_namespace(store: Any, url: str) -> str:
    held = sorted(n.decode() for n in namespaces_of(store.backend))
    if len(held) == 1:
        return held[0]
    raise StoreConfigError(
        f"[inspect] --tokens needs --namespace: the store {url} holds "
        + (f"{len(held)} namespaces ({', '.join(held)})." if held else "no namespaces.")
        + f" Run 'kvstore ls {url}' to list them.",
        found=held,
    )
