"""Activity counters of one open store, and the persisted per-namespace totals.

Totals (blocks and bytes per namespace) are stored under
``kvstore/v1/__ns__/<ns>`` and changed in the same transaction as the blocks
they count, so they are exact across processes and cost no scan on open.
Activity counters (hits, misses by reason, evictions, corruptions) belong to
the open store and are not persisted: persisting them would put a write on
the read path.

A namespace holding records with recurrent checkpoints (issue 16) keeps two
more counters in the same value: ``<u64 blocks><u64 bytes>`` becomes
``<u64 blocks><u64 bytes><u64 checkpoints><u64 checkpoint bytes>`` (the
checkpoints are counted in ``bytes`` too); one without keeps 16 bytes.
"""

from __future__ import annotations

import struct
import threading
from collections import Counter
from typing import Any

from kvstore.abc.store import ReadView, WriteView
from kvstore.store import keys as K

__all__ = [
    "Counters",
    "read_totals",
    "read_checkpoint_totals",
    "add_totals",
    "all_totals",
    "all_checkpoint_totals",
]

_TOTALS = struct.Struct("<QQ")
_WITH_CHECKPOINTS = struct.Struct("<QQQQ")


def _unpack(raw: Any) -> tuple[int, int, int, int]:
    if len(raw) == _WITH_CHECKPOINTS.size:
        return _WITH_CHECKPOINTS.unpack(raw)  # type: ignore[no-any-return]
    blocks, nbytes = _TOTALS.unpack(raw)
    return blocks, nbytes, 0, 0


def _read(view: ReadView, namespace: bytes) -> tuple[int, int, int, int]:
    raw = view.get(K.totals_key(namespace))
    return (0, 0, 0, 0) if raw is None else _unpack(raw)


def read_totals(view: ReadView, namespace: bytes) -> tuple[int, int]:
    """``(blocks, bytes)`` stored in ``namespace``."""
    return _read(view, namespace)[:2]


def read_checkpoint_totals(view: ReadView, namespace: bytes) -> tuple[int, int]:
    """``(records carrying a checkpoint, their checkpoints' bytes)`` in ``namespace``."""
    return _read(view, namespace)[2:]


def add_totals(
    txn: WriteView,
    namespace: bytes,
    blocks: int,
    nbytes: int,
    *,
    checkpoints: int = 0,
    checkpoint_bytes: int = 0,
) -> None:
    if not (blocks or nbytes or checkpoints or checkpoint_bytes):
        return
    old = _read(txn, namespace)
    new = tuple(o + d for o, d in zip(old, (blocks, nbytes, checkpoints, checkpoint_bytes)))
    if min(new) < 0:
        raise AssertionError(f"namespace totals went negative: {new}")
    if not any(new):
        txn.delete(K.totals_key(namespace))
    elif new[2:] == (0, 0):
        txn.put(K.totals_key(namespace), _TOTALS.pack(*new[:2]))
    else:
        txn.put(K.totals_key(namespace), _WITH_CHECKPOINTS.pack(*new))


def all_totals(view: ReadView) -> dict[bytes, tuple[int, int]]:
    """Totals of every namespace that holds blocks."""
    out = {}
    for key, value in view.scan(K.NS_TOTALS_DIR):
        out[key[len(K.NS_TOTALS_DIR) :]] = _unpack(value)[:2]
    return out


def all_checkpoint_totals(view: ReadView) -> dict[bytes, tuple[int, int]]:
    """``(checkpoints, checkpoint bytes)`` of every namespace that holds blocks."""
    out = {}
    for key, value in view.scan(K.NS_TOTALS_DIR):
        out[key[len(K.NS_TOTALS_DIR) :]] = _unpack(value)[2:]
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
        "evicted_checkpoint_bytes",
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
