"""Removing blocks: one block, a block with everything stored after it, a namespace.

Used by deletes, eviction, corrupt-record removal and ``verify(repair=True)``,
always inside a write transaction; totals are the caller's to adjust.
"""

from __future__ import annotations

from kvstore.abc.store import WriteView
from kvstore.errors import CorruptEntryError, FormatVersionError
from kvstore.store import keys as K
from kvstore.store.blocks.index import decode_entry

__all__ = ["delete_block", "delete_subtree", "delete_namespace"]


def delete_block(txn: WriteView, ns: bytes, index_key: bytes, digest: bytes) -> None:
    """Remove one block's record, index entry and last use."""
    txn.delete(K.record_key(ns, digest))
    txn.delete(index_key)
    txn.delete(K.use_key(ns, digest))


def delete_subtree(txn: WriteView, ns: bytes, index_key: bytes, digest: bytes) -> tuple[int, int]:
    """Remove a block and every block stored after it; returns (blocks, record bytes).

    Bytes are the index entries' (what the totals counted when the blocks were
    saved), so removing a block whose record the server already dropped (Redis
    eviction) still gives back exactly what it held in the totals, and no
    record is read: they can be large and remote.
    """
    count = nbytes = 0
    stack = [(index_key, digest, _entry_bytes(txn, ns, index_key, digest))]
    while stack:
        key, d, size = stack.pop()
        for directory in (K.children_dir(ns, d), K.tails_dir(ns, d)):
            for child_key, value in list(txn.scan(directory)):
                try:
                    entry = decode_entry(value, with_tokens=False)
                except (CorruptEntryError, FormatVersionError):
                    txn.delete(child_key)  # unreadable: its subtree is left to verify()
                    continue
                stack.append((child_key, entry.digest, entry.nbytes))
        nbytes += size
        delete_block(txn, ns, key, d)
        count += 1
    return count, nbytes


def _entry_bytes(txn: WriteView, ns: bytes, index_key: bytes, digest: bytes) -> int:
    """Record bytes of a block by its index entry (by its record if the entry is unreadable)."""
    raw = txn.get(index_key)
    if raw is not None:
        try:
            return decode_entry(raw, with_tokens=False).nbytes
        except (CorruptEntryError, FormatVersionError):
            pass
    record = txn.get(K.record_key(ns, digest))
    return 0 if record is None else len(record)


def delete_namespace(txn: WriteView, ns: bytes) -> int:
    """Remove every key of a namespace and its totals; returns the blocks removed."""
    keys = list(txn.keys(K.namespace_dir(ns)))
    for key in keys:
        txn.delete(key)
    txn.delete(K.totals_key(ns))
    return sum(K.split_record_key(key) is not None for key in keys)
