"""An LMDB node checked before python-lmdb touches its value (issue 18, damage 2).

python-lmdb faults in every page of a value as it hands the value out (its
``preload``, in ``Transaction.get``, ``Cursor.value`` and iteration with
values), so a node whose data size was damaged -- one flipped high bit of an
overflow node -- makes the value run past the end of ``data.mdb`` and the
process dies of SIGBUS inside that call, before any check of ours could run.

So values are read through a cursor: positioning it (``set_key``,
``set_range``, ``next``) reads no value, and its key is a view into the node,
which lies right after the node's 8-byte header (``mdb.c``)::

    u16 lo | u16 hi | u16 flags | u16 ksize | key | data (or, F_BIGDATA: u64 overflow page)

:meth:`NodeGuard.value_span` reads that header through the key's address and
checks what the value would span before the value is asked for:

* the header agrees with the key (``ksize``), has no flag but ``F_BIGDATA``
  (this store has no duplicate or nested databases) and a key of at most 511
  bytes (LMDB's own limit);
* an inline value fits in its node (LMDB's ``nodemax``) and, in a read
  transaction, in its page;
* an overflow value lies inside the pages a read transaction can see (the
  file) or, in a write transaction, inside the map.

It also says where an overflow value of a read transaction lies in the map
(where LMDB finds it: its page number times the page size, past the page's
header), and :func:`view_at` views it there once the map's address is known:
python-lmdb's own view would first touch every page of the value on the reading
thread (16 values of 32 MiB: 4-10 ms before a restore can parse its first
header), while a restore's checks and page-locking read the pages on threads of
their own anyway.

What it cannot defend: LMDB itself follows damaged branch pointers and
compares damaged keys while it searches, and a write transaction may reuse
damaged free-list pages. Those are what ``kvstore verify`` finds with its
own reading of the file (:mod:`kvstore.store.engines.lmdb_file`) and repairs
by rebuilding it; the README's reliability section says so.
"""

from __future__ import annotations

import ctypes
import mmap
import struct
from typing import Any

import numpy as np

__all__ = ["NodeGuard", "MAX_KEY", "DAMAGED", "address_of", "view_at"]

#: LMDB's default largest key (``mdb_env_get_maxkeysize``).
MAX_KEY = 511
#: What a read returns for a value that cannot be delivered safely: no kvstore
#: value is empty, so every reader classifies it as damage (a corrupt record,
#: an unreadable index entry, damaged totals or settings).
DAMAGED = b""

_PAGE_HEADER = 16
_NODE = struct.Struct("<HHHH")
_PGNO = struct.Struct("<Q")
_F_BIGDATA = 0x01


_EIGHT = ctypes.c_char * 8


def _numpy_address(buffer: Any) -> int:
    """The address of a (read-only) buffer's first byte, through numpy (slow: ~20x a get)."""
    return int(np.frombuffer(buffer, dtype=np.uint8).__array_interface__["data"][0])


def _memoryview_buf_offset() -> int | None:
    """Where a memoryview object keeps its ``Py_buffer.buf`` pointer, found and checked
    against numpy on views of two buffers; ``None`` if no offset agrees (another
    Python), and then every address is asked of numpy."""
    probes = [memoryview(bytes(range(64)))[3:], memoryview(bytearray(100))[17:40]]
    for offset in range(16, 128, 8):
        if all(
            ctypes.c_void_p.from_address(id(p) + offset).value == _numpy_address(p) for p in probes
        ):
            return offset
    return None


_BUF_OFFSET = _memoryview_buf_offset()


def address_of(buffer: Any) -> int:
    """The address of a (read-only) buffer's first byte: a cursor's key is a
    memoryview, whose pointer is read in place (a value read per key: it must cost
    far less than the get; numpy's ``__array_interface__`` cost ~20x one)."""
    if _BUF_OFFSET is not None and type(buffer) is memoryview:
        return int(ctypes.c_void_p.from_address(id(buffer) + _BUF_OFFSET).value or 0)
    return _numpy_address(buffer)


class NodeGuard:
    """Checks of the node behind a cursor's current key, for one environment.

    Args:
        psize: the environment's page size.
    """

    def __init__(self, psize: int) -> None:
        self.psize = psize
        # ((psize - page header) / MDB_MINKEYS, even) - sizeof(indx_t), as mdb.c sets me_nodemax.
        self.nodemax = (((psize - _PAGE_HEADER) // 2) & ~1) - 2
        # Map pages sit at page-aligned addresses when LMDB's page divides the OS's
        # (mmap returns OS-page-aligned maps); then a node's offset in its page is known.
        self.aligned = mmap.PAGESIZE % psize == 0

    def key_ok(self, key: Any, *, mapped: bool) -> bool:
        """Whether ``key`` (a cursor's key view) can be copied: a sane length inside its page."""
        size = len(key)
        if not 0 < size <= MAX_KEY:
            return False
        if mapped and self.aligned:
            return address_of(key) % self.psize + size <= self.psize
        return True

    def inline_size(self, key: Any) -> int | None:
        """The size of the value held inside the node whose key view is ``key``; ``None``
        for a value in overflow pages, or a node that cannot be read safely (its value
        is then never touched: a damaged size could fault past the file)."""
        ksize = len(key)
        if not 0 < ksize <= MAX_KEY:
            return None
        lo, hi, flags, node_ksize = _NODE.unpack(_EIGHT.from_address(address_of(key) - _NODE.size))
        if node_ksize != ksize or flags:
            return None
        size = lo | hi << 16
        return size if _NODE.size + ksize + size <= self.nodemax else None

    def value_span(self, key: Any, end: int, *, mapped: bool) -> tuple[int, int] | None:
        """Where the value of the node whose key view is ``key`` lies, checked as the
        module says: ``(offset, size)``, ``offset`` the value's first byte from the map's
        start for an overflow value of a read transaction (where LMDB itself finds it:
        its first page's number times the page size, past that page's header) and -1 for
        any other (inline, a write transaction's own pages); ``None`` where it cannot be
        read safely.

        Args:
            key: the cursor's current key (a view into the node).
            end: bytes of the pages the transaction found committed (a read
                transaction: the file; every page it sees lies below).
            mapped: a read transaction: every page it sees is in the map, at
                page-aligned addresses. A write transaction's own pages are in
                heap memory instead; an overflow run starting at or past
                ``end`` is one it wrote (LMDB hands out its in-memory copy).
        """
        ksize = len(key)
        if not 0 < ksize <= MAX_KEY:
            return None
        addr = address_of(key)
        lo, hi, flags, node_ksize = _NODE.unpack(_EIGHT.from_address(addr - _NODE.size))
        if node_ksize != ksize or flags & ~_F_BIGDATA:
            return None
        size = lo | hi << 16
        offset = addr % self.psize if mapped and self.aligned else None
        if not flags & _F_BIGDATA:
            if _NODE.size + ksize + size > self.nodemax:
                return None
            return (-1, size) if offset is None or offset + ksize + size <= self.psize else None
        if offset is not None and offset + ksize + _PGNO.size > self.psize:
            return None
        (pgno,) = _PGNO.unpack(_EIGHT.from_address(addr + ksize))
        start = pgno * self.psize
        if pgno < 2:
            return None
        if not mapped:
            # past end: written by this transaction, in memory, its size LMDB's own
            return (-1, size) if start >= end or start + _PAGE_HEADER + size <= end else None
        return (start + _PAGE_HEADER, size) if start + _PAGE_HEADER + size <= end else None


_FROM_MEMORY = ctypes.pythonapi.PyMemoryView_FromMemory
_FROM_MEMORY.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_FROM_MEMORY.restype = ctypes.py_object
_PYBUF_READ = 0x100


def view_at(address: int, size: int) -> memoryview:
    """A read-only view of ``size`` bytes at ``address`` (as python-lmdb makes its
    values' views, without touching their pages first)."""
    view: memoryview = _FROM_MEMORY(address, size, _PYBUF_READ)
    return view
