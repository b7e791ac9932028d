"""Activity counters of one open store, and the persisted per-namespace totals.

Totals (blocks and bytes per namespace) are stored under
``kvstore/v1/__ns__/<ns>`` and changed in the same transaction as the blocks
they count, so they are exact across processes and cost no scan on open.
Activity counters (hits, misses by reason, evictions, corruptions) belong to
the open store and are not persisted: persisting them would put a write on
the read path.
"""

from __future__ import annotations

import struct
import threading
from collections import Counter
from typing import Any

from kvstore.abc.store import ReadView, WriteView
from kvstore.store import keys as K

__all__ = ["Counters", "read_totals", "add_totals", "all_totals"]

_TOTALS = struct.Struct("<QQ")


def read_totals(view: ReadView, namespace: bytes) -> tuple[int, int]:
    """``(blocks, bytes)`` stored in ``namespace``."""
    raw = view.get(K.totals_key(namespace))
    return (0, 0) if raw is None else _TOTALS.unpack(raw)


def add_totals(txn: WriteView, namespace: bytes, blocks: int, nbytes: int) -> None:
    if not (blocks or nbytes):
        return
    old_blocks, old_bytes = read_totals(txn, namespace)
    new = (old_blocks + blocks, old_bytes + nbytes)
    if new[0] < 0 or new[1] < 0:
        raise AssertionError(f"namespace totals went negative: {new}")
    if new == (0, 0):
        txn.delete(K.totals_key(namespace))
    else:
        txn.put(K.totals_key(namespace), _TOTALS.pack(*new))


def all_totals(view: ReadView) -> dict[bytes, tuple[int, int]]:
    """Totals of every namespace that holds blocks."""
    out = {}
    for key, value in view.scan(K.NS_TOTALS_DIR):
        out[key[len(K.NS_TOTALS_DIR) :]] = _TOTALS.unpack(value)
    return out


class Counters:
    """Thread-safe activity counters; ``snapshot()`` feeds :class:`StoreStats`."""

    FIELDS = (
        "lookups",
        "hits",
        "hit_tokens",
        "saves",
        "saved_blocks",
        "saved_bytes",
        "deduplicated_blocks",
        "evictions",
        "evicted_bytes",
        "corruptions",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Counter[str] = Counter()
        self._misses: Counter[str] = Counter()

    def add(self, **deltas: int) -> None:
        with self._lock:
            self._values.update(deltas)

    def miss(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self._misses[reason] += n

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {f: self._values[f] for f in self.FIELDS}
            out["misses"] = dict(self._misses)
        return out
