"""Moving blocks between stores as they are indexed: the primitives ``migrate`` writes with.

A block is its record, its index entry, its last use and its share of the
namespace totals (:mod:`kvstore.store.keys`). :func:`copy_block` writes all
four in the caller's transaction, keeping the index key, digest, parent,
tokens, creation time and last use of the source, so the copy is found by
the same lookups; only the record (and so ``nbytes``) and the family label
may change. The totals stay exact because they move in the same
transaction as the blocks they count.

:class:`ChainWalk` walks a namespace's chains parents first, a page of the
index at a time (one short read view per page), so a walk over a large store
holds neither a long read transaction nor the whole index.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from itertools import islice
from typing import Any

from kvstore.abc.store import Backend, WriteView
from kvstore.store import keys as K
from kvstore.store.blocks.index import IndexEntry, encode_entry, encode_use, iter_entries
from kvstore.store.blocks.removal import delete_subtree
from kvstore.store.blocks.stats import add_totals, all_totals

__all__ = [
    "StoredBlock",
    "family_label",
    "namespaces_of",
    "ChainWalk",
    "copy_block",
    "prune_blocks",
]

#: Index entries (keys only) read per read view while pruning.
PAGE = 256
#: Index entries (with tokens, ~1 KiB each) read per read view and level while walking.
WALK_PAGE = 32


@dataclass(frozen=True)
class StoredBlock:
    """A block as its index describes it (``entry.tokens`` decoded when asked for)."""

    namespace: bytes
    index_key: bytes
    entry: IndexEntry

    @property
    def record_key(self) -> bytes:
        return K.record_key(self.namespace, self.entry.digest)

    @property
    def use_key(self) -> bytes:
        return K.use_key(self.namespace, self.entry.digest)


def family_label(signatures: Iterable[str | None]) -> str:
    """The index's family label for a record whose layers have ``signatures``:
    the distinct signatures in layer order, joined by ``+`` (absent layers skipped)."""
    seen: dict[str, None] = {}
    for sig in signatures:
        if sig is not None:
            seen.setdefault(sig, None)
    return "+".join(seen)


def namespaces_of(backend: Backend) -> dict[bytes, tuple[int, int]]:
    """``{namespace: (blocks, bytes)}`` of every namespace holding blocks (the totals)."""
    with backend.reader() as view:
        return all_totals(view)


class ChainWalk:
    """Every block of ``namespace`` reachable from ``root``, parents before children.

    Iterating yields :class:`StoredBlock` s depth first. Copying blocks in this
    order keeps the copy prefix-closed at every moment: a block is only ever
    written after its parent, so an interrupted copy is a valid, smaller store.
    Memory is one page of index entries per level of depth, never the whole
    index; each page is read in its own short read view. Blocks whose parent
    is gone (orphans) are not reachable and not yielded.

    Args:
        root: the digest to start under (:data:`~kvstore.store.keys.ROOT`: the
            whole namespace; a block's digest: the blocks stored after it).
        page: index entries read per read view.
    """

    def __init__(
        self, backend: Backend, namespace: bytes, *, root: bytes = K.ROOT, page: int = WALK_PAGE
    ) -> None:
        self._backend = backend
        self._ns = namespace
        self._root = root
        self._page = page
        self._pruned: set[bytes] = set()

    def skip_after(self, block: StoredBlock) -> None:
        """Do not descend below ``block`` (call it before asking for the next block)."""
        self._pruned.add(block.entry.digest)

    def __iter__(self) -> Iterator[StoredBlock]:
        stack = [_Level(self._ns, self._root)]
        while stack:
            block = stack[-1].next(self._backend, self._page)
            if block is None:
                stack.pop()
                continue
            yield block
            if block.entry.full and block.entry.digest not in self._pruned:
                stack.append(_Level(self._ns, block.entry.digest))


class _Level:
    """The children (full blocks, then tails) of one parent, read a page at a time."""

    def __init__(self, namespace: bytes, parent: bytes) -> None:
        self.namespace = namespace
        self.dirs = [K.children_dir(namespace, parent), K.tails_dir(namespace, parent)]
        self.start: bytes | None = None
        self.buffer: list[tuple[bytes, IndexEntry]] = []

    def next(self, backend: Backend, page: int) -> StoredBlock | None:
        while not self.buffer and self.dirs:
            with backend.reader() as view:
                self.buffer = list(islice(iter_entries(view, self.dirs[0], start=self.start), page))
            if len(self.buffer) < page:
                self.dirs.pop(0)
                self.start = None
            else:
                self.start = self.buffer[-1][0] + b"\x00"  # the next key after the last read
            self.buffer.reverse()
        if not self.buffer:
            return None
        key, entry = self.buffer.pop()
        return StoredBlock(self.namespace, key, entry)


def copy_block(
    txn: WriteView,
    block: StoredBlock,
    record: Any,
    *,
    family: str | None = None,
    use: Any = None,
) -> int:
    """Write ``block`` with ``record`` into ``txn``'s store; returns the record bytes written.

    The index entry is the source's with ``nbytes`` (and ``family``, when
    given) replaced; ``use`` is the source's last-use value (its creation
    time when ``None``). A block whose record is already stored is left as it
    is and counts 0 bytes, so copying again after an interruption is a no-op.

    ``block.entry`` must carry its tokens (they are part of the index entry).
    """
    if txn.contains(block.record_key):
        return 0
    nbytes = memoryview(record).nbytes
    entry = replace(block.entry, nbytes=nbytes, family=family or block.entry.family)
    txn.put(block.record_key, record)
    txn.put(block.index_key, encode_entry(entry))
    txn.put(block.use_key, encode_use(entry.created, block.index_key) if use is None else use)
    add_totals(
        txn,
        block.namespace,
        1,
        nbytes,
        checkpoints=int(entry.checkpointed),
        checkpoint_bytes=entry.checkpoint_nbytes,
    )
    return nbytes


def prune_blocks(
    backend: Backend,
    namespace: bytes,
    keep: Callable[[Sequence[bytes]], Sequence[bool]] | None = None,
    *,
    page: int = PAGE,
) -> int:
    """Remove the blocks of ``namespace`` that must not stay, with everything after them.

    A block goes when ``keep`` (given the page's record keys) says no, or
    when its parent is not stored (an orphan: nothing can reach it). Reads
    index keys only, a page at a time; each page's removals commit in one
    transaction that also adjusts the totals. Returns the blocks removed.
    """
    removed = 0
    for sub in (b".c/", b".t/"):
        prefix = K.namespace_dir(namespace) + sub
        start: bytes | None = None
        while True:
            with backend.reader() as view:
                batch = list(
                    islice(iter_entries(view, prefix, start=start, with_tokens=False), page)
                )
                parents = [
                    e.parent == K.ROOT or view.contains(K.record_key(namespace, e.parent))
                    for _, e in batch
                ]
            wanted = (
                keep([K.record_key(namespace, e.digest) for _, e in batch])
                if keep is not None and batch
                else [True] * len(batch)
            )
            doomed = [
                (key, e.digest)
                for (key, e), has_parent, ok in zip(batch, parents, wanted)
                if not (has_parent and ok)
            ]
            if doomed:
                removed += backend.transact(partial(_remove, namespace=namespace, doomed=doomed))
            if len(batch) < page:
                break
            start = batch[-1][0] + b"\x00"
    return removed


def _remove(txn: WriteView, namespace: bytes, doomed: list[tuple[bytes, bytes]]) -> int:
    count = nbytes = 0
    for index_key, digest in doomed:
        if txn.contains(index_key):  # an earlier subtree of this page may have taken it
            c, b = delete_subtree(txn, namespace, index_key, digest)
            count, nbytes = count + c, nbytes + b
    add_totals(txn, namespace, -count, -nbytes)
    return count
