"""The prefix store over any backend: lookup, save bookkeeping, reads, deletes, eviction.

Blocks are the unit of storage: ``block_size`` tokens of a prompt, keyed by
the chained hash of everything up to them (:mod:`kvstore.store.keys`). A
prompt's last, partial block is stored too (a *tail*), so an exact or
extended prompt is fully reusable. Records are opaque bytes produced by the
caller's ``encode`` and checked by the ``verify`` the store was opened with.

Lookup (token-exact), for a prompt of ``L`` tokens:

1. walk the chain of the prompt's full blocks while they are stored;
2. among the children of the last matched block (full blocks and tails), take
   the one sharing the longest common prefix with the rest of the prompt, and
   use that many of its rows;
3. leave at least one token for the model: if that covers all ``L`` tokens,
   use one row less (dropping the last block if that leaves it empty).

So a prompt stored whole matches ``L - 1`` tokens, and prompts diverging
mid-block reuse exactly their common prefix.

Saving a prompt writes, in one atomic transaction, its missing blocks, its
tail (unless a stored sibling already starts with the tail's tokens), their
index entries and last uses; it removes stored tails the new blocks extend
(superseded) and evicts least-recently-used leaves when a budget needs room.
Re-saving a stored prefix only hashes and reads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from functools import partial
from typing import Any

from kvstore.abc.store import (
    DURABILITY_MODES,
    Backend,
    BlockRef,
    BlockSave,
    CheckingViews,
    Claim,
    Match,
    MissReason,
    PrefixStore,
    ReadView,
    RecordEncoder,
    RecordVerifier,
    SaveResult,
    StoreStats,
    VerifyReport,
    WriteView,
)
from kvstore.codecs.copied_sums import taking_digests
from kvstore.errors import (
    StoreConfigError,
    StoreError,
    StoreUnavailableError,
)
from kvstore.store import keys as K
from kvstore.store.blocks import meta, saving
from kvstore.store.blocks.checks import start_read_threads
from kvstore.store.blocks.eviction import Block, Budget, budgets, enforce
from kvstore.store.blocks.housekeeping import Housekeeper, Pending, apply_pending
from kvstore.store.blocks.integrity import Survey
from kvstore.store.blocks.matching import last_checkpointed, walk
from kvstore.store.blocks.reading import count_read_end, served_views, why_absent
from kvstore.store.blocks.removal import delete_extending
from kvstore.store.blocks.stats import Counters, all_totals, store_contents, take_repairs
from kvstore.store.kv import CacheMethods
from kvstore.store.kv.writer import DEFAULT_GROUP_WINDOW
from kvstore.store.settings import (
    SETTING_PARSERS,
    StoreSettings,
    parse_bool,
    parse_byte_size,
    parse_fraction,
    parse_seconds,
)

__all__ = ["BlockPrefixStore", "STORE_OPTIONS", "verify_kv_record"]


def _parse_callable(name: str) -> Callable[[Any], Any]:
    def parse(value: Any) -> Any:
        if value is not None and not callable(value):
            raise StoreConfigError(
                f"[open_store] {name} must be a callable or None; received {value!r}.",
                setting=name,
                found=value,
            )
        return value

    return parse


def parse_durability(value: Any) -> str:
    """One of :data:`~kvstore.abc.store.DURABILITY_MODES`."""
    if value not in DURABILITY_MODES:
        raise StoreConfigError(
            f"[open_store] durability must be one of {', '.join(DURABILITY_MODES)}; "
            f"received {value!r}.",
            setting="durability",
            found=value,
            supported=list(DURABILITY_MODES),
        )
    return str(value)


#: Options of the store itself (not persisted), with their parsers.
STORE_OPTIONS: dict[str, Callable[[Any], Any]] = {
    "verify": _parse_callable("verify"),
    "touch_interval": lambda v: parse_seconds(v, "touch_interval"),
    "clock": _parse_callable("clock"),
    "low_water": lambda v: parse_fraction(v, "low_water"),
    "recover": lambda v: parse_bool(v, "recover"),
    "describe": _parse_callable("describe"),
    "durability": parse_durability,
    "group_window": lambda v: parse_seconds(v, "group_window"),
}

_SAVE_ATTEMPTS = 8


@taking_digests  # it is verify_record's
def verify_kv_record(record: memoryview) -> None:
    """The default ``verify``: an intact kvstore record (:mod:`kvstore.codecs.record`).

    Imported on first use, so a store that is only looked up never loads MLX.
    """
    from kvstore.codecs.record import verify_record

    verify_record(record)


def _accept(record: memoryview) -> None:
    """``verify=None``: records are opaque bytes; nothing to check."""


def kv_checkpoint_nbytes(record: Any) -> int:
    """The default ``describe``: bytes of a kvstore record that are recurrent
    checkpoints (:func:`kvstore.codecs.record.checkpoint_nbytes`); imported on first use."""
    from kvstore.codecs.record import checkpoint_nbytes

    return checkpoint_nbytes(record)


def _opaque(record: Any) -> int:
    """``describe=None``: records are opaque; none is known to carry a checkpoint."""
    return 0


class BlockPrefixStore(CacheMethods, PrefixStore):
    """A prefix store of chained blocks over any :class:`~kvstore.abc.store.Backend`.

    Open one with :func:`kvstore.store.open_store`.

    Args:
        backend: the engine (LMDB, memory...).
        verify: ``verify(record)`` raises CorruptEntryError for a bad record;
            called on every record read, and by :meth:`verify`. Default:
            :func:`verify_kv_record` (kvstore's record format, checksums
            included); ``None``: records are opaque, nothing is checked.
        touch_interval: seconds between background writes of recency updates
            (``0``: only when the store writes anyway, or on :meth:`flush`).
        clock: the time source for recency and creation (seconds; tests pass a counter).
        low_water: a save over budget evicts down to this fraction of it.
        recover: open a store whose settings record is damaged (both copies) with
            settings rebuilt from its blocks, for :meth:`verify` to report and repair
            (``kvstore verify`` does); otherwise such a store refuses to open and
            says to run ``kvstore verify --fix``.
        describe: ``describe(record)`` says how many of a record's bytes are a
            recurrent checkpoint at its block's end (issue 16), kept in the index
            and counted apart. Default: :func:`kv_checkpoint_nbytes` (kvstore's
            records, by their header); ``None``: 0 for every record.
        durability: ``"group"`` (default), ``"sync"`` or ``"os"``: how commits are
            made durable (:mod:`kvstore.store.kv.writer`; an LMDB backend is opened
            without syncing for ``"os"``).
        group_window: seconds a group commit waits for more saves handed off.
        **settings: store settings (:class:`~kvstore.store.settings.StoreSettings`).
    """

    _backend: Backend

    def __init__(
        self,
        backend: Backend,
        *,
        verify: RecordVerifier | None = verify_kv_record,
        touch_interval: float = 1.0,
        clock: Callable[[], float] | None = None,
        low_water: float = 0.9,
        recover: bool = False,
        describe: Callable[[Any], int] | None = kv_checkpoint_nbytes,
        durability: str = DURABILITY_MODES[0],
        group_window: float = DEFAULT_GROUP_WINDOW,
        **settings: Any,
    ) -> None:
        super().__init__(backend)
        self.durability = parse_durability(durability)
        self.group_window = parse_seconds(group_window, "group_window")
        unknown = set(settings) - set(SETTING_PARSERS)
        if unknown:
            backend.close()
            raise StoreConfigError(
                f"[open_store] Unknown setting(s) {', '.join(sorted(unknown))}; settings are "
                f"{', '.join(SETTING_PARSERS)}.",
                found=sorted(unknown),
            )
        self._verify = verify or _accept
        # Opaque records (verify=None) are not kvstore records: none carries a checkpoint.
        opaque = verify is None and describe is kv_checkpoint_nbytes
        self._describe = _opaque if opaque or describe is None else describe
        self._clock = clock or time.time
        self._low_water = parse_fraction(low_water, "low_water")
        self._counters = Counters()
        self._quarantine: set[bytes] = set()
        try:
            resolved = meta.open_settings(backend, settings, recover=recover, clock=self._clock)
            self._settings = resolved
        except BaseException:
            backend.close()
            raise
        self._house = (
            Housekeeper(self._write_pending, parse_seconds(touch_interval, "touch_interval"))
            if backend.supports_writes
            else None
        )
        self._meta_lock = threading.Lock()
        start_read_threads()  # here, not inside the process's first restore

    # ------------------------------------------------------------------ settings

    @property
    def settings(self) -> StoreSettings:
        return self._settings

    def _budgets(self, view: ReadView) -> StoreSettings:
        return meta.current_settings(view, self._settings, self.url)

    def set_budget(self, max_bytes: int | str | None, *, namespace: str | None = None) -> None:
        self._check_writable("set_budget")
        value = None if max_bytes is None else parse_byte_size(max_bytes, "max_bytes")
        if namespace is not None:
            K.parse_namespace(namespace)

        with self._meta_lock:
            self._settings = self._backend.transact(
                lambda txn: meta.write_budget(txn, self.url, value, namespace, self._settings)
            )

    # ------------------------------------------------------------------ lookup

    def lookup(self, namespace: str, tokens: Any, *, checkpoints: bool = False) -> Match:
        """The longest reusable prefix of ``tokens`` in ``namespace`` (module docstring).

        With ``checkpoints`` (a hybrid model: its recurrent layers can only be
        restored from a checkpoint), the match ends where the last matched
        block whose record carries a checkpoint ends, and ``Match.kv_tokens``
        says how far the KV matched; KV matched without a checkpoint is a
        miss of reason ``no_checkpoint``.
        """
        self._check_open("lookup")
        ns = K.parse_namespace(namespace)
        toks = K.as_tokens(tokens, "lookup")
        self.wait_for_saves(namespace, toks)  # a process reads its own saves handed off
        size, bsize = len(toks), self._settings.block_size
        self._counters.add(lookups=1)
        if size < 2:
            self._counters.miss(MissReason.SHORT_PROMPT)
            return Match(namespace, 0, size, bsize)
        with self._unavailable_is_a_miss(), self._backend.reader() as view:
            found = walk(self._backend, view, ns, toks, bsize, self._quarantine)
            if checkpoints:
                end = last_checkpointed(view, ns, toks, found, size - 1, bsize)
        refs = found.refs
        n = refs[-1].stop if refs else 0
        if n >= size:  # leave the last prompt token to the model
            last = refs.pop()
            if last.rows > 1:
                refs.append(replace(last, rows=last.rows - 1))
            n = size - 1
        kv = n
        if checkpoints:
            # Reuse ends where a checkpoint does: a whole block, at most the prompt but one.
            whole = end is not None and end < len(refs) and refs[end].rows == refs[end].stored_rows
            refs = refs[: end + 1] if whole and end is not None else []
            n = refs[-1].stop if refs else 0
            if kv and not n:
                self._counters.miss(MissReason.NO_CHECKPOINT)
                return Match(namespace, 0, size, bsize, kv_tokens=kv)
        if not n:
            self._counters.miss(MissReason.COLD)
            return Match(namespace, 0, size, bsize)
        self._counters.add(hits=1, hit_tokens=n)
        if self._house is not None:
            self._house.touch([r.key for r in refs], self._clock())
        return Match(namespace, n, size, bsize, tuple(refs), kv_tokens=kv)

    @contextmanager
    def _unavailable_is_a_miss(self) -> Iterator[None]:
        """Count StoreUnavailableError as a miss of that reason (and let it propagate)."""
        try:
            yield
        except StoreUnavailableError:
            self._counters.miss(MissReason.UNAVAILABLE)
            raise

    # ------------------------------------------------------------------ read

    @contextmanager
    def read(self, blocks: Sequence[BlockRef]) -> Iterator[list[memoryview]]:
        """Verified views of the records of ``blocks``, valid only inside the ``with``.

        Yields views for the leading run of ``blocks`` that are stored and pass
        ``verify``; the list is shorter than ``blocks`` when one vanished
        (evicted, deleted) or is corrupt. A corrupt record is counted, removed
        in the background and never served; one written by a newer kvstore is
        skipped and kept. Views are released on exit, and arrays or slices
        made from them must not outlive the block either: copy what you keep.
        """
        with self._read(blocks, checking=False) as views:
            yield views

    @contextmanager
    def read_checking(
        self, blocks: Sequence[BlockRef], *, claim: Claim | None = None
    ) -> Iterator[CheckingViews]:
        with self._read(blocks, checking=True, claim=claim) as views:
            assert isinstance(views, CheckingViews)
            yield views

    @contextmanager
    def _read(
        self, blocks: Sequence[BlockRef], *, checking: bool, claim: Claim | None = None
    ) -> Iterator[list[memoryview]]:
        self._check_open("read")
        corrupt: list[bytes] = []
        keys: list[bytes] = []
        for ref in blocks:
            if ref.key in self._quarantine:
                break
            keys.append(ref.key)
        # One call for every block: a network backend fetches them in one round trip.
        with ExitStack() as stack:
            with self._unavailable_is_a_miss():
                values = stack.enter_context(self._backend.view_many(keys))
            padded = [values[i] if i < len(values) else None for i in range(len(blocks))]
            report = partial(
                count_read_end, self._counters, self._why_absent, blocks, corrupt=corrupt
            )
            with served_views(
                padded, self._verify, report, checking=checking, claim=claim
            ) as views:
                yield views
        if corrupt:
            self._quarantine.update(corrupt)
            if self._house is not None:
                self._house.remove(corrupt)

    def _why_absent(self, key: bytes) -> str:
        return why_absent(key, self._quarantine, self._backend)

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open("holds")
        with self._unavailable_is_a_miss():
            return self._backend.contains_many(list(keys))

    # ------------------------------------------------------------------ save

    def put_blocks(
        self,
        namespace: str,
        tokens: Any,
        encode: RecordEncoder,
        *,
        family: str = "",
        checkpoints: Collection[int] = (),
    ) -> SaveResult:
        """:meth:`PrefixStore.put_blocks <kvstore.abc.store.PrefixStore.put_blocks>`.

        Hashes the prompt once: where every block is stored as its own record (a re-save,
        the dedup a save most often is) the result is made from the digests and one read,
        without the spans, jobs and encoder of the whole path, which takes them else."""
        self._check_writable("save")
        ns, bsize = K.parse_namespace(namespace), self._settings.block_size
        toks = K.as_tokens(tokens, "save")
        digests = saving.block_digests(ns, toks, bsize)
        if not checkpoints:
            keys = saving.stored_already(self._backend.reader, ns, digests)
            if keys is not None:
                found = (namespace, len(toks), keys, None, self._clock())
                return saving.deduplicated(self._house, self._counters, *found)
        save = BlockSave(namespace, toks, encode, family, frozenset(checkpoints))
        return self._put_jobs([saving.SaveJob.of(save, bsize, digests)])[0]

    def put_blocks_many(self, saves: Sequence[BlockSave]) -> list[SaveResult]:
        """Every save's missing blocks in one atomic write (one sync: a group commit);
        a save with nothing missing only hashes and reads. Raises what a save would."""
        self._check_writable("save")
        return self._put_jobs([saving.SaveJob.of(s, self._settings.block_size) for s in saves])

    def _put_jobs(self, jobs: list[saving.SaveJob]) -> list[SaveResult]:
        now = self._clock()
        for _ in range(_SAVE_ATTEMPTS):
            with self._backend.reader() as view:
                saving.survey_jobs(view, jobs)
            writing = []
            for job in jobs:
                if job.result is not None:
                    continue
                if not job.missing:  # dedup: hashing and one read
                    found = (job.save.namespace, len(job.toks), job.existing, job.cover)
                    job.result = saving.deduplicated(self._house, self._counters, *found, now)
                    continue
                todo = [s for s in job.missing if s.index not in job.encoded]
                saving.encode_missing(
                    job.ns, todo, job.encoded, job.save.encode, job.save.checkpoints
                )
                writing.append(job)
            if not writing:
                break
            size = sum(saving.record_nbytes_bound(r) for j in writing for r in j.encoded.values())
            try:
                outs = self._write_with_pending(
                    partial(self._commit_saves, jobs=writing, now=now), size_hint=size
                )
            except saving.Stale:
                continue
            for job, out in zip(writing, outs, strict=True):
                job.result = saving.counted(self._counters, job, out)
            break
        else:
            namespace = next(j.save.namespace for j in jobs if j.result is None)
            raise StoreError(
                f"[save] Blocks kept vanishing under concurrent evictions for {_SAVE_ATTEMPTS} "
                f"attempts; raise the budget of namespace {namespace} or retry.",
                namespace=namespace,
            )
        return [job.result for job in jobs if job.result is not None]

    def _commit_saves(
        self, txn: WriteView, pending: Pending, *, jobs: list[saving.SaveJob], now: float
    ) -> list[saving.SaveOutcome]:
        apply_pending(txn, pending)
        return [
            saving.commit_blocks(
                txn,
                ns=job.ns,
                spans=job.spans,
                encoded=job.encoded,
                now=now,
                family=job.save.family,
                checkpoints=job.save.checkpoints,
                describe=self._describe,
                make_room=partial(self._make_room, ns=job.ns),
                placing=self._backend.supports_placement,
            )
            for job in jobs
        ]

    # ------------------------------------------------------------------ eviction

    def _make_room(
        self, txn: WriteView, delta: int, pinned: set[bytes], *, ns: bytes
    ) -> list[Block]:
        """Evict so that ``delta`` more bytes fit the namespace and store budgets."""
        limits = budgets(txn, self._budgets(txn), ns)
        return enforce(
            txn, limits, low_water=self._low_water, incoming=delta, pinned=pinned, must_fit=True
        )

    def evict(self, *, namespace: str | None = None, max_bytes: int | str | None = None) -> int:
        """Evict least-recently-used leaf blocks; returns the bytes freed.

        With ``max_bytes``, evict until the namespace (or the whole store) holds
        at most that many bytes. Without, enforce the configured budgets: any
        namespace or store over ``low_water`` of its budget is brought down to it.
        """
        self._check_writable("evict")
        self.wait_for_saves()  # after the saves handed off before this call
        ns = None if namespace is None else K.parse_namespace(namespace)
        limit = None if max_bytes is None else parse_byte_size(max_bytes, "max_bytes")

        def run(txn: WriteView, pending: Pending) -> list[Block]:
            apply_pending(txn, pending)
            if limit is None:
                limits = budgets(txn, self._budgets(txn), ns, store=ns is None)
                return enforce(txn, limits, low_water=self._low_water)
            scope = tuple(all_totals(txn)) if ns is None else (ns,)
            return enforce(txn, [Budget("max_bytes", scope, limit)], low_water=1.0)

        gone = self._write_with_pending(run)
        freed = sum(b.nbytes for b in gone)
        self._counters.add(
            evictions=len(gone),
            evicted_bytes=freed,
            evicted_checkpoint_bytes=sum(b.checkpoint_nbytes for b in gone),
        )
        return freed

    # ------------------------------------------------------------------ delete

    def delete(self, namespace: str, tokens: Any = ()) -> int:
        """Forget every stored block whose prefix extends ``tokens``; returns blocks removed.

        ``tokens=()`` forgets the whole namespace. Blocks shared with prompts
        that do not start with ``tokens`` stay, so chains stay contiguous.
        """
        self._check_writable("delete")
        self.wait_for_saves()  # after the saves handed off before this call
        ns = K.parse_namespace(namespace)
        toks = K.as_tokens(tokens, "delete")
        bsize = self._settings.block_size

        def run(txn: WriteView, pending: Pending) -> int:
            apply_pending(txn, pending)
            return delete_extending(txn, ns, toks, bsize)

        return self._write_with_pending(run)

    # ------------------------------------------------------------------ housekeeping

    def _write_pending(self, pending: Pending) -> None:
        self._transact(lambda txn: apply_pending(txn, pending))
        self._forget_quarantined(pending)

    def _transact(self, fn: Callable[[WriteView], Any], size_hint: int = 0) -> Any:
        """``backend.transact``, counting the namespace totals it found damaged and
        rewrote from the blocks (:func:`~kvstore.store.blocks.stats.add_totals`) as
        corruptions."""
        take_repairs()  # a failed attempt's repairs were rolled back with it
        result = self._backend.transact(fn, size_hint=size_hint)
        self._counters.add(corruptions=take_repairs())
        return result

    def _write_with_pending(
        self, fn: Callable[[WriteView, Pending], Any], size_hint: int = 0
    ) -> Any:
        """Run ``fn(txn, pending)`` in one write transaction, draining this process's
        batched touches and removals into it (they go back to the buffer on failure)."""
        pending = self._house.take() if self._house is not None else Pending()
        try:
            result = self._transact(lambda txn: fn(txn, pending), size_hint=size_hint)
        except BaseException:
            self._give_back(pending)
            raise
        self._forget_quarantined(pending)
        return result

    def _give_back(self, pending: Pending) -> None:
        if self._house is not None and pending:
            self._house.give_back(pending)

    def _forget_quarantined(self, pending: Pending) -> None:
        if pending.removals:
            self._quarantine.difference_update(pending.removals)

    def activity(self) -> dict[str, Any]:
        return self._counters.snapshot()

    def touch(self, keys: Sequence[bytes]) -> None:
        self._check_open("touch")
        if self._house is not None and keys:
            self._house.touch(keys, self._clock())

    def flush(self) -> None:
        """Wait for the saves handed off, then write batched recency updates and
        pending removals now."""
        self._check_open("flush")
        self.wait_for_saves()
        if self._house is not None:
            self._house.flush()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.stop_writer()  # what was handed off is committed first
            if self._house is not None:
                self._house.close()
                try:
                    self._house.flush()
                except StoreUnavailableError:
                    pass  # recency hints and removals are redone later; closing must work
        finally:
            self._closed = True
            self._backend.close()

    # ------------------------------------------------------------------ stats

    def stats(self, *, by_family: bool = False) -> StoreStats:
        self._check_open("stats")
        self.wait_for_saves()  # after the saves handed off before this call
        with self._backend.reader() as view:
            settings = self._budgets(view)
            namespaces, families = store_contents(view, settings, by_family=by_family)
        return StoreStats(
            blocks=sum(s.blocks for s in namespaces.values()),
            bytes=sum(s.bytes for s in namespaces.values()),
            checkpoints=sum(s.checkpoints for s in namespaces.values()),
            checkpoint_bytes=sum(s.checkpoint_bytes for s in namespaces.values()),
            namespaces=namespaces,
            max_bytes=settings.max_bytes,
            by_family=families,
            backend=self._backend.stats(),
            **self._counters.snapshot(),
        )

    # ------------------------------------------------------------------ verify

    def verify(self, *, repair: bool = False) -> VerifyReport:
        """Check every record (with ``verify``) and the index against the records (see
        :mod:`kvstore.store.blocks.integrity`).

        Finds corrupt records, records written by a newer kvstore (kept), orphans
        (blocks whose parent is gone), dangling keys (an index entry without its
        record, a record without its entry, a last use without a block), namespace
        totals that disagree with the blocks, a damaged or missing copy of the
        settings record, and damage in the engine's own structures
        (``Backend.check``: an LMDB file's B-trees and free list). With ``repair``,
        removes corrupt blocks and orphans with everything stored after them,
        removes dangling keys, rewrites the totals and both copies of the settings,
        in one transaction; engine damage is repaired by ``kvstore verify --fix``,
        which rebuilds the file (:mod:`kvstore.store.maintenance.repair`).
        """
        self._check_open("verify")
        self.wait_for_saves()  # after the saves handed off before this call
        found = Survey()
        with self._backend.reader() as view:
            found.run(view, self._verify)
            settings = meta.settings_problems(view, self.url)
        report = replace(
            found.report(repaired=False), settings=settings, engine=self._backend.check()
        )
        if repair and not report.clean:
            self._check_writable("verify")

            def fix(txn: WriteView) -> None:
                found.repair(txn)
                meta.repair_settings(txn, self.url, self._settings)

            self._transact(fix)
            if report.engine:
                self._backend.mend()
            self._counters.add(corruptions=len(report.corrupt))
            report = replace(report, repaired=True)
        return report
