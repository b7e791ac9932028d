"""``verify`` with every repair there is: the library call behind ``kvstore verify [--fix]``.

The store's own :meth:`~kvstore.abc.store.PrefixStore.verify` finds damage in
its records, index, totals and settings, and in the engine's structures
(``Backend.check``), and repairs what a transaction can. A damaged LMDB file
is repaired first, by rebuilding it (:mod:`kvstore.store.maintenance.rebuild`):
its B-tree or free list cannot be trusted with a write.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import lmdb

from kvstore.abc.store import VerifyReport
from kvstore.errors import StoreError
from kvstore.store.engines.lmdb_file import check_file
from kvstore.store.maintenance.inventory import lmdb_path, open_existing
from kvstore.store.maintenance.rebuild import Rebuilt, rebuild_lmdb

__all__ = ["Verified", "verify_store"]


@dataclass(frozen=True)
class Verified:
    """What :func:`verify_store` found, and the store after its repairs."""

    store: str
    found: VerifyReport
    after: VerifyReport
    rebuilt: Rebuilt | None = None

    @property
    def clean(self) -> bool:
        return self.after.clean


def verify_store(url: str, *, repair: bool = False, rebuild: bool = False) -> Verified:
    """Verify the store at ``url`` (which must exist); with ``repair``, fix what was found.

    An LMDB file with structural damage is not opened through LMDB at all: the
    report lists what reading the file found, and ``repair`` rebuilds it first
    (the keys that read intact are kept), then the store-level repair runs.

    Args:
        url: the store.
        repair: fix what was found.
        rebuild: (LMDB, with ``repair``) rebuild the file even where reading it finds
            no damage: for damage that only LMDB trips over (a crashed scan).

    Raises:
        KVStoreError: the store cannot be opened or repaired (the message says why).
    """
    path = lmdb_path(url)
    engine: tuple[str, ...] = ()
    rebuilt = None
    if path is not None and os.path.exists(os.path.join(path, "data.mdb")):
        engine = tuple(check_file(path).problems)
        if engine and not repair:
            # LMDB itself would follow the damage (and may abort the process, or fault):
            # report what the file's own reading found; --fix rebuilds it first.
            report = VerifyReport(engine=engine)
            return Verified(url, report, report)
        if engine or (repair and rebuild):
            rebuilt = rebuild_lmdb(path, url=url)
    try:
        store_url, found, after = _verify_open(url, repair)
    except StoreError as exc:
        # Damage only LMDB trips over, found as the repair writes (the file's own
        # reading missed it: "Located page was wrong type"): rebuild, then repair.
        if not (repair and path is not None and rebuilt is None and _lmdb_damage(exc)):
            raise
        rebuilt = rebuild_lmdb(path, url=url)
        store_url, found, after = _verify_open(url, repair)
        engine = (f"LMDB found damage as the repair wrote: {exc.__cause__}",)
    if engine:
        found = replace(found, engine=engine, repaired=repair)
    return Verified(store_url, found, after, rebuilt)


def _verify_open(url: str, repair: bool) -> tuple[str, VerifyReport, VerifyReport]:
    with open_existing(url, writable=repair, operation="verify", recover=True) as store:
        found = store.verify(repair=repair)
        after = store.verify() if found.repaired else found
        return store.url, found, after


def _lmdb_damage(exc: StoreError) -> bool:
    """Whether ``exc`` is LMDB reporting a damaged page (its error is the cause)."""
    return isinstance(exc.__cause__, (lmdb.CorruptedError, lmdb.PageNotFoundError))
