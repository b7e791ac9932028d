"""Live caches in and out of a prefix store: ``store.save`` and ``store.restore``.

Built on the block engine's ``put_blocks``/``lookup``/``read`` and on the codecs
below it: :mod:`.save` (caches -> one record per block), :mod:`.restore` (records ->
caches in the families the model asks for) and :mod:`.policy` (what a store's
``storage_policy`` does to each layer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvstore.abc.store import DURABILITY_MODES, Match, PrefixStore, SaveHandle, SaveResult
from kvstore.store.kv.restore import restore_caches
from kvstore.store.kv.save import save_caches
from kvstore.store.kv.writer import DEFAULT_GROUP_WINDOW, WriteBehind

__all__ = ["CacheMethods", "save_caches", "restore_caches"]


class CacheMethods:
    """``save``, ``save_behind`` and ``restore`` of :class:`~kvstore.abc.store.PrefixStore`,
    for any store class that mixes this in ahead of it. The store calls
    :meth:`wait_for_saves` in ``lookup``/``flush`` and :meth:`stop_writer` in ``close``."""

    #: How commits are made durable (:data:`~kvstore.abc.store.DURABILITY_MODES`).
    durability: str = DURABILITY_MODES[0]
    #: Seconds a group commit waits for more saves.
    group_window: float = DEFAULT_GROUP_WINDOW
    _writer: WriteBehind | None = None

    def save(
        self,
        namespace: str,
        tokens: Any,
        caches: Sequence[Any],
        *,
        captured: Mapping[tuple[int, int], Any] | None = None,
    ) -> SaveResult:
        """See :func:`kvstore.store.kv.save.save_caches`."""
        assert isinstance(self, PrefixStore)
        return save_caches(self, namespace, tokens, caches, captured=captured)

    def save_behind(
        self,
        namespace: str,
        tokens: Any,
        caches: Sequence[Any],
        *,
        captured: Mapping[tuple[int, int], Any] | None = None,
    ) -> SaveHandle:
        """See :mod:`kvstore.store.kv.writer`."""
        assert isinstance(self, PrefixStore)
        self._check_writable("save")
        if self._writer is None:
            self._writer = WriteBehind(self, self.durability, self.group_window)
        return self._writer.submit(namespace, tokens, caches, captured)

    def wait_for_saves(self, namespace: str | None = None, tokens: Any = None) -> None:
        """Until the saves handed off (of ``namespace``, or all) are committed; with
        ``tokens`` (a lookup's, canonical), only those that can add rows to it."""
        if self._writer is not None:
            self._writer.wait(namespace, tokens=tokens)

    def stop_writer(self) -> None:
        """Commit what is handed off and stop the writer thread (``close``)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def restore(self, match: Match, caches: Sequence[Any]) -> list[Any]:
        """See :func:`kvstore.store.kv.restore.restore_caches`."""
        assert isinstance(self, PrefixStore)
        return restore_caches(self, match, caches)
