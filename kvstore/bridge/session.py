"""One generation's use of a prefix store: restore before prefill, capture during, save after.

:func:`kvstore.model.generate` drives a :class:`StoreSession`:

1. :meth:`StoreSession.restore`: look the prompt up and rebuild the caches of
   the longest stored prefix (into the families of the model's fresh caches);
2. :meth:`StoreSession.on_prefill_chunk`: after each prefill chunk, keep the
   blocks a sliding window is about to forget (:class:`~kvstore.bridge.capture.BlockCapture`);
3. :meth:`StoreSession.save`: after generation, hand the prompt and the
   generated tokens that have KV off to the store's writer (write-behind), so a
   follow-up turn that extends the conversation reuses all of it.

A hybrid model's recurrent layers (issue 16) are restored from the checkpoint
the longest matched prefix ends with (the lookup asks for one), and the
session plans and takes the checkpoints the save stores
(:class:`~kvstore.bridge.checkpoints.CheckpointPlan`): prefill chunks end at
them (:meth:`StoreSession.prefill_stops`), decode rounds land on block
boundaries (:meth:`StoreSession.next_stop`, :meth:`StoreSession.on_decode`).

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

from kvstore.abc.cache import is_recurrent_cache
from kvstore.abc.store import PrefixStore, SaveHandle
from kvstore.bridge.capture import BlockCapture
from kvstore.bridge.checkpoints import CheckpointPlan
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
        kv_matched: prompt tokens whose KV the store matched (more than
            ``reused`` for a hybrid model whose match ends past its last checkpoint).
        error: why the store served nothing or saved nothing, if it failed.
        checkpoints: the recurrent checkpoints this generation takes (a hybrid
            model's), else ``None``.
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
        self.kv_matched = 0
        self.error: str | None = None
        self.checkpoints: CheckpointPlan | None = None
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
        hybrid = any(is_recurrent_cache(c) for c in caches)
        if held:
            self.capture = BlockCapture(self.block_size, held)
            self._plan(hybrid, len(tokens), held, 0)
            return caches
        t0 = time.perf_counter()
        try:
            match = self.store.lookup(self.namespace, tokens, checkpoints=hybrid)
            t1 = time.perf_counter()
            self.lookup_s = t1 - t0
            restored = self.store.restore(match, caches) if match.hit else caches
            self.restore_s = time.perf_counter() - t1
        except STORE_FAULTS as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("kvstore: restore failed, recomputing the prompt: %s", self.error)
            self._plan(hybrid, len(tokens), 0, 0)
            return caches
        self.reused = int(restored[0].offset) if restored else 0
        self.kv_matched = max(match.kv_matched, self.reused)
        self.capture = BlockCapture(self.block_size, self.reused)
        self._plan(hybrid, len(tokens), self.reused, self.kv_matched)
        return restored

    def _plan(self, hybrid: bool, prompt_tokens: int, start: int, kv_matched: int) -> None:
        if hybrid and not self.store.read_only:
            stride = self.store.settings.checkpoint_stride
            self.checkpoints = CheckpointPlan(
                self.block_size, stride, prompt_tokens, start, kv_matched
            )

    def prefill_stops(self, start: int, stop: int) -> list[int]:
        """Positions in ``(start, stop)`` where a prefill chunk must end (a checkpoint is taken)."""
        plan = self.checkpoints
        return [] if plan is None else [p for p in plan.prefill if start < p < stop]

    def next_stop(self, offset: int) -> int | None:
        """The position after ``offset`` a decode round must not run past (a block
        boundary, where a checkpoint is taken), or ``None``."""
        return None if self.checkpoints is None else self.checkpoints.next_stop(offset)

    def on_decode(self, offset: int, caches: list[Any]) -> None:
        """After a decode step or round, the caches holding ``offset`` verified tokens."""
        if self.checkpoints is None:
            return
        try:
            self.checkpoints.on_decode(offset, caches)
        except STORE_FAULTS as exc:
            self.checkpoints = None
            log.warning("kvstore: taking a checkpoint failed: %s", exc)

    def on_prefill_chunk(self, offset_end: int, caches: list[Any]) -> None:
        if self.checkpoints is not None:
            try:
                self.checkpoints.on_prefill_chunk(offset_end, caches)
            except STORE_FAULTS as exc:
                self.checkpoints = None
                log.warning("kvstore: taking a checkpoint failed: %s", exc)
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
            captured = dict(self.capture.snapshots)
            if self.checkpoints is not None:
                captured.update(self.checkpoints.snapshots)
            self.pending = self.store.save_behind(self.namespace, tokens, caches, captured=captured)
        except STORE_FAULTS as exc:
            self.error = self.error or f"{type(exc).__name__}: {exc}"
            log.warning("kvstore: saving the prompt failed (generation unaffected): %s", exc)
        finally:
            self.save_s = time.perf_counter() - t0
            self.capture.snapshots.clear()
            if self.checkpoints is not None:
                self.checkpoints.snapshots.clear()
