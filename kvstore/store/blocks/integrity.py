"""What ``verify()`` does: one pass over every key, a report, and the repair.

Finds corrupt records (the store's ``verify`` callable raises, or the record
is not the size its index entry says), records a newer kvstore wrote (kept),
orphans (blocks whose parent is gone), dangling keys (an index entry without
its record, a record without its entry, a last use without a block, keys
that are none of these) and namespace totals that disagree with the blocks.
"""

from __future__ import annotations

from dataclasses import replace

from kvstore.abc.store import ReadView, RecordVerifier, VerifyReport, WriteView
from kvstore.errors import CorruptEntryError, FormatVersionError
from kvstore.store import keys as K
from kvstore.store.blocks.index import (
    IndexEntry,
    decode_entry,
    entry_matches_key,
    iter_entries,
    read_use,
)
from kvstore.store.blocks.removal import delete_subtree
from kvstore.store.blocks.stats import add_totals, stored_totals

__all__ = ["Survey"]


class Survey:
    """One pass over every ``kvstore/v1`` key, classified; then a report or a repair."""

    def __init__(self) -> None:
        self.records: dict[bytes, int] = {}
        self.entries: dict[bytes, tuple[bytes, IndexEntry]] = {}  # record key -> (index key, entry)
        self.bad_entries: list[bytes] = []
        # (use key, record key, the index key it names: None if damaged)
        self.uses: list[tuple[bytes, bytes, bytes | None]] = []
        self.corrupt: list[bytes] = []
        self.newer: list[bytes] = []
        # Stored totals: (blocks, bytes, checkpoints, checkpoint bytes); None if damaged.
        self.totals: dict[bytes, tuple[int, int, int, int] | None] = {}

    def run(self, view: ReadView, verify: RecordVerifier) -> None:
        self.totals = stored_totals(view)
        for key, value in view.scan(K.SCHEMA):
            if key in K.META_KEYS:
                continue
            if key.startswith(K.NS_TOTALS_DIR):
                if not K.is_namespace(key[len(K.NS_TOTALS_DIR) :]):
                    self.bad_entries.append(key)  # a damaged key: see stored_totals
                continue
            parts = K.split_record_key(key)
            if parts is not None:
                self.records[key] = len(value)
                try:
                    verify(memoryview(value))
                except CorruptEntryError:
                    self.corrupt.append(key)
                except FormatVersionError:
                    self.newer.append(key)
                continue
            ns, _, rest = key[len(K.SCHEMA) :].partition(b"/")
            if rest.startswith((b".c/", b".t/")):
                try:
                    entry = decode_entry(value)
                except (CorruptEntryError, FormatVersionError):
                    self.bad_entries.append(key)
                    continue
                if not entry_matches_key(key, entry):  # damaged: not the block its key names
                    self.bad_entries.append(key)
                    continue
                self.entries[K.record_key(ns, entry.digest)] = (key, replace(entry, tokens=None))
            elif rest.startswith(b".u/"):
                found = read_use(value)
                rkey = K.SCHEMA + ns + b"/" + rest[3:]
                self.uses.append((key, rkey, None if found is None else found[1]))
            else:
                self.bad_entries.append(key)

    def _classify(self) -> tuple[list[bytes], list[bytes], list[str], list[bytes]]:
        """(orphans, dangling keys, totals mismatches, blocks to remove with their subtrees)."""
        corrupt = set(self.corrupt)
        for rkey, (_, entry) in self.entries.items():
            if rkey in self.records and self.records[rkey] != entry.nbytes:
                corrupt.add(rkey)  # the record is not the one the index describes
        self.corrupt = sorted(corrupt)
        orphans = []
        for rkey, (_, entry) in self.entries.items():
            if entry.parent != K.ROOT:
                ns = K.split_record_key(rkey)[0]  # type: ignore[index]
                if K.record_key(ns, entry.parent) not in self.entries:
                    orphans.append(rkey)
        dangling = list(self.bad_entries)
        # An entry without its record: reported as dangling, removed with everything
        # stored after it (no lookup can reach past it; their last uses go with them).
        missing = [rkey for rkey in self.entries if rkey not in self.records]
        dangling += [self.entries[rkey][0] for rkey in missing]
        dangling += [rkey for rkey in self.records if rkey not in self.entries]
        dangling += [  # a last use of no block, or damaged, or naming another index key
            ukey
            for ukey, rkey, ikey in self.uses
            if rkey not in self.entries or ikey != self.entries[rkey][0]
        ]
        counted: dict[bytes, tuple[int, int]] = {}
        checkpoints: dict[bytes, tuple[int, int]] = {}
        for rkey, (_, entry) in self.entries.items():
            ns = K.split_record_key(rkey)[0]  # type: ignore[index]
            b, n = counted.get(ns, (0, 0))
            counted[ns] = (b + 1, n + entry.nbytes)
            if entry.checkpointed:
                c, cb = checkpoints.get(ns, (0, 0))
                checkpoints[ns] = (c + 1, cb + entry.checkpoint_nbytes)
        mismatch = []
        for ns in sorted(set(self.totals) | set(counted)):
            stored, found = self.totals.get(ns, (0, 0, 0, 0)), counted.get(ns, (0, 0))
            if stored is None:
                mismatch.append(f"{ns.decode()}: stored totals damaged, counted {found}")
            else:
                stored_ck, found_ck = stored[2:], checkpoints.get(ns, (0, 0))
                if stored[:2] != found:
                    mismatch.append(f"{ns.decode()}: stored {stored[:2]}, counted {found}")
                if stored_ck != found_ck:
                    mismatch.append(
                        f"{ns.decode()}: checkpoints stored {stored_ck}, counted {found_ck}"
                    )
        return (
            sorted(orphans),
            sorted(dangling),
            mismatch,
            sorted({*self.corrupt, *orphans, *missing}),
        )

    def report(self, repaired: bool) -> VerifyReport:
        orphans, dangling, mismatch, _ = self._classify()
        return VerifyReport(
            blocks=len(self.records),
            bytes=sum(self.records.values()),
            corrupt=tuple(self.corrupt),
            newer_format=tuple(sorted(self.newer)),
            orphans=tuple(orphans),
            dangling=tuple(dangling),
            totals_mismatch=tuple(mismatch),
            repaired=repaired,
        )

    def repair(self, txn: WriteView) -> None:
        _, dangling, _, remove = self._classify()
        for rkey in remove:
            if rkey in self.entries and txn.contains(self.entries[rkey][0]):
                ns, digest = K.split_record_key(rkey)  # type: ignore[misc]
                delete_subtree(txn, ns, self.entries[rkey][0], digest)
        for key in dangling:
            txn.delete(key)
        # Totals from what is left.
        for key, _ in list(txn.scan(K.NS_TOTALS_DIR)):
            txn.delete(key)
        for ns in {K.split_record_key(r)[0] for r in self.entries}:  # type: ignore[index]
            blocks = nbytes = checkpoints = checkpoint_bytes = 0
            for sub in (b".c/", b".t/"):
                for _, entry in iter_entries(txn, K.namespace_dir(ns) + sub, with_tokens=False):
                    blocks += 1
                    nbytes += entry.nbytes
                    checkpoints += entry.checkpointed
                    checkpoint_bytes += entry.checkpoint_nbytes
            add_totals(
                txn,
                ns,
                blocks,
                nbytes,
                checkpoints=checkpoints,
                checkpoint_bytes=checkpoint_bytes,
            )
