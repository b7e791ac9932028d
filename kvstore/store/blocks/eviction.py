"""Least-recently-used *leaf* eviction, so stored chains stay contiguous.

A block can only go once nothing is stored after it (no child), and among
those, the one used longest ago goes first; ties go to the deeper block,
then to key order, so the choice is deterministic. Evicting a block can
make its parent a leaf, which then competes by its own last use.

Eviction runs inside the write transaction that needs the room (a save over
budget) or in :meth:`~kvstore.store.blocks.prefix.BlockPrefixStore.evict`, both
through :func:`enforce` over the :class:`Budget` scopes :func:`budgets` lists. It loads
the scope's index entries and last uses in one scan; with the low-water mark
(``low_water``, 0.9 of the budget by default) a scan frees a tenth of the
budget, so scans are rare relative to saves.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from kvstore.abc.store import ReadView, StoreSettings, WriteView
from kvstore.errors import StoreFullError
from kvstore.store import keys as K
from kvstore.store.blocks.index import decode_use, iter_entries
from kvstore.store.blocks.removal import delete_block
from kvstore.store.blocks.stats import add_totals, all_totals, read_totals

__all__ = ["Block", "Budget", "budgets", "enforce", "load_blocks", "plan_eviction", "evict_in"]


@dataclass
class Block:
    """A stored block as eviction sees it."""

    namespace: bytes
    digest: bytes
    parent: bytes
    index_key: bytes
    depth: int
    nbytes: int
    last_use: float
    children: int = 0
    #: Of ``nbytes``, a recurrent checkpoint's (issue 16; 0 for a KV-only record).
    checkpoint_nbytes: int = 0

    @property
    def record_key(self) -> bytes:
        return K.record_key(self.namespace, self.digest)


def load_blocks(view: ReadView, namespaces: Iterable[bytes]) -> dict[bytes, Block]:
    """Every block of ``namespaces`` by record key, with last use and child counts."""
    blocks: dict[bytes, Block] = {}
    for ns in namespaces:
        base = K.namespace_dir(ns)
        for sub in (b".c/", b".t/"):
            for key, e in iter_entries(view, base + sub, with_tokens=False):
                block = Block(ns, e.digest, e.parent, key, e.depth, e.nbytes, e.created)
                block.checkpoint_nbytes = e.checkpoint_nbytes
                blocks[block.record_key] = block
        uses = base + b".u/"
        for key, value in view.scan(uses):
            record = base + key[len(uses) :]
            if record in blocks:
                blocks[record].last_use = decode_use(value)[0]
    for block in blocks.values():
        parent = blocks.get(K.record_key(block.namespace, block.parent))
        if parent is not None:
            parent.children += 1
    return blocks


def plan_eviction(
    blocks: dict[bytes, Block], total: int, target: int, pinned: Collection[bytes] = ()
) -> list[Block]:
    """The blocks to evict, in order, to bring ``total`` bytes down to ``target``.

    Stops early when only pinned blocks or inner blocks remain. ``blocks`` is
    consumed (child counts change as leaves go).
    """
    heap = [
        (b.last_use, -b.depth, key)
        for key, b in blocks.items()
        if b.children == 0 and key not in pinned
    ]
    heapq.heapify(heap)
    out: list[Block] = []
    while total > target and heap:
        _, _, key = heapq.heappop(heap)
        block = blocks.pop(key)
        out.append(block)
        total -= block.nbytes
        parent_key = K.record_key(block.namespace, block.parent)
        parent = blocks.get(parent_key)
        if parent is not None:
            parent.children -= 1
            if parent.children == 0 and parent_key not in pinned:
                heapq.heappush(heap, (parent.last_use, -parent.depth, parent_key))
    return out


def evict_in(
    txn: WriteView, namespaces: list[bytes], total: int, target: int, pinned: Collection[bytes]
) -> list[Block]:
    """Evict from ``namespaces`` (holding ``total`` bytes) down to ``target``; adjusts totals."""
    plan = plan_eviction(load_blocks(txn, namespaces), total, target, pinned)
    per_ns: dict[bytes, tuple[int, int]] = {}
    for block in plan:
        delete_block(txn, block.namespace, block.index_key, block.digest)
        count, nbytes = per_ns.get(block.namespace, (0, 0))
        per_ns[block.namespace] = (count + 1, nbytes + block.nbytes)
    for ns, (count, nbytes) in per_ns.items():
        add_totals(txn, ns, -count, -nbytes)
    return plan


@dataclass(frozen=True)
class Budget:
    """A byte limit over some namespaces: one namespace's budget, or the store's."""

    scope: str
    namespaces: tuple[bytes, ...]
    limit: int


def budgets(
    view: ReadView, settings: StoreSettings, namespace: bytes | None, *, store: bool = True
) -> list[Budget]:
    """The budgets of ``namespace`` (``None``: of every namespace), namespace budgets
    first, then (``store``) the whole store's."""
    totals = all_totals(view)
    scoped = tuple(totals) if namespace is None else (namespace,)
    out = [
        Budget(f"namespace {ns.decode()}", (ns,), limit)
        for ns in scoped
        if (limit := settings.budget_for(ns.decode())) is not None
    ]
    if store and settings.max_bytes is not None:
        everyone = tuple(dict.fromkeys([*totals, *scoped]))
        out.append(Budget("the store", everyone, settings.max_bytes))
    return out


def enforce(
    txn: WriteView,
    limits: Iterable[Budget],
    *,
    low_water: float,
    incoming: int = 0,
    pinned: Collection[bytes] = (),
    must_fit: bool = False,
) -> list[Block]:
    """Evict so that each budget holds its scope's bytes plus ``incoming``.

    A scope over ``low_water`` of its limit (``must_fit``: over the limit itself)
    is brought down to ``low_water`` of the limit, less ``incoming``, so that a
    scan frees a slice of the budget and is rare relative to saves.

    Raises:
        StoreFullError: ``must_fit`` and the scope is still over its limit after
            evicting every unpinned leaf; nothing is committed by the caller then.
    """
    out: list[Block] = []
    for budget in limits:
        total = sum(read_totals(txn, ns)[1] for ns in budget.namespaces)
        target = math.floor(budget.limit * low_water) - incoming
        if total + incoming <= (budget.limit if must_fit else target + incoming):
            continue
        gone = evict_in(txn, list(budget.namespaces), total, target, pinned)
        out += gone
        total -= sum(b.nbytes for b in gone)
        if must_fit and total + incoming > budget.limit:
            raise StoreFullError(
                f"[save] {incoming} new bytes do not fit the byte budget of {budget.scope} "
                f"({budget.limit} bytes): {total} bytes remain after evicting every block not "
                f"in use by this prompt. Raise the budget (set_budget) or save a "
                f"shorter prompt.",
                needed=incoming,
                budget=budget.limit,
                remaining=total,
            )
    return out
