"""``kvstore migrate``'s library: re-encode a store's records into another family.

>>> report = migrate("lmdb:///var/kv", "lmdb:///var/kv-q8", to="kv:quant:8:64")  # doctest: +SKIP
>>> report.ratio, [(e.layer, e.mean_keys, e.mean_values) for e in report.errors]  # doctest: +SKIP

DST keeps SRC's keys, index, namespaces, last uses and settings; only the
records (and their sizes, in the index and totals) change. SRC is only read,
except by ``in_place=True``, which migrates an LMDB store into a sibling
directory and swaps the two atomically. Memory holds one batch of blocks;
an interrupted migration resumes when run again with the same parameters
(:mod:`~kvstore.store.maintenance.migrate.journal`). Each step is in its own module:
:mod:`~.targets` (which layers become what), :mod:`~.recode` (one record),
:mod:`~.plan` (checks and decisions), :mod:`~.run` (the walk), :mod:`~.swap`
(the atomic exchange).
"""

from __future__ import annotations

from kvstore.store.maintenance.migrate.journal import JOURNAL_KEY, Journal, LayerError
from kvstore.store.maintenance.migrate.plan import (
    IN_PLACE_SUFFIX,
    Direction,
    MigrationPlan,
    plan_migration,
)
from kvstore.store.maintenance.migrate.recode import LayerChange, Recoded, recode_record
from kvstore.store.maintenance.migrate.run import DEFAULT_BATCH_BYTES, MigrationReport, migrate
from kvstore.store.maintenance.migrate.targets import (
    LayerSelection,
    check_format_version,
    parse_layer_spec,
    parse_target,
    target_for,
)

__all__ = [
    "migrate",
    "plan_migration",
    "MigrationPlan",
    "MigrationReport",
    "Direction",
    "LayerError",
    "LayerChange",
    "Recoded",
    "recode_record",
    "Journal",
    "JOURNAL_KEY",
    "DEFAULT_BATCH_BYTES",
    "IN_PLACE_SUFFIX",
    "LayerSelection",
    "parse_layer_spec",
    "parse_target",
    "target_for",
    "check_format_version",
]
