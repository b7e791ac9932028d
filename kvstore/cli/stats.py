"""``kvstore stats URL``: blocks and bytes by family and by namespace, settings, engine.

Hit and miss counters (with miss reasons) belong to an open store handle and
are not persisted -- persisting them would put a write on every lookup. This
command opens the store just now, so it has none to show; a serving process
reads its own with ``store.stats()``. It says so rather than print zeros.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from kvstore.abc.store import MissReason, PrefixStore
from kvstore.cli.options import add_json, command_parser
from kvstore.cli.output import human_bytes, print_fields, print_json, print_table
from kvstore.errors import CapabilityError
from kvstore.store.engines import lmdb_values
from kvstore.store.maintenance.inventory import open_existing

ACTIVITY_NOTE = (
    "hit/miss counters belong to each open store handle and are not persisted; this command "
    "opened the store just now, so it has none. A process reads its own with store.stats() "
    f"(lookups, hits, misses by reason: {', '.join(MissReason.ALL)})."
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = command_parser(sub, "stats", "blocks and bytes by family and namespace", __doc__)
    add_json(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    with open_existing(args.url, operation="stats") as store:
        stats = store.stats(by_family=True)
        settings = store.settings
        keeps_files = _keeps_value_file(store)
    families = dict(sorted((stats.by_family or {}).items(), key=lambda kv: -kv[1]))
    # Recurrent checkpoints (hybrid models, issue 16), counted apart; shown when there are any.
    checkpoints = (
        {"checkpoints": stats.checkpoints, "checkpoint_bytes": stats.checkpoint_bytes}
        if stats.checkpoints
        else {}
    )
    if args.json:
        print_json(
            {
                "store": store.url,
                "blocks": stats.blocks,
                "bytes": stats.bytes,
                **checkpoints,
                "max_bytes": stats.max_bytes,
                "settings": settings,
                "by_family": families,
                "namespaces": stats.namespaces,
                "backend": stats.backend,
                "activity": None,
                "activity_note": ACTIVITY_NOTE,
            }
        )
        return 0
    engine = stats.backend
    print_fields(
        [
            ("store", store.url),
            ("engine", engine.get("engine", "-")),
            ("blocks", stats.blocks),
            ("bytes", f"{human_bytes(stats.bytes)} ({stats.bytes} B)"),
            *(
                [
                    (
                        "checkpoints",
                        f"{stats.checkpoints} recurrent checkpoints, "
                        f"{human_bytes(stats.checkpoint_bytes)} of the bytes",
                    )
                ]
                if checkpoints
                else []
            ),
            ("budget", human_bytes(stats.max_bytes) if stats.max_bytes else "none"),
            ("block size", f"{settings.block_size} tokens"),
            ("storage policy", settings.storage_policy),
            *([("large values", _where_values(settings.values, args.url))] if keeps_files else []),
            *(
                (name, human_bytes(engine[key]))
                for name, key in (
                    ("file size", "file_bytes"),
                    ("value file size", "value_file_bytes"),
                    ("map size", "map_size"),
                )
                if engine.get(key)
            ),
            *(
                [("value file free", _value_file_free(engine, args.url))]
                if engine.get("value_file_bytes")
                else []
            ),
        ]
    )
    print()
    print_table(
        ["family", "bytes", "share"],
        [
            [
                fam or "(unlabelled)",
                human_bytes(n),
                f"{100 * n / stats.bytes:.1f}%" if stats.bytes else "-",
            ]
            for fam, n in families.items()
        ],
    )
    print()
    print_table(
        ["namespace", "blocks", "bytes", "budget"],
        [
            [ns, s.blocks, human_bytes(s.bytes), human_bytes(s.max_bytes)]
            for ns, s in sorted(stats.namespaces.items())
        ],
    )
    print()
    print(f"activity: {ACTIVITY_NOTE}")
    return 0


def _value_file_free(engine: Mapping[str, Any], url: str) -> str:
    """The value file's freed space: later saves write there first, and what ends the
    file is cut off by the next write once no read sees it; migrating the store in
    place gives the rest back to the filesystem."""
    free = int(engine.get("value_file_free_bytes", 0))
    extents = int(engine.get("value_file_free_extents", 0))
    if not free:
        return "none"
    return (
        f"{human_bytes(free)} in {extents} extent{'s' if extents != 1 else ''}, reused by "
        f"later saves; the file's free end is given back by the next write "
        f"(`kvstore migrate {url} --in-place` gives back all of it)"
    )


def _keeps_value_file(store: PrefixStore) -> bool:
    """Whether the store's backend can keep a value file (a tiered store has no one
    backend: its tiers' own stats say)."""
    try:
        return store.backend.supports_value_file
    except CapabilityError:
        return False


def _where_values(values: str, url: str) -> str:
    """Where a store that can keep a value file keeps its large values, and, for one
    written before the file, how to move them there."""
    least = human_bytes(lmdb_values.VALUE_MIN)
    if values == "file":
        return f"{least} or more: in {lmdb_values.FILE_NAME} beside LMDB"
    return (
        f"in LMDB's pages (this store's layout; `kvstore migrate {url} --in-place` moves "
        f"values of {least} or more to {lmdb_values.FILE_NAME})"
    )
