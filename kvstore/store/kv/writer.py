"""Write-behind saves: the generating thread hands the new blocks off, a writer commits them.

``store.save_behind(namespace, tokens, caches)`` returns as soon as it has

1. asked the store which of the prompt's full blocks it holds already (one
   read: chain hashes and ``holds``), and
2. taken the one copy it cannot avoid: the rows of the tokens not stored yet,
   copied out of the live caches (the next decode step may write into their
   buffers, or donate them) -- one copy per layer and tensor, on the device
   the cache is on, queued with ``mx.async_eval`` and not waited for.

Everything else happens on the store's writer thread: the storage policy's
encoding (on the device), the records (:mod:`kvstore.codecs.arena`), the
checksums and the commit. On an H200 the hand-off of a 4096-token llama-8B
save holds the generating thread for about 2 ms (G3, tools/bench/results/gpu).

Durability (the store's ``durability`` option; README "Durability"):

* ``"sync"``: every save is its own transaction, synced to disk;
* ``"group"`` (the default): saves handed off within ``group_window`` seconds of
  each other are committed in one transaction, synced once;
* ``"os"``: commits are not synced; the operating system writes them back.

A process killed at any point loses at most the saves not committed yet (the
window) and never corrupts the store: every commit is one transaction.

``store.flush()`` waits until every save handed off before it is committed;
``close()`` does too, and so does the interpreter's exit; a lookup first waits
for the namespace's pending saves that could add rows to it (:meth:`_Job.extends`;
``stats``, ``delete``, ``evict``, ``verify`` for all of them), so a process
always reads its own writes.

The copies of saves handed off and not committed yet are bounded
(``KVSTORE_BEHIND_MAX_MIB``, 4096 MiB): a save that would take them past it while
others wait is skipped -- its handle raises ``StoreUnavailableError``, its prompt is
recomputed if asked for again -- rather than queued, so a disk slower than the saves
coming in costs their reuse, never the process's memory (a save alone always goes).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kvstore.abc.codec import Snapshot
from kvstore.abc.store import DURABILITY_MODES, BlockSave, PrefixStore, SaveResult
from kvstore.codecs import codec_for
from kvstore.errors import CapabilityError, StoreError, StoreUnavailableError
from kvstore.knobs import mib_from_env
from kvstore.store import keys as K
from kvstore.store.kv.checkpoints import (
    checkpoint_layers,
    checkpoint_positions,
    live_positions,
    recurrent_layers,
)
from kvstore.store.kv.save import BlockEncoder, Captured, check_caches

__all__ = ["PendingSave", "WriteBehind", "HandedOff", "DEFAULT_GROUP_WINDOW", "handoff_copies"]

log = logging.getLogger("kvstore.store")

#: Seconds a group commit waits for more saves after the first one arrives.
DEFAULT_GROUP_WINDOW = 0.01
#: The most bytes the copies of saves handed off and not committed yet may hold.
MAX_PENDING_BYTES = mib_from_env("KVSTORE_BEHIND_MAX_MIB", 4096)


class PendingSave:
    """A save handed off to the writer: :meth:`result` waits for its commit.

    Attributes:
        namespace, tokens: what is being saved.
        held_s: seconds the hand-off kept the caller's thread.
        queued_s: seconds from the hand-off to the start of its commit.
        commit_s: seconds of the commit it was part of (a group's, under ``"group"``).
    """

    def __init__(self, namespace: str, tokens: int) -> None:
        self.namespace = namespace
        self.tokens = tokens
        self.held_s = self.queued_s = self.commit_s = 0.0
        self._handed = time.perf_counter()
        self._finished = False  # result or error set (the event follows the callbacks)
        self._done = threading.Event()
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[PendingSave], None]] = []
        self._lock = threading.Lock()

    def done(self) -> bool:
        """True once the save is committed (or failed)."""
        return self._finished

    def result(self, timeout: float | None = None) -> SaveResult:
        """The save's result once committed.

        Raises:
            TimeoutError: not committed within ``timeout`` seconds.
            The save's own error (StoreFullError, StoreUnavailableError...).
        """
        if not self._finished and not self._done.wait(timeout):
            raise TimeoutError(f"[save] The save of {self.tokens} tokens is not committed yet.")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def add_done_callback(self, fn: Callable[[PendingSave], None]) -> None:
        """Call ``fn(self)`` once the save is committed or failed: on the writer thread,
        or at once if it is done already. An error ``fn`` raises is logged. Callbacks
        run before waiters wake: after ``flush()`` (or ``result()``) they have run."""
        with self._lock:
            if not self._finished:
                self._callbacks.append(fn)
                return
        _call(fn, self)

    def _finish(self, result: SaveResult | None, error: BaseException | None) -> None:
        with self._lock:
            self._result, self._error = result, error
            self._finished = True
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            _call(fn, self)
        self._done.set()


def _call(fn: Callable[[PendingSave], None], pending: PendingSave) -> None:
    try:
        fn(pending)
    except Exception:  # a listener's bug must not stop the writer
        log.exception("kvstore: a save's done callback failed")


@dataclass
class _Job:
    namespace: str
    tokens: np.ndarray
    encoder: HandedOff
    pending: PendingSave
    #: The first row the save may write (blocks the store lacked at the hand-off, or a
    #: stored block a hybrid's save upgrades with its checkpoint).
    start: int
    #: Bytes its copies hold until it is committed.
    nbytes: int = 0

    def extends(self, tokens: np.ndarray | None) -> bool:
        """Whether this save can add rows to a lookup of ``tokens`` (``None``: any).

        Its new records start at :attr:`start`; a lookup reaches one (or a prefix
        of one) only if it agrees with the save's tokens beyond ``start``. One that
        parts from it earlier cannot see anything it writes.
        """
        if tokens is None:
            return True
        start = self.start
        if start >= len(self.tokens) or len(tokens) <= start:
            return False
        return bool(np.array_equal(tokens[: start + 1], self.tokens[: start + 1]))


class WriteBehind:
    """The writer thread of one store (started on the first save handed off).

    Args:
        store: the store saves are committed to (through ``put_blocks_many``).
        durability: ``"group"``, ``"sync"`` or ``"os"`` (module docstring).
        group_window: seconds a group waits for more saves (``"group"`` only).
    """

    def __init__(self, store: PrefixStore, durability: str, group_window: float) -> None:
        assert durability in DURABILITY_MODES
        self._store = store
        self._group = durability == "group"
        self._window = group_window if self._group else 0.0
        self._queue: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._busy: list[_Job] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        #: Saves skipped since the backlog was last empty (warned of at the first).
        self._skipped = 0

    # -- the generating thread ------------------------------------------------------------
    def submit(
        self, namespace: str, tokens: Any, caches: Sequence[Any], captured: Captured | None
    ) -> PendingSave:
        t0 = time.perf_counter()
        toks = K.as_tokens(tokens, "save")
        check_caches(toks, caches)
        pending = PendingSave(namespace, len(toks))
        start = self._first_missing(namespace, toks)
        if self._backlog_full(caches, len(toks) - start, len(toks)):
            pending.held_s = time.perf_counter() - t0
            pending._finish(
                None,
                StoreUnavailableError(
                    f"[save] Skipped: the saves handed off to {self._store.url} and not "
                    f"committed yet hold more than {MAX_PENDING_BYTES >> 20} MiB "
                    f"(KVSTORE_BEHIND_MAX_MIB); the disk is slower than the saves coming "
                    f"in. The prompt is recomputed if asked for again.",
                    url=self._store.url,
                ),
            )
            return pending
        encoder = HandedOff(
            caches,
            self._store.settings.storage_policy,
            captured or {},
            (start, len(toks)),
            self._store.block_size,
        )
        # A hybrid's save may also upgrade stored blocks with their checkpoint: a lookup
        # of those blocks waits for it too (it would not see its own checkpoints).
        bsize = self._store.block_size
        upgrades = [p - bsize for p in encoder.checkpoints if p <= start and p % bsize == 0]
        job = _Job(
            namespace, np.array(toks), encoder, pending, min([start, *upgrades]), encoder.nbytes
        )
        pending._handed = time.perf_counter()
        pending.held_s = pending._handed - t0
        with self._cond:
            if self._closed:
                raise StoreError(
                    f"[save] The store {self._store.url} is closed.", url=self._store.url
                )
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kvstore-writer", daemon=True
                )
                self._thread.start()
                # A process that exits without closing its store still commits what it handed off.
                atexit.register(_close_at_exit, weakref.ref(self))
            self._cond.notify_all()
        return pending

    def _backlog_full(self, caches: Sequence[Any], rows: int, tokens: int) -> bool:
        """Whether a save copying ``rows`` rows of ``caches`` would take the backlog past
        :data:`MAX_PENDING_BYTES` (never when nothing waits: a save alone always goes,
        and is not even sized)."""
        # Read without the writer's lock (the generating thread would wait on it, and on
        # the GIL after it): the bound is a heuristic, and a list read whole is atomic.
        waiting = [j for j in (*self._busy, *self._queue) if not j.pending._finished]
        if not waiting:
            self._skipped = 0
            return False
        held = sum(j.nbytes for j in waiting)
        if held + _rows_bytes(caches, rows) <= MAX_PENDING_BYTES:
            return False
        self._skipped += 1
        if self._skipped == 1:
            log.warning(
                "kvstore: a save of %d tokens was skipped: %d saves handed off to %s hold "
                "%.0f MiB not committed yet (KVSTORE_BEHIND_MAX_MIB=%d); further skips are "
                "not logged until the backlog clears",
                tokens,
                len(waiting),
                self._store.url,
                held / 2**20,
                MAX_PENDING_BYTES >> 20,
            )
        return True

    def _first_missing(self, namespace: str, toks: np.ndarray) -> int:
        """The start of the first full block the store does not hold (the tail's start
        if it holds them all): rows before it need no copy."""
        ns = K.parse_namespace(namespace)
        bsize = self._store.block_size
        digests = K.chain_digests(ns, toks, bsize)
        if not digests:
            return 0
        held = self._store.holds([K.record_key(ns, d) for d in digests])
        first = next((i for i, h in enumerate(held) if not h), len(digests))
        return first * bsize

    # -- waiting ------------------------------------------------------------------------
    def wait(
        self,
        namespace: str | None = None,
        timeout: float | None = None,
        tokens: np.ndarray | None = None,
    ) -> None:
        """Until every save handed off so far (of ``namespace``, or all) is committed;
        with ``tokens``, only those that can add rows to a lookup of them (a server's
        lookup does not wait for the saves of conversations it parted from)."""
        with self._cond:
            jobs = [
                j
                for j in (*self._busy, *self._queue)
                if namespace in (None, j.namespace) and j.extends(tokens)
            ]
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in jobs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.pending._done.wait(left):
                raise TimeoutError("[flush] Saves handed off are not committed yet.")

    def pending(self, namespace: str | None = None) -> bool:
        with self._cond:
            return any(namespace in (None, j.namespace) for j in (*self._busy, *self._queue))

    def close(self) -> None:
        """Commit what is queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    # -- the writer thread ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue and self._closed:
                    return
                if self._window and not self._closed:
                    # Group commit: let the saves of the next few ms join this one.
                    end = time.monotonic() + self._window
                    while not self._closed and (left := end - time.monotonic()) > 0:
                        self._cond.wait(left)
                self._busy = list(self._queue)
                self._queue.clear()
            self._commit(self._busy)
            with self._cond:
                self._busy = []
                self._cond.notify_all()

    def _commit(self, jobs: list[_Job]) -> None:
        started = time.perf_counter()
        saves = [
            BlockSave(j.namespace, j.tokens, j.encoder, j.encoder.family, j.encoder.checkpoints)
            for j in jobs
        ]
        results: list[SaveResult | BaseException] = []
        try:
            if not self._group or len(saves) == 1:
                raise _OneByOne
            results = list(self._store.put_blocks_many(saves))  # a group: one transaction
        except Exception:  # not grouped, or the group's one write failed: one save at a time
            results = []
            for save in saves:
                try:
                    results.extend(self._store.put_blocks_many([save]))
                except Exception as one:  # this save's own error, for its handle
                    results.append(one)
        committed = time.perf_counter()
        for job, result in zip(jobs, results, strict=True):
            job.encoder.release()
            job.pending.queued_s = started - job.pending._handed
            job.pending.commit_s = committed - started
            if isinstance(result, BaseException):
                log.warning("kvstore: a save handed off failed: %s", result)
                job.pending._finish(None, result)
            else:
                job.pending._finish(result, None)


class HandedOff(BlockEncoder):
    """A :class:`~kvstore.store.kv.save.BlockEncoder` over copies of the new rows,
    taken on the generating thread: the writer never reads the live caches.

    Growing layers are copied once, tokens ``[start, stop)``, and cut into blocks
    with their codec's ``slice``; windowed layers (and families that cannot be
    cut) are snapshotted and copied block by block now, while they hold the rows.

    A hybrid model's recurrent layers (issue 16) are taken as checkpoints now, at
    every position the save can checkpoint (:attr:`checkpoints`: captured, or the
    live state, which the next decode step moves on). A stored block ending at
    one of them may lack its checkpoint and be rewritten with it (an upgrade), so
    the attention layers' rows of such a block are copied too, even before ``start``.
    """

    def __init__(
        self,
        caches: Sequence[Any],
        policy: str,
        captured: Captured,
        rows: tuple[int, int],
        block_size: int,
    ) -> None:
        super().__init__(caches, policy, captured, rows[1])
        codecs = self._codecs = [codec_for(cache) for cache in caches]
        self._ranges: dict[int, Snapshot] = {}
        self._stored: dict[int, Snapshot] = {}
        self._blocks: dict[tuple[int, int], Snapshot | None] = {}
        copies: list[mx.array] = []
        start, stop = rows
        #: Positions this save has a checkpoint for (``BlockSave.checkpoints``).
        self.checkpoints = checkpoint_positions(caches, captured, stop, self.recurrent)
        self._states: dict[int, dict[int, Snapshot] | None] = {}
        if self.checkpoints:
            live = live_positions(caches, stop)
            for p in self.checkpoints:
                # References, not copies: a recurrent layer replaces its arrays, never
                # writes into them (a checkpoint of Qwen3.5-35B-A3B is 61 MiB). Queued
                # for evaluation here: the writer's thread cannot evaluate this one's graph.
                states = self._states[p] = checkpoint_layers(caches, codecs, captured, p, live)
                for snap in (states or {}).values():
                    copies.extend(t for t in snap.tensors.values() if isinstance(t, mx.array))
            kv = [i for i in range(len(caches)) if i not in self._recurrent]
            for p in sorted(self.checkpoints):  # stored blocks a commit may upgrade
                if p <= start and p % block_size == 0:
                    for i in kv:
                        self._blocks[(i, p - block_size)] = self._snapshot_now(
                            i, caches[i], codecs[i], p - block_size, p, copies
                        )
        for i, (cache, codec) in enumerate(zip(caches, codecs, strict=True)):
            if start >= stop:
                break
            if i in self._recurrent:  # no rows: its checkpoints are taken above
                continue
            try:
                if any(layer == i for layer, _ in captured):
                    raise CapabilityError("a window's blocks, kept as captured")
                snap = _copied(codec.snapshot(cache, start, stop), copies)
                codec.slice(snap, start, start)  # raises if the family cannot cut ranges
                self._ranges[i] = snap
            except CapabilityError:
                for s in range(start, stop, block_size):
                    e = min(stop, s + block_size)
                    self._blocks[(i, s)] = self._snapshot_now(i, cache, codec, s, e, copies)
        mx.async_eval(copies)
        #: Bytes the copies hold until the save is committed.
        self.nbytes = sum(c.nbytes for c in copies)

    def _snapshot_now(
        self, layer: int, cache: Any, codec: Any, start: int, stop: int, copies: list[mx.array]
    ) -> Snapshot | None:
        snap = self._captured.get((layer, start))
        if snap is not None and snap.stop == stop:
            return snap
        try:
            return _copied(codec.snapshot(cache, start, stop), copies)
        except CapabilityError:  # a window that moved on: the layer sits this block out
            return None

    def layers(self, start: int, stop: int, *, checkpoint: bool = False) -> list[Snapshot | None]:
        if self._ranges and not self._stored:
            # The policy's encoding of each whole range once (one encode a layer), all to
            # the host at once for the blocks to be cut from.
            for i, taken in self._ranges.items():
                self._stored[i] = self._apply(taken, i)
            self.to_host(list(self._stored.values()))
        out: list[Snapshot | None] = []
        assert self._codecs is not None
        states = self._states.get(stop) if checkpoint else None
        for i in range(len(self._codecs)):
            if i in self._recurrent:
                out.append(None if states is None else states[i])
                continue
            whole = self._ranges.get(i)
            if whole is not None and whole.start <= start and stop <= whole.stop:
                out.append(self.cut(self._stored[i], start, stop))
                continue
            if (i, start) in self._blocks:
                snap = self._blocks[(i, start)]
            else:  # a block stored when the hand-off looked, evicted since: no copy of it
                raise StoreError(
                    f"[save] Block [{start}, {stop}) was evicted between the hand-off and the "
                    f"commit, and its rows were not copied; save again."
                )
            out.append(None if snap is None else self._apply(snap, i))
        return out

    def release(self) -> None:
        """Drop the copies (the save is committed or failed)."""
        self._ranges.clear()
        self._stored.clear()
        self._blocks.clear()
        self._states.clear()
        self._on_host.clear()


class _OneByOne(Exception):
    """Commit these saves one transaction each (``durability="sync"``, or a single save)."""


def _close_at_exit(ref: weakref.ReferenceType[WriteBehind]) -> None:
    writer = ref()
    if writer is not None:
        writer.close()


def handoff_copies(caches: Sequence[Any], start: int, stop: int) -> list[mx.array]:
    """The copies a hand-off of rows ``[start, stop)`` of ``caches`` makes (lazy), for a
    warm-up to evaluate once: on one H100 a fresh process's first hand-off held its
    caller 92-164 ms, 146 of them the first such copy (its kernel's first use), the
    later ones ~1-2 ms (``tools/bench/results/gpu/firstcosts2-h100/``). Recurrent
    layers (a hand-off keeps their state by reference) and layers whose family cannot
    cut those rows are left out."""
    copies: list[mx.array] = []
    recurrent = set(recurrent_layers(caches))
    for i, cache in enumerate(caches):
        if i in recurrent:
            continue
        try:
            _copied(codec_for(cache).snapshot(cache, start, stop), copies)
        except CapabilityError:
            continue
    return copies


def _copied(snap: Snapshot, copies: list[mx.array]) -> Snapshot:
    """``snap`` with every MLX tensor copied out of the cache's buffers (queued)."""
    tensors: dict[str, Any] = {}
    for name, tensor in snap.tensors.items():
        if isinstance(tensor, mx.array):
            tensor = mx.contiguous(tensor)
            copies.append(tensor)
        tensors[name] = tensor
    return Snapshot(snap.signature, snap.start, snap.stop, tensors, snap.meta)


def _rows_bytes(caches: Sequence[Any], rows: int) -> int:
    """About how many bytes copies of ``rows`` more rows of each of ``caches`` take
    (a windowed layer's copies are fewer: this errs high)."""
    total = 0
    for cache in caches:
        per_token = getattr(cache, "bytes_per_token", None)
        if callable(per_token):
            total += int(per_token()) * rows
        else:  # mlx-lm's caches: their buffers over the rows they hold
            held = int(getattr(cache, "offset", 0) or 0)
            total += int(getattr(cache, "nbytes", 0) or 0) * rows // max(held, 1)
    return total
