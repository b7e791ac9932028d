"""Removing blocks: one block, a block with everything stored after it, a namespace.

Used by deletes, eviction, corrupt-record removal and ``verify(repair=True)``,
always inside a write transaction; totals are the caller's to adjust (except
:func:`delete_extending`, a whole delete, which adjusts its own).
"""

from __future__ import annotations

import numpy as np

from kvstore.abc.store import WriteView
from kvstore.errors import CorruptEntryError, FormatVersionError
from kvstore.store import keys as K
from kvstore.store.blocks.index import decode_entry, iter_entries
from kvstore.store.blocks.stats import add_totals

__all__ = ["delete_block", "delete_subtree", "delete_namespace", "delete_extending"]


def delete_block(txn: WriteView, ns: bytes, index_key: bytes, digest: bytes) -> None:
    """Remove one block's record, index entry and last use.

    A block carrying a recurrent checkpoint takes its checkpoint back out of the
    namespace's checkpoint counters here (issue 16); its blocks and bytes are
    the caller's to adjust, as for every block.
    """
    raw = txn.get(index_key)
    if raw is not None:
        try:
            entry = decode_entry(raw, with_tokens=False)
        except (CorruptEntryError, FormatVersionError):
            entry = None
        if entry is not None and entry.checkpointed:
            add_totals(txn, ns, 0, 0, checkpoints=-1, checkpoint_bytes=-entry.checkpoint_nbytes)
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


def delete_extending(txn: WriteView, ns: bytes, toks: np.ndarray, block_size: int) -> int:
    """Remove every block whose prefix extends ``toks`` (the whole namespace when
    ``toks`` is empty), adjusting the totals; returns the blocks removed.

    Blocks shared with prompts that do not start with ``toks`` stay, so chains
    stay contiguous.
    """
    if not len(toks):
        return delete_namespace(txn, ns)
    whole, rest = divmod(len(toks), block_size)
    digests = K.chain_digests(ns, toks, block_size, whole)
    roots: list[tuple[bytes, bytes]] = []
    if not rest:
        parent = digests[-2] if whole > 1 else K.ROOT
        block = toks[(whole - 1) * block_size :]
        key = K.child_key(ns, parent, block, digests[-1], True)
        if txn.contains(key):
            roots.append((key, digests[-1]))
    else:
        parent = digests[-1] if whole else K.ROOT
        tail = toks[whole * block_size :]
        order = K.order_prefix(tail, pad=False)
        for d in (K.children_dir(ns, parent), K.tails_dir(ns, parent)):
            for key, entry in iter_entries(txn, d + order):
                assert entry.tokens is not None
                if np.array_equal(entry.tokens[: len(tail)], tail):
                    roots.append((key, entry.digest))
    count = nbytes = 0
    for key, digest in roots:
        c, b = delete_subtree(txn, ns, key, digest)
        count, nbytes = count + c, nbytes + b
    add_totals(txn, ns, -count, -nbytes)
    return count
