"""One generation's use of a prefix store: restore before prefill, capture during, save after.

:func:`kvstore.model.generate` drives a :class:`StoreSession`:

1. :meth:`StoreSession.restore`: look the prompt up and rebuild the caches of
   the longest stored prefix (into the families of the model's fresh caches);
2. :meth:`StoreSession.on_prefill_chunk`: after each prefill chunk, keep the
   blocks a sliding window is about to forget (:class:`~kvstore.bridge.capture.BlockCapture`);
3. :meth:`StoreSession.save`: after generation, hand the prompt and the
   generated tokens that have KV off to the store's writer (write-behind), so a
   follow-up turn that extends the conversation reuses all of it.

The store is a cache: when it fails, generation goes on. A store that cannot
be reached, or a record that turns out corrupt or too new, during lookup or
restore means recomputing from scratch (the store counts the miss; the
session records why in :attr:`StoreSession.error`); a save that fails is
logged and generation's result stands.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.abc.store import PrefixStore, SaveHandle
from kvstore.bridge.capture import BlockCapture
from kvstore.errors import CapabilityError, KVStoreError

__all__ = ["StoreSession", "STORE_FAULTS"]

log = logging.getLogger("kvstore.store")

#: What a lookup, restore or save may raise that generation survives: every kvstore
#: error (StoreUnavailableError above all: a server gone mid-restore; also a corrupt
#: or too-new record, a full store, a storage policy whose codec is not installed).
STORE_FAULTS: tuple[type[Exception], ...] = (KVStoreError,)


class StoreSession:
    """Restore, capture and save for one generation (see the module docstring).

    Attributes:
        lookup_s, restore_s, save_s: seconds spent in each step.
        reused: tokens restored from the store.
        error: why the store served nothing or saved nothing, if it failed.
    """

    def __init__(self, store: PrefixStore, namespace: str) -> None:
        if not isinstance(store, PrefixStore):
            raise CapabilityError(
                f"[generate] store= takes a prefix store (kvstore.store.open_store(url)); "
                f"received {type(store).__name__}.",
                found=type(store).__name__,
            )
        self.store = store
        self.namespace = namespace
        self.capture = BlockCapture(store.block_size)
        self.lookup_s = self.restore_s = self.save_s = 0.0
        self.reused = 0
        self.error: str | None = None
        #: The last save handed off (``pending.result()`` waits for its commit).
        self.pending: SaveHandle | None = None

    @property
    def block_size(self) -> int:
        return self.store.block_size

    def restore(self, tokens: Sequence[int] | np.ndarray, caches: list[Any]) -> list[Any]:
        """``caches`` (fresh, offset 0) replaced by the longest stored prefix of ``tokens``.

        Caches that already hold a prefix are kept (and captured from there on).
        On a fault the fresh caches come back untouched and :attr:`error` says why.
        """
        held = max(int(c.offset) for c in caches)
        if held:
            self.capture = BlockCapture(self.block_size, held)
            return caches
        t0 = time.perf_counter()
        try:
            match = self.store.lookup(self.namespace, tokens)
            t1 = time.perf_counter()
            self.lookup_s = t1 - t0
            restored = self.store.restore(match, caches) if match.hit else caches
            self.restore_s = time.perf_counter() - t1
        except STORE_FAULTS as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("kvstore: restore failed, recomputing the prompt: %s", self.error)
            return caches
        self.reused = int(restored[0].offset) if restored else 0
        self.capture = BlockCapture(self.block_size, self.reused)
        return restored

    def on_prefill_chunk(self, offset_end: int, caches: list[Any]) -> None:
        if self.capture.failed:
            return
        try:
            self.capture(offset_end, caches)
        except STORE_FAULTS as exc:  # a cache no codec serves: the save will say so too
            self.capture.failed = True
            log.warning("kvstore: capturing prefill blocks failed: %s", exc)

    def save(self, tokens: Sequence[int] | np.ndarray, caches: list[Any]) -> None:
        """Hand ``tokens`` (those the caches hold KV for) off to the store's writer
        (:meth:`~kvstore.abc.store.PrefixStore.save_behind`): generation waits only for
        the copy of the new rows. A failure is logged, not raised (the writer logs one
        that happens at commit; :attr:`pending` has its handle)."""
        if self.store.read_only or not len(tokens):
            return
        t0 = time.perf_counter()
        try:
            self.pending = self.store.save_behind(
                self.namespace, tokens, caches, captured=self.capture.snapshots
            )
        except STORE_FAULTS as exc:
            self.error = self.error or f"{type(exc).__name__}: {exc}"
            log.warning("kvstore: saving the prompt failed (generation unaffected): %s", exc)
        finally:
            self.save_s = time.perf_counter() - t0
            self.capture.snapshots.clear()
