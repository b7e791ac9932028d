"""The walk of a lookup: which stored blocks a prompt matches (token-exact).

:meth:`~kvstore.store.blocks.prefix.BlockPrefixStore.lookup` counts, touches and
trims what this finds: the chain of the prompt's stored full blocks, then the
stored child (full block or tail) sharing the longest prefix with the rest, and,
for a hybrid model, the last of them whose record carries a checkpoint.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass

import numpy as np

from kvstore.abc.store import Backend, BlockRef, ReadView
from kvstore.errors import CorruptEntryError, FormatVersionError
from kvstore.store import keys as K
from kvstore.store.blocks.index import IndexEntry, best_child, decode_entry

__all__ = ["Walk", "walk", "last_checkpointed"]


@dataclass
class Walk:
    """What a lookup's walk matched.

    Attributes:
        refs: the matched blocks in order (the last may be a child used in part).
        parents: the parent digest of each matched full block of the chain.
        child: the index entry of the child the match ends in (``None``: none).
    """

    refs: list[BlockRef]
    parents: list[bytes]
    child: IndexEntry | None


def walk(
    backend: Backend,
    view: ReadView,
    ns: bytes,
    toks: np.ndarray,
    block_size: int,
    quarantine: Collection[bytes],
) -> Walk:
    """The blocks of ``toks`` stored in ``ns``, up to the first missing or quarantined one."""
    refs: list[BlockRef] = []
    parents: list[bytes] = []
    parent = K.ROOT
    for i, digest in enumerate(_stored_chain(backend, view, ns, toks, block_size)):
        key = K.record_key(ns, digest)
        if key in quarantine:
            break
        refs.append(BlockRef(key, i, i * block_size, block_size, block_size))
        parents.append(parent)
        parent = digest
    matched = len(refs) * block_size
    child = None
    if matched < len(toks):
        query = toks[matched : matched + block_size]
        dirs = (K.children_dir(ns, parent), K.tails_dir(ns, parent))
        found = best_child(view, dirs, query)
        if found is not None:
            lcp, _, entry = found
            key = K.record_key(ns, entry.digest)
            if key not in quarantine:
                refs.append(BlockRef(key, len(refs), matched, lcp, entry.ntokens))
                child = entry
    return Walk(refs, parents, child)


def last_checkpointed(
    view: ReadView, ns: bytes, toks: np.ndarray, found: Walk, limit: int, block_size: int
) -> int | None:
    """The index of the last matched block that ends at most at ``limit``, whole,
    with a record carrying a checkpoint at its end (walking back from the end)."""
    refs, parents, child = found.refs, found.parents, found.child
    for i in range(len(refs) - 1, -1, -1):
        if refs[i].stop > limit or refs[i].rows != refs[i].stored_rows:
            continue
        if i == len(parents):  # the child the match ends in: its entry is known
            assert child is not None
            flagged = child.checkpointed and refs[i].rows == child.ntokens
        else:
            block = toks[i * block_size : (i + 1) * block_size]
            digest = K.split_record_key(refs[i].key)[1]  # type: ignore[index]
            raw = view.get(K.child_key(ns, parents[i], block, digest, True))
            try:
                flagged = raw is not None and decode_entry(raw, with_tokens=False).checkpointed
            except (CorruptEntryError, FormatVersionError):
                flagged = False
        if flagged:
            return i
    return None


def _stored_chain(
    backend: Backend, view: ReadView, ns: bytes, toks: np.ndarray, block_size: int
) -> Iterator[bytes]:
    """Digests of the prompt's leading full blocks that are stored, in order.

    Hashes lazily and stops at the first missing block; a backend where
    each read is a round trip is asked about the whole chain at once.
    """
    chain = K.iter_chain_digests(ns, toks, block_size)
    if not backend.supports_pipelining:
        for digest in chain:
            if not view.contains(K.record_key(ns, digest)):
                return
            yield digest
        return
    digests = list(chain)
    stored = backend.contains_many([K.record_key(ns, d) for d in digests])
    for digest, present in zip(digests, stored):
        if not present:
            return
        yield digest
