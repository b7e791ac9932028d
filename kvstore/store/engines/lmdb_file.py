"""``data.mdb`` read without LMDB: the structural check ``verify`` runs, and the salvage a
rebuild copies from (issue 18).

LMDB trusts its file: a damaged branch pointer, node offset or key size sends
its own code reading wherever they point (a fault, or keys that vanish from
lookups while a scan still lists them), and a damaged free list makes the
next write reuse pages that are in use. None of that is visible through
LMDB's API until it goes wrong, so :func:`check_file` reads the file itself,
with plain bounded reads (a damaged length is an error message here, never
a fault), and checks what LMDB relies on (LMDB 0.9's layout, ``mdb.c``):

* both meta pages: magic, version, page size, last page inside the map, and the
  fields LMDB takes on trust and copies into every later meta page (map address
  and size, the trees' flags and pad; :func:`meta_damage`, which the engine asks
  before it opens a file); the tree of the newer one that reads is walked;
* every page of both B-trees (the main one and the free list's): its number,
  its kind, its bounds (``lower``/``upper``), every node inside the page and
  clear of the node above it (a grown size overlaps its neighbour), keys
  strictly ascending within a page and inside their parent's separators,
  every leaf at the tree's depth, no page reached twice; overflow runs inside
  the file, of the right kind and length for their value, overlapping nothing;
* counts (entries, branch, leaf and overflow pages) equal to the meta's;
* the free list: page numbers inside the file, none in use by either tree.

:func:`salvage` yields every intact key and value of the main tree, skipping
the subtree under a damaged page, for
:func:`kvstore.store.maintenance.rebuild.rebuild_lmdb` to copy into a fresh file.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["FileCheck", "check_file", "meta_damage", "salvage"]

_PAGE_HEADER = 16
_HEADER = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
_Q = struct.Struct("<Q")
_MAGIC = 0xBEEFC0DE
_VERSION = 1
#: The largest map size a meta page may name (64 TiB): a flipped high bit is damage.
_MAX_MAP = 1 << 46
_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_F_BIGDATA = 0x01
_MDB_INTEGERKEY = 0x08
_INVALID = (1 << 64) - 1
_MAX_DEPTH = 64
#: Problems listed before the check stops collecting (a wrecked file has thousands).
MAX_PROBLEMS = 50


@dataclass(frozen=True)
class _Meta:
    slot: int
    psize: int
    depth: tuple[int, int]  # free list, main
    branch: tuple[int, int]
    leaf: tuple[int, int]
    overflow: tuple[int, int]
    entries: tuple[int, int]
    root: tuple[int, int]
    last_pg: int
    txnid: int
    #: What is wrong in the fields LMDB takes on trust (``""``: nothing); the tree reads.
    damage: str = ""


@dataclass
class FileCheck:
    """What :func:`check_file` found; ``problems`` is empty for an intact file."""

    problems: list[str] = field(default_factory=list)
    pages: int = 0
    entries: int = 0

    @property
    def intact(self) -> bool:
        return not self.problems

    def add(self, problem: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(problem)


class _File:
    """Bounded page reads (``pread``): no mapping, so nothing here can fault."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self.psize = 4096

    def read(self, offset: int, n: int) -> bytes:
        if offset < 0 or n < 0 or offset + n > self.size:
            return b""
        return os.pread(self.fd, n, offset)

    def page(self, pgno: int) -> bytes:
        return self.read(pgno * self.psize, self.psize)

    def close(self) -> None:
        os.close(self.fd)


def _meta_at(f: _File, slot: int, psize: int) -> _Meta | None:
    raw = f.read(slot * psize, 160)
    if len(raw) < 152:
        return None
    magic, version = struct.unpack_from("<II", raw, 16)
    if magic != _MAGIC or version != _VERSION:
        return None
    address, mapsize = struct.unpack_from("<QQ", raw, 24)
    dbs = [struct.unpack_from("<IHHQQQQQ", raw, 40 + 48 * i) for i in (0, 1)]
    last_pg, txnid = struct.unpack_from("<QQ", raw, 136)
    if dbs[0][0] != psize or (last_pg + 1) * psize > mapsize:
        return None  # (LMDB's map would not hold the pages the meta names)
    pair = lambda i: (dbs[0][i], dbs[1][i])  # noqa: E731
    damage = _trusted_damage(address, mapsize, dbs[0][1], dbs[1][1], dbs[1][0])
    return _Meta(
        slot, psize, pair(2), pair(3), pair(4), pair(5), pair(6), pair(7), last_pg, txnid, damage
    )


def _trusted_damage(address: int, mapsize: int, free_flags: int, flags: int, pad: int) -> str:
    """What is wrong in the meta fields LMDB takes on trust and copies into the meta page
    of every later commit, so one flip outlives its page (issue 18's sweep: after a
    write both pages carried it, and a rebuild that refused such pages found nothing).
    They do not locate anything, so the tree under a page damaged here still reads."""
    if address != 0:
        return f"map address {address:#x} (LMDB would ask for a fixed map)"
    if mapsize > _MAX_MAP:
        return f"map size {mapsize} (LMDB would map that much)"
    # The flags decide how LMDB compares keys (a flipped MDB_REVERSEKEY hides every
    # key from lookups) and reads nodes; the free list's also hold the environment's
    # flags. The main tree's pad is a fixed value size (LMDB refuses large ones).
    if (free_flags, flags, pad) != (_MDB_INTEGERKEY, 0, 0):
        return f"tree flags {free_flags:#x}/{flags:#x}, pad {pad} (kvstore's: 0x8/0x0, 0)"
    return ""


def _metas(f: _File) -> list[_Meta]:
    """The intact meta pages, newest first (page 1's offset is the page size, which
    page 0 records; when page 0 is damaged every valid size is tried)."""
    sizes = [1 << n for n in range(9, 17)]
    first = next((m for m in (_meta_at(f, 0, p) for p in sizes) if m is not None), None)
    tried = [first.psize] if first is not None else sizes
    second = next((m for m in (_meta_at(f, 1, p) for p in tried) if m is not None), None)
    return sorted([m for m in (first, second) if m is not None], key=lambda m: -m.txnid)


@dataclass
class _Walk:
    """One tree's walk: pages seen and what was counted."""

    check: FileCheck
    f: _File
    last_pg: int
    name: str
    used: dict[int, str]
    branch: int = 0
    leaf: int = 0
    overflow: int = 0
    entries: int = 0
    leaf_depths: set[int] = field(default_factory=set)

    def claim(self, pgno: int, what: str) -> bool:
        if not 2 <= pgno <= self.last_pg or (pgno + 1) * self.f.psize > self.f.size:
            self.check.add(f"{self.name}: {what} page {pgno} is outside the file")
            return False
        if pgno in self.used:
            self.check.add(f"{self.name}: page {pgno} is used twice ({self.used[pgno]}, {what})")
            return False
        self.used[pgno] = what
        return True


def _nodes(walk: _Walk, pgno: int, page: bytes) -> list[tuple[int, int, int, int, int]] | None:
    """``(offset, lo, hi, flags, ksize)`` of each node of a branch or leaf page, or None."""
    psize = walk.f.psize
    number, _, _, lower, upper = _HEADER.unpack_from(page)
    if number != pgno:
        walk.check.add(f"{walk.name}: page {pgno} says it is page {number}")
        return None
    if not (_PAGE_HEADER <= lower <= upper <= psize) or (lower - _PAGE_HEADER) % 2:
        walk.check.add(f"{walk.name}: page {pgno} has bounds lower={lower}, upper={upper}")
        return None
    out = []
    for i in range((lower - _PAGE_HEADER) // 2):
        ptr = struct.unpack_from("<H", page, _PAGE_HEADER + 2 * i)[0]
        if not upper <= ptr <= psize - _NODE.size:
            walk.check.add(
                f"{walk.name}: page {pgno} node {i} at {ptr} is outside [{upper}, {psize})"
            )
            return None
        lo, hi, flags, ksize = _NODE.unpack_from(page, ptr)
        if ptr + _NODE.size + ksize > psize:
            walk.check.add(f"{walk.name}: page {pgno} node {i}'s key runs past the page")
            return None
        out.append((ptr, lo, hi, flags, ksize))
    for i, ((ptr, _, _, _, ksize), room) in enumerate(zip(out, _room(out, psize))):
        if ptr + _NODE.size + ksize > room:
            walk.check.add(f"{walk.name}: page {pgno} node {i}'s key runs into the node above it")
            return None
    return out


def _room(nodes: list[tuple[int, int, int, int, int]], psize: int) -> list[int]:
    """For each node, where the node above it in the page begins (the page's end for the
    topmost one). LMDB packs a page's nodes from ``upper`` to the end, so a node reaching
    past that has a damaged size: its value holds its neighbour's bytes, and LMDB, which
    moves nodes by their sizes, would wreck the page deleting it (issue 18's sweep)."""
    starts = sorted({ptr for ptr, *_ in nodes})
    above = {a: b for a, b in zip(starts, starts[1:])}
    return [above.get(ptr, psize) for ptr, *_ in nodes]


def _walk(
    walk: _Walk, root: int, depth: int, *, values: bool, main: bool
) -> Iterator[tuple[bytes, bytes]]:
    """Walk the tree under ``root`` checking it; yields ``(key, value)`` of intact leaf
    nodes when ``values``. A damaged page is reported and its subtree skipped."""
    stack: list[tuple[int, int, Any, Any]] = [(root, 1, None, None)]
    psize = walk.f.psize
    while stack:
        pgno, level, low, high = stack.pop()
        if level > _MAX_DEPTH:
            walk.check.add(f"{walk.name}: the tree is deeper than {_MAX_DEPTH} levels")
            continue
        if not walk.claim(pgno, "tree"):
            continue
        page = walk.f.page(pgno)
        flags = _HEADER.unpack_from(page)[2]
        kind = flags & (_P_BRANCH | _P_LEAF | _P_OVERFLOW)
        if kind not in (_P_BRANCH, _P_LEAF) or flags & ~(_P_BRANCH | _P_LEAF | 0x10):
            walk.check.add(f"{walk.name}: page {pgno} in the tree has flags {flags:#06x}")
            continue
        nodes = _nodes(walk, pgno, page)
        if nodes is None:
            continue
        if not nodes and level > 1:
            walk.check.add(f"{walk.name}: page {pgno} has no nodes")
            continue
        keys = [page[p + _NODE.size : p + _NODE.size + k] for p, _, _, _, k in nodes]
        # The free list's keys are txnids, compared as integers (MDB_INTEGERKEY).
        sort_keys: list[bytes | int] = list(keys) if main else [_txnid(k) for k in keys]
        # Branch node 0's key is empty (it covers everything below its parent's separator).
        ordered = sort_keys[1:] if kind == _P_BRANCH else sort_keys
        bad_order = any(a >= b for a, b in zip(ordered, ordered[1:]))  # type: ignore[operator]
        outside = any(
            (low is not None and k < low) or (high is not None and k >= high)  # type: ignore[operator]
            for k in ordered
        )
        if bad_order or outside:
            walk.check.add(f"{walk.name}: page {pgno}'s keys are out of order")
            continue
        if kind == _P_BRANCH:
            walk.branch += 1
            children = []
            for i, (_, lo, hi, nflags, _) in enumerate(nodes):
                child = lo | hi << 16 | nflags << 32
                lo_key = low if i == 0 else sort_keys[i]
                hi_key = sort_keys[i + 1] if i + 1 < len(nodes) else high
                children.append((child, level + 1, lo_key, hi_key))
            stack.extend(reversed(children))
            continue
        walk.leaf += 1
        walk.leaf_depths.add(level)
        for (ptr, lo, hi, nflags, ksize), key, room in zip(nodes, keys, _room(nodes, psize)):
            size = lo | hi << 16
            past = "past the page" if room == psize else "into the node above it"
            data_at = ptr + _NODE.size + ksize
            if nflags & ~_F_BIGDATA:
                walk.check.add(f"{walk.name}: page {pgno} has a node with flags {nflags:#x}")
                continue
            # A free-list key is a txnid; its page list may be long enough for overflow
            # pages (F_BIGDATA), as after evicting and deleting a store of large records.
            if not main and len(key) != 8:
                walk.check.add(f"{walk.name}: page {pgno} has a malformed free-list node")
                continue
            if not nflags & _F_BIGDATA:
                if data_at + size > room:
                    walk.check.add(f"{walk.name}: page {pgno} has a value that runs {past}")
                    continue
                walk.entries += 1
                if values or not main:
                    yield key, page[data_at : data_at + size]
                continue
            if data_at + 8 > room:
                walk.check.add(f"{walk.name}: page {pgno} has an overflow node that runs {past}")
                continue
            first = _Q.unpack_from(page, data_at)[0]
            value = _overflow(walk, first, size)
            if value is None:
                continue
            walk.entries += 1
            if values or not main:
                yield key, value if values else b""


def _txnid(key: bytes) -> int:
    return int.from_bytes(key, "little") if len(key) == 8 else -1


def _overflow(walk: _Walk, first: int, size: int) -> bytes | None:
    psize = walk.f.psize
    pages = (_PAGE_HEADER - 1 + size) // psize + 1
    if not walk.claim(first, "overflow"):
        return None
    header = walk.f.read(first * psize, _PAGE_HEADER)
    number, _, flags, _, _ = _HEADER.unpack(header)
    run = struct.unpack_from("<I", header, 12)[0]
    if number != first or not flags & _P_OVERFLOW or run < pages:
        walk.check.add(
            f"{walk.name}: overflow page {first} (flags {flags:#x}, {run} pages) cannot hold "
            f"a {size}-byte value"
        )
        return None
    if first + run - 1 > walk.last_pg or (first + run) * psize > walk.f.size:
        walk.check.add(f"{walk.name}: the overflow run at page {first} runs past the file")
        return None
    for extra in range(first + 1, first + run):
        if not walk.claim(extra, "overflow"):
            return None
    walk.overflow += run
    return walk.f.read(first * psize + _PAGE_HEADER, size)


def _check_tree(
    walk: _Walk, meta: _Meta, db: int, *, values: bool
) -> Iterator[tuple[bytes, bytes]]:
    root = meta.root[db]
    if root == _INVALID:
        if meta.entries[db]:
            walk.check.add(f"{walk.name}: no root, but {meta.entries[db]} entries")
        return
    yield from _walk(walk, root, meta.depth[db], values=values, main=db == 1)
    counted = (walk.branch, walk.leaf, walk.overflow, walk.entries)
    recorded = (meta.branch[db], meta.leaf[db], meta.overflow[db], meta.entries[db])
    if counted != recorded:
        walk.check.add(
            f"{walk.name}: found {counted} branch/leaf/overflow pages and entries; the meta "
            f"page says {recorded}"
        )
    if walk.leaf_depths and walk.leaf_depths != {meta.depth[db]}:
        walk.check.add(
            f"{walk.name}: leaves at depths {sorted(walk.leaf_depths)}, the meta says "
            f"{meta.depth[db]}"
        )


def _open(path: str | os.PathLike[str]) -> tuple[_File, list[_Meta]]:
    f = _File(Path(path) / "data.mdb" if Path(path).is_dir() else Path(path))
    metas = _metas(f)
    if metas:
        f.psize = metas[0].psize
    return f, metas


def check_file(path: str | os.PathLike[str]) -> FileCheck:
    """The structural problems of an LMDB file (``path``: the store directory or its
    ``data.mdb``); an empty list for an intact file. Never raises for a damaged file.

    Raises:
        OSError: the file cannot be read at all.
    """
    check = FileCheck()
    f, metas = _open(path)
    try:
        check.pages = f.size // f.psize
        if not metas:
            check.add("neither meta page is intact")
            return check
        meta = metas[0]
        for slot in (0, 1):
            read = next((m for m in metas if m.slot == slot), None)
            if read is None or read.damage:
                check.add(f"meta page {slot} is damaged" + (f": {read.damage}" if read else ""))
        # (The last page may lie past the file's end: LMDB does not write pages that
        # were freed before they were ever written.)
        used: dict[int, str] = {}
        main = _Walk(check, f, meta.last_pg, "main tree", used)
        for _ in _check_tree(main, meta, 1, values=False):
            pass
        check.entries = main.entries
        free = _Walk(check, f, meta.last_pg, "free list", used)
        free_pages: list[int] = []
        for _, value in _check_tree(free, meta, 0, values=True):
            if len(value) < 8 or len(value) % 8:
                check.add("free list: a page list of a malformed length")
                continue
            count = _Q.unpack_from(value)[0]
            if count != len(value) // 8 - 1:
                check.add(f"free list: a page list says {count} pages, holds {len(value) // 8 - 1}")
                continue
            free_pages += [p for (p,) in struct.iter_unpack("<Q", value[8:])]
        for pgno in free_pages:
            if not 2 <= pgno <= meta.last_pg:
                check.add(f"free list: page {pgno} is outside the file")
            elif pgno in used:
                check.add(f"free list: page {pgno} is free and in use ({used[pgno]})")
        if len(set(free_pages)) != len(free_pages):
            check.add("free list: a page is listed free twice")
        return check
    finally:
        f.close()


def meta_damage(path: str | os.PathLike[str]) -> str | None:
    """What is wrong in the meta page LMDB would open ``path`` with (the newest that
    reads), in the fields LMDB takes on trust and writes into every later commit;
    ``None`` where nothing is (or no meta page reads: LMDB refuses that file itself).
    Two reads of the file: the LMDB engine asks before every open, so such damage is
    refused at once instead of spreading to the other meta page with the next write.
    (The fields checked never change in an intact store, so a commit by another
    process meanwhile cannot make this say a healthy store is damaged.)

    Raises:
        OSError: the file cannot be read.
    """
    f, metas = _open(path)
    try:
        if not metas or not metas[0].damage:
            return None
        return f"meta page {metas[0].slot} is damaged: {metas[0].damage}"
    finally:
        f.close()


def salvage(path: str | os.PathLike[str]) -> Iterator[tuple[bytes, bytes]]:
    """Every intact ``(key, value)`` of the main tree, in key order.

    The tree is walked from the newest meta page whose root reads (the other
    one's otherwise); a damaged page's subtree is skipped there, but its
    leaves are usually intact: every leaf page that neither tree reaches nor
    the free list holds (so it was cut off by the damage, not freed) gives the
    keys the walk did not find.
    """
    f, metas = _open(path)
    try:
        for meta in metas:
            used: dict[int, str] = {}
            walk = _Walk(FileCheck(), f, meta.last_pg, "main tree", used)
            found = dict(_walk(walk, meta.root[1], meta.depth[1], values=True, main=True))
            if not found and meta.root[1] != _INVALID and meta is not metas[-1]:
                continue  # this meta's tree does not read at all: try the other one
            free = _Walk(FileCheck(), f, meta.last_pg, "free list", used)
            if meta.root[0] != _INVALID:
                for _, value in _walk(free, meta.root[0], meta.depth[0], values=True, main=False):
                    for (pgno,) in struct.iter_unpack(
                        "<Q", value[8 : 8 + (len(value) // 8 - 1) * 8]
                    ):
                        used.setdefault(pgno, "free")
            for pgno in range(2, min(meta.last_pg + 1, f.size // f.psize)):
                if pgno in used or _HEADER.unpack_from(f.page(pgno))[2] != _P_LEAF:
                    continue
                cut_off = _Walk(FileCheck(), f, meta.last_pg, "main tree", used)
                for key, value in _walk(cut_off, pgno, 1, values=True, main=True):
                    found.setdefault(key, value)
            yield from sorted(found.items())
            return
    finally:
        f.close()
