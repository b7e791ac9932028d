"""Activity counters of one open store, and the persisted per-namespace totals.

Totals (blocks and bytes per namespace) are stored under
``kvstore/v1/__ns__/<ns>`` and changed in the same transaction as the blocks
they count, so they are exact across processes and cost no scan on open.
Each value carries a checksum; totals that are damaged, or that a removal
would take below zero, are counted again from the index (and the repair
counted as a corruption), so bookkeeping that disagrees with the blocks never
fails a write.
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

import xxhash

from kvstore.abc.store import Buffer, NamespaceStats, ReadView, WriteView
from kvstore.store import keys as K
from kvstore.store.blocks.index import iter_entries
from kvstore.store.settings import StoreSettings

__all__ = [
    "Counters",
    "read_totals",
    "read_checkpoint_totals",
    "add_totals",
    "all_totals",
    "store_contents",
    "stored_totals",
    "count_totals",
    "take_repairs",
]

# A totals value: blocks, bytes and an xxh3-64 of those 16 bytes (issue 18: one flipped
# bit in an unchecked count made budgets evict everything, or removals assert). Values
# of 16 bytes, without the checksum, are read too; the next change rewrites them.
_TOTALS = struct.Struct("<QQ")
# With checkpoints (issue 16): blocks, bytes, checkpointed records, checkpoint bytes.
_WITH_CHECKPOINTS = struct.Struct("<QQQQ")
_CHECK = struct.Struct("<Q")
# Totals this thread found damaged and rewrote from the blocks (take_repairs() reads it).
_repairs = threading.local()

Totals = tuple[int, int, int, int]


def _decode(raw: Buffer) -> Totals | None:
    """``(blocks, bytes, checkpoints, checkpoint bytes)`` of a stored value, or ``None``
    if it is damaged. Unchecked values (16 or 32 bytes, older writers) are read too."""
    size = len(raw)  # type: ignore[arg-type]
    for counts in (_TOTALS, _WITH_CHECKPOINTS):
        if size == counts.size + _CHECK.size:
            head = bytes(raw[: counts.size])  # type: ignore[index]
            if xxhash.xxh3_64_intdigest(head) != _CHECK.unpack_from(raw, counts.size)[0]:
                return None
            return (*counts.unpack(head), 0, 0)[:4]  # type: ignore[return-value]
        if size == counts.size:
            return (*counts.unpack(raw), 0, 0)[:4]  # type: ignore[return-value]
    return None


def _encode(totals: Totals) -> bytes:
    head = _TOTALS.pack(*totals[:2]) if totals[2:] == (0, 0) else _WITH_CHECKPOINTS.pack(*totals)
    return head + _CHECK.pack(xxhash.xxh3_64_intdigest(head))


def count_totals(view: ReadView, namespace: bytes) -> Totals:
    """The totals of ``namespace`` counted from its index entries (a scan)."""
    blocks = nbytes = checkpoints = checkpoint_bytes = 0
    for sub in (b".c/", b".t/"):
        for _, entry in iter_entries(view, K.namespace_dir(namespace) + sub, with_tokens=False):
            blocks += 1
            nbytes += entry.nbytes
            checkpoints += entry.checkpoint_nbytes > 0
            checkpoint_bytes += entry.checkpoint_nbytes
    return blocks, nbytes, checkpoints, checkpoint_bytes


def _read(view: ReadView, namespace: bytes) -> Totals:
    raw = view.get(K.totals_key(namespace))
    if raw is None:
        return (0, 0, 0, 0)
    found = _decode(raw)
    return count_totals(view, namespace) if found is None else found


def read_totals(view: ReadView, namespace: bytes) -> tuple[int, int]:
    """``(blocks, bytes)`` stored in ``namespace`` (counted from the blocks where the
    stored value is damaged)."""
    blocks, nbytes, _, _ = _read(view, namespace)
    return blocks, nbytes


def read_checkpoint_totals(view: ReadView, namespace: bytes) -> tuple[int, int]:
    """``(records carrying a checkpoint, their checkpoints' bytes)`` in ``namespace``."""
    _, _, checkpoints, checkpoint_bytes = _read(view, namespace)
    return checkpoints, checkpoint_bytes


def add_totals(
    txn: WriteView,
    namespace: bytes,
    blocks: int,
    nbytes: int,
    *,
    checkpoints: int = 0,
    checkpoint_bytes: int = 0,
) -> None:
    """Add to ``namespace``'s totals, in the transaction that changed its blocks.

    Totals that are damaged or that the change would take below zero disagree
    with the blocks: they are counted again from the index instead (which, in
    this transaction, already holds the change), and the repair is counted
    (:func:`take_repairs`). Never an assertion: a removal must go through.
    """
    delta = (blocks, nbytes, checkpoints, checkpoint_bytes)
    if not any(delta):
        return
    raw = txn.get(K.totals_key(namespace))
    old = (0, 0, 0, 0) if raw is None else _decode(raw)
    new = None if old is None else tuple(o + d for o, d in zip(old, delta))
    if new is None or min(new) < 0:
        new = count_totals(txn, namespace)
        _repairs.count = getattr(_repairs, "count", 0) + 1
    if not any(new):
        txn.delete(K.totals_key(namespace))
    else:
        txn.put(K.totals_key(namespace), _encode(new))  # type: ignore[arg-type]


def take_repairs() -> int:
    """How many totals this thread rewrote from the blocks since the last call."""
    count = getattr(_repairs, "count", 0)
    _repairs.count = 0
    return int(count)


def stored_totals(view: ReadView) -> dict[bytes, Totals | None]:
    """Totals of every namespace as stored (``None``: a damaged value), for ``verify``.

    A totals key whose name is no namespace (its bytes or LMDB's key size flipped) is
    left out: it names nothing stats or budgets can show, and verify lists it as a
    dangling key (its namespace's own totals are then missing, and counted again)."""
    out: dict[bytes, Totals | None] = {}
    for key, value in view.scan(K.NS_TOTALS_DIR):
        if K.is_namespace(ns := key[len(K.NS_TOTALS_DIR) :]):
            out[ns] = _decode(value)
    return out


def _all(view: ReadView) -> dict[bytes, Totals]:
    return {
        ns: count_totals(view, ns) if found is None else found
        for ns, found in stored_totals(view).items()
    }


def all_totals(view: ReadView) -> dict[bytes, tuple[int, int]]:
    """``(blocks, bytes)`` of every namespace that holds blocks (damaged ones counted)."""
    return {ns: (t[0], t[1]) for ns, t in _all(view).items()}


def store_contents(
    view: ReadView, budgets: StoreSettings, *, by_family: bool = False
) -> tuple[dict[str, NamespaceStats], dict[str, int] | None]:
    """Every namespace's :class:`~kvstore.abc.store.NamespaceStats` and, with
    ``by_family``, the bytes stored per family label (``None`` without)."""
    totals = _all(view)
    families: dict[str, int] | None = None
    if by_family:
        families = {}
        for ns in totals:
            for sub in (b".c/", b".t/"):
                for _, e in iter_entries(view, K.namespace_dir(ns) + sub, with_tokens=False):
                    families[e.family] = families.get(e.family, 0) + e.nbytes
    namespaces = {
        ns.decode(): NamespaceStats(t[0], t[1], budgets.budget_for(ns.decode()), t[2], t[3])
        for ns, t in totals.items()
    }
    return namespaces, families


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
