"""Live caches in and out of a prefix store: ``store.save`` and ``store.restore``.

Built on the block engine's ``put_blocks``/``lookup``/``read`` and on the codecs
below it: :mod:`.save` (caches -> one record per block), :mod:`.restore` (records ->
caches in the families the model asks for) and :mod:`.policy` (what a store's
``storage_policy`` does to each layer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvstore.abc.store import Match, PrefixStore, SaveResult
from kvstore.store.kv.restore import restore_caches
from kvstore.store.kv.save import save_caches

__all__ = ["CacheMethods", "save_caches", "restore_caches"]


class CacheMethods:
    """``save`` and ``restore`` of :class:`~kvstore.abc.store.PrefixStore`, for any
    store class that mixes this in ahead of it."""

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

    def restore(self, match: Match, caches: Sequence[Any]) -> list[Any]:
        """See :func:`kvstore.store.kv.restore.restore_caches`."""
        assert isinstance(self, PrefixStore)
        return restore_caches(self, match, caches)
