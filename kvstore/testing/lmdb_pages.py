"""A reader of LMDB's on-disk pages, for tests and tools that damage ``data.mdb`` on purpose.

It knows LMDB 0.9's layout (``mdb.c``; 64-bit builds), which is all the
damage tests need: where each page kind starts and where a leaf's nodes are,
so a test can flip the high bit of an overflow node's data size or a bit in
a branch page, and a sweep can spread its flips over every kind of page::

    page   = header (16 bytes) | ...
    header = u64 pgno | u16 pad | u16 flags | u16 lower, u16 upper   (or u32 overflow pages)
    node   = u16 lo | u16 hi | u16 flags | u16 ksize | key | data    (leaf: size = lo | hi << 16)
    meta   = header | u32 magic 0xBEEFC0DE | u32 version | ...

A node's offset in its page is ``mp_ptrs[i]`` (u16 words right after the
header, ``(lower - 16) / 2`` of them). A leaf node with ``F_BIGDATA`` holds an
8-byte page number in place of its data: the value lies in that run of
overflow pages, after their first page's header.

Nothing here is used by the store itself; the store must survive whatever
these helpers do to its file.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PAGE_HEADER",
    "P_BRANCH",
    "P_LEAF",
    "P_OVERFLOW",
    "P_META",
    "F_BIGDATA",
    "Node",
    "Page",
    "read_pages",
    "leaf_nodes",
    "find_leaf_node",
    "flip_bit",
]

PAGE_HEADER = 16
P_BRANCH, P_LEAF, P_OVERFLOW, P_META = 0x01, 0x02, 0x04, 0x08
F_BIGDATA = 0x01
_HEADER = struct.Struct("<QHHHH")
_NODE = struct.Struct("<HHHH")
_MAGIC = 0xBEEFC0DE


@dataclass(frozen=True)
class Page:
    """One page of the file and what kind it is.

    ``kind`` is ``meta``, ``branch``, ``leaf``, ``overflow`` (the first page of
    a run, which has a header), ``overflow-data`` (the rest of a run: value
    bytes only) or ``other`` (a freed or never-written page).
    """

    pgno: int
    kind: str
    offset: int


@dataclass(frozen=True)
class Node:
    """A leaf node: where it is in the file, its key and its value's size."""

    offset: int  # file offset of the node header
    key: bytes
    flags: int
    size: int  # lo | hi << 16: the value's length as LMDB will report it
    overflow_pgno: int | None  # the value's first overflow page (F_BIGDATA)

    @property
    def size_offset(self) -> int:
        """File offset of the node's ``hi`` word (bits 16-31 of the size)."""
        return self.offset + 2


def _page_size(data: bytes) -> int:
    # The meta page records the page size in mm_dbs[FREE_DBI].md_pad.
    magic = struct.unpack_from("<I", data, PAGE_HEADER)[0]
    if magic != _MAGIC:
        return 4096
    return struct.unpack_from("<I", data, PAGE_HEADER + 24)[0] or 4096


def _roots(data: bytes, psize: int) -> list[int]:
    """Root pages of the free-list and main trees, from the newer intact meta page."""
    best: tuple[int, list[int]] | None = None
    for pgno in (0, 1):
        off = pgno * psize
        if len(data) < off + 160 or struct.unpack_from("<I", data, off + PAGE_HEADER)[0] != _MAGIC:
            continue
        txnid = struct.unpack_from("<Q", data, off + 144)[0]
        roots = [struct.unpack_from("<Q", data, off + 40 + 48 * i + 40)[0] for i in (0, 1)]
        if best is None or txnid > best[0]:
            best = (txnid, roots)
    return [] if best is None else [r for r in best[1] if r != (1 << 64) - 1]


def _nodes(data: bytes, off: int, psize: int) -> Iterator[tuple[int, int, int, int, int]]:
    """``(file offset, lo, hi, flags, ksize)`` of each node of the page at ``off``."""
    _, _, _, lower, _ = _HEADER.unpack_from(data, off)
    for i in range(max(0, min(lower, psize) - PAGE_HEADER) // 2):
        ptr = struct.unpack_from("<H", data, off + PAGE_HEADER + 2 * i)[0]
        if PAGE_HEADER <= ptr <= psize - _NODE.size:
            yield (off + ptr, *_NODE.unpack_from(data, off + ptr))


def read_pages(path: str | Path) -> tuple[int, list[Page]]:
    """``(page size, every page of data.mdb)`` with its kind.

    Kinds come from walking both B-trees from the current meta page, so a
    freed page (stale content) is ``other``, whatever its header says.
    """
    data = Path(path).read_bytes()
    psize = _page_size(data)
    count = len(data) // psize
    kinds = {0: "meta", 1: "meta"}
    todo = [r for r in _roots(data, psize) if 1 < r < count]
    while todo:
        pgno = todo.pop()
        if pgno in kinds or not 1 < pgno < count:
            continue
        off = pgno * psize
        flags = _HEADER.unpack_from(data, off)[2]
        if flags & P_BRANCH:
            kinds[pgno] = "branch"
            for _, lo, hi, nflags, _ in _nodes(data, off, psize):
                todo.append(lo | hi << 16 | nflags << 32)
        elif flags & P_LEAF:
            kinds[pgno] = "leaf"
            for at, _, _, nflags, ksize in _nodes(data, off, psize):
                if nflags & F_BIGDATA and at + _NODE.size + ksize + 8 <= len(data):
                    first = struct.unpack_from("<Q", data, at + _NODE.size + ksize)[0]
                    if 1 < first < count and first not in kinds:
                        fo = first * psize
                        if _HEADER.unpack_from(data, fo)[2] & P_OVERFLOW:
                            run = struct.unpack_from("<I", data, fo + 12)[0]
                            kinds[first] = "overflow"
                            for extra in range(1, min(run, count - first)):
                                kinds[first + extra] = "overflow-data"
    pages = [Page(n, kinds.get(n, "other"), n * psize) for n in range(count)]
    return psize, pages


def leaf_nodes(path: str | Path) -> Iterator[Node]:
    """Every node of every live leaf page, in file order."""
    data = Path(path).read_bytes()
    psize, pages = read_pages(path)
    for page in pages:
        if page.kind != "leaf":
            continue
        for at, lo, hi, flags, ksize in _nodes(data, page.offset, psize):
            key = data[at + _NODE.size : at + _NODE.size + ksize]
            pgno = None
            if flags & F_BIGDATA:
                pgno = struct.unpack_from("<Q", data, at + _NODE.size + ksize)[0]
            yield Node(at, key, flags, lo | hi << 16, pgno)


def find_leaf_node(path: str | Path, key: bytes) -> Node:
    """The live leaf node of ``key``.

    Raises:
        LookupError: no live leaf holds it.
    """
    for node in leaf_nodes(path):
        if node.key == key:
            return node
    raise LookupError(f"no leaf node holds {key!r}")


def flip_bit(path: str | Path, offset: int, bit: int) -> None:
    """Flip bit ``bit`` (0-7) of the byte at ``offset``, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))
