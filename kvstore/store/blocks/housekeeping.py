"""Writes a lookup must not wait for: batched recency updates and removals of corrupt blocks.

A lookup records which blocks it used (``touch``) and a read records which
records failed verification (``remove``); both go into an in-process buffer.
A daemon thread writes the buffer in one transaction every ``interval``
seconds (or sooner when it grows large), so the write lock is only ever
waited for off the read path. Every write the store makes anyway (a save, an
eviction) also drains the buffer first, so eviction decisions see this
process's latest uses. Recency is a max: replaying a touch is harmless.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from kvstore.abc.store import WriteView
from kvstore.store import keys as K
from kvstore.store.blocks.index import decode_use, encode_use
from kvstore.store.blocks.removal import delete_subtree
from kvstore.store.blocks.stats import add_totals

__all__ = ["Housekeeper", "Pending", "touch_in", "apply_pending"]

_MAX_PENDING = 4096


class Pending:
    """A batch taken from the buffer: last use per record key, and keys to remove."""

    __slots__ = ("touches", "removals")

    def __init__(self) -> None:
        self.touches: dict[bytes, float] = {}
        self.removals: set[bytes] = set()

    def __bool__(self) -> bool:
        return bool(self.touches or self.removals)

    def merge(self, other: Pending) -> None:
        for key, when in other.touches.items():
            if when > self.touches.get(key, float("-inf")):
                self.touches[key] = when
        self.removals |= other.removals


class Housekeeper:
    """The buffer and the thread that drains it with ``write(pending)``.

    Args:
        write: applies a batch in one transaction (raises on failure; the batch
            is then put back and retried at the next interval).
        interval: seconds between background writes; ``0`` disables the thread
            (batches are then written only by :meth:`flush` and by the store's
            own writes).
    """

    def __init__(self, write: Callable[[Pending], None], interval: float) -> None:
        self._write = write
        self._interval = interval
        self._pending = Pending()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._urgent = False
        self.last_error: BaseException | None = None

    def touch(self, keys: Iterable[bytes], when: float) -> None:
        with self._cond:
            touches = self._pending.touches
            was_empty = not self._pending
            for key in keys:
                if when > touches.get(key, float("-inf")):
                    touches[key] = when
            self._wake(was_empty, urgent=len(touches) >= _MAX_PENDING)

    def remove(self, keys: Iterable[bytes]) -> None:
        with self._cond:
            was_empty = not self._pending
            self._pending.removals.update(keys)
            self._wake(was_empty, urgent=True)

    def take(self) -> Pending:
        """Swap the buffer out (the caller writes it, or gives it back with :meth:`give_back`)."""
        with self._cond:
            batch, self._pending = self._pending, Pending()
            return batch

    def give_back(self, batch: Pending) -> None:
        with self._cond:
            batch.merge(self._pending)
            self._pending = batch

    def flush(self) -> None:
        """Write the buffer now, in the calling thread."""
        batch = self.take()
        if not batch:
            return
        try:
            self._write(batch)
        except BaseException:
            self.give_back(batch)
            raise

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _wake(self, was_empty: bool, urgent: bool) -> None:
        # Called with the condition held: start the thread, or tell it work arrived.
        if self._interval <= 0 or self._closed:
            return
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="kvstore-housekeeper", daemon=True
            )
            self._thread.start()
        if was_empty or urgent:
            self._urgent = self._urgent or urgent
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                # Sleep until there is something to write, then let a batch gather.
                while not (self._pending or self._closed):
                    self._cond.wait()
                if not (self._closed or self._urgent):
                    self._cond.wait(self._interval)
                self._urgent = False
                closing = self._closed
            try:
                self.flush()
                self.last_error = None
            except Exception as exc:  # noqa: BLE001 - kept for stats; retried next round
                self.last_error = exc
                if not closing:
                    with self._cond:
                        self._cond.wait(self._interval)  # do not spin on a failing write
            if closing:
                return


def touch_in(txn: WriteView, record_key: bytes, when: float) -> None:
    """Record a use of a block at ``when`` (recency is a max; a gone block is skipped)."""
    parts = K.split_record_key(record_key)
    old = None if parts is None else txn.get(K.use_key(*parts))
    if old is None:
        return  # the block is gone since it was used: nothing to keep recent
    last, index_key = decode_use(old)
    if last < when:
        txn.put(K.use_key(*parts), encode_use(when, index_key))  # type: ignore[misc]


def apply_pending(txn: WriteView, pending: Pending) -> None:
    """Write a batch in ``txn``: its touches, and its removals with what is stored after them."""
    for key, when in pending.touches.items():
        touch_in(txn, key, when)
    for key in pending.removals:
        parts = K.split_record_key(key)
        use = None if parts is None else txn.get(K.use_key(*parts))
        if parts is None or use is None or not txn.contains(key):
            continue
        ns, digest = parts
        count, nbytes = delete_subtree(txn, ns, decode_use(use)[1], digest)
        add_totals(txn, ns, -count, -nbytes)
