"""Planning and running a migration: SRC's blocks, re-encoded, into DST.

The walk goes chain by chain, parents first
(:class:`~kvstore.store.maintenance.transfer.ChainWalk`), a block at a time: read one
record from SRC, re-encode it, queue it; every ``batch_bytes`` of new records
commit in one DST transaction together with the journal
(:mod:`~kvstore.store.maintenance.migrate.journal`). So memory holds at most one batch,
DST always agrees with its journal, and since a block is written only after
its parent, an interrupted DST is a valid store holding a prefix-closed part
of SRC. Blocks already in DST are skipped, which is what makes a rerun
resume. A SRC record that does not decode is skipped with every block after
it. After the walk, DST blocks SRC no longer holds (deleted or evicted
between an interrupted run and its resume) are removed, so DST's index and
totals are exactly those of what it holds.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.abc.store import Backend, PrefixStore, WriteView
from kvstore.codecs.record import read_header, verify_record
from kvstore.errors import CorruptEntryError, FormatVersionError, StoreError
from kvstore.store import open_backend, open_store
from kvstore.store.maintenance.inventory import lmdb_path, open_existing
from kvstore.store.maintenance.migrate.journal import JOURNAL_KEY, Journal, LayerError
from kvstore.store.maintenance.migrate.plan import (
    IN_PLACE_SUFFIX,
    Direction,
    Inputs,
    MigrationPlan,
    merged_directions,
    plan_migration,
    record_directions,
    walks,
)
from kvstore.store.maintenance.migrate.recode import recode_record
from kvstore.store.maintenance.migrate.swap import exchange_paths, require_exchange
from kvstore.store.maintenance.migrate.targets import is_lossy
from kvstore.store.maintenance.transfer import (
    ChainWalk,
    StoredBlock,
    copy_block,
    namespaces_of,
    prune_blocks,
)
from kvstore.store.settings import parse_byte_size

__all__ = ["DEFAULT_BATCH_BYTES", "MigrationReport", "migrate"]

#: New record bytes committed per DST transaction (the resume granularity).
DEFAULT_BATCH_BYTES = 16 << 20

#: ``progress(blocks, bytes_read)``: called after each SRC block is handled.
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class MigrationReport:
    """What a migration did (or, with ``dry_run``, would do).

    Attributes:
        blocks: blocks DST holds from this migration (resumed ones included).
        resumed: of those, blocks an earlier, interrupted run had written.
        skipped: ``(record key, reason)`` of SRC blocks not migrated: ``"corrupt"``
            or ``"newer-format"``.
        left_out: blocks stored after skipped ones, not migrated either (a
            block is useless without its parent).
        pruned: DST blocks removed after the walk because SRC no longer holds
            them (deleted or evicted between an interrupted run and its resume).
        bytes_before, bytes_after: record bytes read from SRC and written to
            DST (``bytes_after`` estimated from samples when ``dry_run``).
        errors: measured error per layer and conversion (empty for a dry run).
    """

    plan: MigrationPlan
    dry_run: bool
    blocks: int
    resumed: int
    skipped: tuple[tuple[str, str], ...]
    left_out: int
    pruned: int
    bytes_before: int
    bytes_after: int
    errors: tuple[LayerError, ...] = ()
    directions: tuple[Direction, ...] = ()
    swapped: bool = False

    @property
    def ratio(self) -> float:
        return self.bytes_after / self.bytes_before if self.bytes_before else 1.0


def migrate(
    src: str,
    dst: str | None = None,
    *,
    to: str | None = None,
    layers: str | None = None,
    format_version: int | None = None,
    dry_run: bool = False,
    overwrite: bool = False,
    in_place: bool = False,
    batch_bytes: int | str = DEFAULT_BATCH_BYTES,
    on_plan: Callable[[MigrationPlan], None] | None = None,
    progress: Progress | None = None,
    notice: Callable[[str], None] | None = None,
) -> MigrationReport:
    """Re-encode the records of the store ``src`` into ``dst``; ``src`` is only read.

    Args:
        src, dst: store URLs. ``dst`` keeps ``src``'s keys, index, namespaces,
            last uses and settings; only records (and their sizes) change.
        to: the family to re-encode the selected layers into (sliding-window
            layers go to its windowed counterpart); ``None`` keeps families.
        layers: ``"all"`` (default), ``"global"``, ``"sliding"`` or ``"0-3,7"``.
        format_version: re-encode every record in this record format (only
            the current one, 1, exists). With neither ``to`` nor this, every
            record is copied as it is (checked): ``dst`` is ``src`` in the layout
            a new store of its backend has (an LMDB store's value file).
        dry_run: plan, read every record header, estimate; write nothing.
        overwrite: replace a non-empty ``dst`` (or another migration's journal).
        in_place: migrate an LMDB store into ``<src>.migrate-tmp`` and swap
            the two directories atomically; the old copy is then removed.
            The store must not be written to meanwhile (checked: the swap is
            refused if it was); processes that keep it open see the old copy
            until they reopen it.
        batch_bytes: new record bytes per DST transaction (``"16MiB"``).
        on_plan: called with the plan before anything is written.
        progress: ``progress(blocks, bytes)`` after each SRC block.
        notice: called with a line for each lossy conversion first met after
            the plan (records of another layout).

    Returns:
        The report; ``errors`` holds the measured relative MSE per layer.

    Raises:
        Everything :func:`plan_migration` raises, before writing; during the
        walk, errors of the stores or codecs, after which ``dst`` is resumable
        (rerun the same migration) and ``src`` untouched.
    """
    plan = plan_migration(
        src,
        dst,
        to=to,
        layers=layers,
        format_version=format_version,
        overwrite=overwrite,
        in_place=in_place,
    )
    batch_limit = parse_byte_size(batch_bytes, "batch_bytes")
    if in_place and not dry_run:
        require_exchange(Path(plan.destination[len("lmdb://") :]).parent)
    if on_plan is not None:
        on_plan(plan)
    if dry_run:
        return _estimate(plan, progress)
    return _Run(plan, batch_limit, progress, notice).run()


def _estimate(plan: MigrationPlan, progress: Progress | None) -> MigrationReport:
    """Check every record as the migration would; estimate the size after by converting
    one record of each layout (families and rows)."""
    inputs = Inputs(plan.to, plan.layers, plan.format_version)
    ratios: dict[tuple[Any, ...], float] = {}
    directions: dict[tuple[str, str], set[int]] = {}
    skipped: list[tuple[str, str]] = []
    before = after = blocks = left_out = 0
    with open_existing(plan.source, operation="migrate") as store:
        for walk in walks(store.backend):
            for block in walk:
                layout = _layout(store.backend, block, plan, ratios)
                if isinstance(layout, Exception):
                    skipped.append((block.record_key.decode(), _reason(layout)))
                if layout is None or isinstance(layout, Exception):
                    walk.skip_after(block)
                    left_out += 0 if layout is None else _subtree_size(store.backend, block)
                    continue
                signatures, nbytes = list(layout[:-1]), block.entry.nbytes
                for d in record_directions(signatures, inputs):
                    directions.setdefault((d.source, d.target), set()).update(d.layers)
                blocks, before = blocks + 1, before + nbytes
                after += round(nbytes * ratios[layout])
                if progress is not None:
                    progress(1, nbytes)
    found = merged_directions(directions)
    return MigrationReport(
        plan,
        True,
        blocks,
        0,
        tuple(skipped),
        left_out,
        0,
        before,
        after,
        (),
        found or plan.directions,
    )


def _layout(
    backend: Backend, block: StoredBlock, plan: MigrationPlan, ratios: dict[tuple[Any, ...], float]
) -> tuple[Any, ...] | Exception | None:
    """``(*signatures, rows)`` of ``block``'s record, with its size ratio put in ``ratios``;
    the error when it does not decode; ``None`` when it is gone."""
    with backend.view_many([block.record_key]) as (view,):
        if view is None:
            return None
        try:
            verify_record(view)
            header = read_header(view)
        except (CorruptEntryError, FormatVersionError) as exc:
            return exc
        # Same families and rows: same size ratio (headers weigh more in short tails).
        rows = max((ly.stop - ly.start for ly in header.layers if ly), default=0)
        layout = (*(None if ly is None else ly.signature for ly in header.layers), rows)
        if layout not in ratios:
            new = recode_record(
                view, to=plan.to, layers=plan.layers, reencode=plan.format_version is not None
            ).record
            ratios[layout] = 1.0 if new is None else len(new) / len(view)
        return layout


def _subtree_size(backend: Backend, block: StoredBlock) -> int:
    """Blocks stored after ``block`` (its descendants)."""
    return sum(1 for _ in ChainWalk(backend, block.namespace, root=block.entry.digest))


def _reason(exc: Exception) -> str:
    return "newer-format" if isinstance(exc, FormatVersionError) else "corrupt"


@dataclass
class _Pending:
    """Blocks read and re-encoded, waiting for the next DST commit."""

    copies: list[tuple[StoredBlock, bytes, str | None, bytes | None, int, Any]] = field(
        default_factory=list
    )
    uses: list[tuple[bytes, bytes]] = field(default_factory=list)
    nbytes: int = 0


class _Run:
    """One run of a planned migration (a first run or a resume)."""

    def __init__(
        self,
        plan: MigrationPlan,
        batch_bytes: int,
        progress: Progress | None,
        notice: Callable[[str], None] | None,
    ) -> None:
        self.plan = plan
        self.batch_bytes = batch_bytes
        self.progress = progress
        self.notice = notice
        self.journal = plan.resume or Journal(
            plan.source, plan.to, plan.layers.spec, plan.format_version
        )
        self.resumed = self.journal.blocks
        self.skipped: list[tuple[str, str]] = []
        self.left_out = 0  # blocks after skipped ones
        self.announced = {(d.source, d.target) for d in plan.directions}
        self.seen: dict[tuple[str, str], set[int]] = {}
        self.inputs = Inputs(plan.to, plan.layers, plan.format_version)

    def run(self) -> MigrationReport:
        plan = self.plan
        txnid: int | None = None
        with open_existing(plan.source, operation="migrate") as src:
            if plan.in_place:
                txnid = src.backend.environment.info()["last_txnid"]  # type: ignore[attr-defined]
            with self._open_destination() as dst:
                self._walk(src, dst)
                pruned = sum(
                    prune_blocks(dst.backend, ns, src.backend.contains_many)
                    for ns in sorted(namespaces_of(dst.backend))
                )
                if not plan.in_place:  # in place, the copy keeps it until the swap is done
                    _drop_journal(dst.backend)
        swapped = False
        if plan.in_place:
            self._swap(txnid)
            swapped = True
        directions = merged_directions(self.seen)
        return MigrationReport(
            plan,
            False,
            self.journal.blocks,
            self.resumed,
            tuple(self.skipped),
            self.left_out,
            pruned,
            self.journal.bytes_before,
            self.journal.bytes_after,
            tuple(self.journal.layer_errors()),
            directions or plan.directions,
            swapped,
        )

    # -- destination ---------------------------------------------------------------

    def _open_destination(self) -> PrefixStore:
        plan, s = self.plan, self.plan.settings
        if plan.destination_state == "overwrite":
            _clear(plan.destination)
        dst = open_store(
            plan.destination,
            verify=verify_record,
            touch_interval=0,
            block_size=s.block_size,
            storage_policy=s.storage_policy,
            max_bytes=s.max_bytes,
            namespace_max_bytes=s.namespace_max_bytes,
        )
        try:
            for ns, budget in s.namespace_budgets.items():
                dst.set_budget(budget, namespace=ns)  # type: ignore[attr-defined]
            journal = self.journal.encode()
            dst.backend.transact(lambda txn: txn.put(JOURNAL_KEY, journal))
        except BaseException:
            dst.close()
            raise
        return dst

    # -- the walk ------------------------------------------------------------------

    def _walk(self, src: PrefixStore, dst: PrefixStore) -> None:
        pending = _Pending()
        for walk in walks(src.backend):
            for block in walk:
                if dst.backend.contains_many([block.record_key])[0]:  # an earlier run's
                    use = src.backend.get_many([block.use_key])[0]
                    if use is not None:  # SRC's last use may be newer than the copy's
                        pending.uses.append((block.use_key, use))
                    nbytes = block.entry.nbytes
                else:
                    record, use = src.backend.get_many([block.record_key, block.use_key])
                    if record is None:  # removed from SRC since the walk listed it
                        walk.skip_after(block)
                        continue
                    if not self._queue(pending, block, record, use):
                        walk.skip_after(block)
                        self.left_out += _subtree_size(src.backend, block)
                    nbytes = len(record)
                if self.progress is not None:
                    self.progress(1, nbytes)
                if pending.nbytes >= self.batch_bytes or len(pending.uses) >= 4096:
                    self._commit(dst, pending)
                    pending = _Pending()
        self._commit(dst, pending)

    def _queue(self, pending: _Pending, block: StoredBlock, record: bytes, use: Any) -> bool:
        """Re-encode ``block`` into ``pending``; False when its record does not decode."""
        try:
            recoded = recode_record(
                record,
                to=self.plan.to,
                layers=self.plan.layers,
                reencode=self.plan.format_version is not None,
            )
        except (CorruptEntryError, FormatVersionError) as exc:
            self.skipped.append((block.record_key.decode(), _reason(exc)))
            return False
        for c in recoded.changes:
            self._announce(c.source, c.target, c.layer)
        new = record if recoded.record is None else recoded.record
        family = None if recoded.record is None else recoded.family
        pending.copies.append((block, new, family, use, len(record), recoded.changes))
        pending.nbytes += len(new)
        return True

    def _announce(self, source: str, target: str, layer: int) -> None:
        self.seen.setdefault((source, target), set()).add(layer)
        if (source, target) in self.announced:
            return
        self.announced.add((source, target))
        if self.notice is not None and is_lossy(source, target):
            self.notice(
                f"lossy: {source} -> {target} (first met at layer {layer}) re-quantises the "
                f"stored rows; its error is reported per layer."
            )

    def _commit(self, dst: PrefixStore, pending: _Pending) -> None:
        if not (pending.copies or pending.uses):
            return

        def write(txn: WriteView) -> Journal:
            # fn may run again (LMDB grows its map and retries): work on a copy.
            journal = copy.deepcopy(self.journal)
            for block, record, family, use, before, changes in pending.copies:
                written = copy_block(txn, block, record, family=family, use=use)
                if written:
                    journal.add(before, written, changes)
            for key, use in pending.uses:
                old = txn.get(key)
                if old is None or bytes(old) != bytes(use):
                    txn.put(key, use)
            txn.put(JOURNAL_KEY, journal.encode())
            return journal

        self.journal = dst.backend.transact(write, size_hint=pending.nbytes)

    # -- in place ------------------------------------------------------------------

    def _swap(self, txnid: int | None) -> None:
        """Exchange SRC and its migrated copy under SRC's write lock, then remove the old."""
        path = lmdb_path(self.plan.source)
        assert path is not None  # in place is refused for other schemes when planning
        source = os.path.realpath(path)
        copy_dir = source + IN_PLACE_SUFFIX
        backend = open_backend(self.plan.source)

        def swap(txn: WriteView) -> None:
            now = backend.environment.info()["last_txnid"]  # type: ignore[attr-defined]
            if now != txnid:
                raise StoreError(
                    f"[migrate] {self.plan.source} was written to during the migration "
                    f"(LMDB transaction {txnid} -> {now}); --in-place needs the store idle. "
                    f"Stop the processes writing to it and rerun: the copy resumes.",
                    found=now,
                    expected=txnid,
                )
            exchange_paths(source, copy_dir)

        try:
            backend.transact(swap)  # holds SRC's writer lock: nothing commits meanwhile
        finally:
            backend.close()
        shutil.rmtree(copy_dir)  # the old store, now at the copy's path
        backend = open_backend(self.plan.source)
        try:
            _drop_journal(backend)
        finally:
            backend.close()


def _drop_journal(backend: Backend) -> None:
    backend.transact(lambda txn: txn.delete(JOURNAL_KEY))


def _clear(url: str) -> None:
    """Remove every kvstore key of the store at ``url`` (for ``overwrite``)."""
    backend = open_backend(url)
    try:
        while True:
            with backend.reader() as view:
                keys = [k for _, k in zip(range(4096), view.keys(b"kvstore/"))]
            if not keys:
                return
            backend.delete_many(keys)
    finally:
        backend.close()
