"""Checksums taken by the copy that reads the bytes anyway: a record's payload hashed
by the thread copying its rows, a chunk at a time, from the CPU's cache, instead of
read from memory a second time by the store's checks.

A restore on the CPU is bound by memory bandwidth. On the 2-core x86 CI VM, a
2048-token llama-8B restore (256 MiB) took 30.2 ms with the checks hashing every
record beside the copies, and 26.7 ms with the copies hashing most of them (median
of five alternations of ``python -m tools.bench.restore_python --cpu-route --shape
llama8b --tokens 2048``).

The protocol, between a reader and the store's checks
(:meth:`~kvstore.abc.store.PrefixStore.read_checking`), one record at a time:

* before the checks start, the reader opens its read's records to claims
  (:meth:`Claims.taken`, the read's ``claim``); a record another reader opened is
  not opened again;
* a large record (:data:`RESERVED_MIN_BYTES`) is claimed as it is opened: no check
  begins it, though a check may wait for it;
* the checks hash the other records from the last one while the reader parses and
  plans; as its copies start, the reader claims every record no check has begun
  (:meth:`Claims.claim_open`), and the checks wait for the reader's digests
  (:func:`digest_of`), which they still compare with the headers': nothing is
  served that was not checked. Claimed one record at a time instead, as each copy
  began, the checks went on hashing beside the copies, competing with them for the
  memory bus: 32.5 ms, slower than with no claims;
* a claim the reader leaves unresolved (it failed) is dropped when its read ends
  its checks, and the check waiting on it hashes the record itself; the records
  are closed before the read's views are released, so a digest is never taken
  for other bytes at the same address.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from kvstore.codecs.payload_tensors import Payload

__all__ = ["RESERVED_MIN_BYTES", "Claims", "digest_of", "takes_digests", "taking_digests"]

_F = TypeVar("_F", bound=Callable[..., Any])


def taking_digests(verify: _F) -> _F:
    """Mark ``verify`` (a store's record check) as one that takes a reader's digests
    (:func:`digest_of`): a read claims records only for a check that does."""
    verify.takes_copied_digests = True  # type: ignore[attr-defined]
    return verify


def takes_digests(verify: Callable[..., Any]) -> bool:
    """Whether ``verify`` was marked by :func:`taking_digests`."""
    return bool(getattr(verify, "takes_copied_digests", False))


_OPEN, _CHECKED, _CLAIMED = "open", "checked", "claimed"

#: A record of at least this many bytes is claimed by its reader as the read opens it,
#: so no check begins it: a check that does hashes it whole from memory, beside the
#: copies, long after the parse it was to fill. In P1 the checks had begun some or all
#: of a restore's records before the copies in about one restore of five (all 8 of a
#: 2048-token llama-8B restore's 32 MiB records, twice); claimed at once, P1's ratio to
#: mlx-lm's load went 0.81-0.89 -> 0.85-0.99 at llama-8B 512, 0.67-0.80 -> 0.74-0.78
#: at 2048, 1.21-1.26 -> 1.30-1.44 at gemma-swa 512 (three runs alternated on the 2-core
#: x86 CI VM, ``tools/bench/results/cpu-62c5bbd-reserved-p1ab/``). Smaller records
#: stay open to the checks, which hash a few on the core the parse leaves idle.
RESERVED_MIN_BYTES = 8 << 20


class _Record:
    """One record opened to claims: who hashes it, and the reader's digest."""

    __slots__ = ("state", "done", "digest")

    def __init__(self) -> None:
        self.state = _OPEN
        self.done = threading.Event()
        #: The reader's digest once ``done``; ``None`` when it dropped its claim.
        self.digest: int | None = None


#: (address, length) of each open record's bytes -> the record.
_RECORDS: dict[tuple[int, int], _Record] = {}
_LOCK = threading.Lock()


def _key(view: memoryview) -> tuple[int, int]:
    return Payload(view).address, view.nbytes


def digest_of(view: memoryview, digest: Callable[[memoryview], int | None]) -> int | None:
    """``digest(view)`` (the checksum a check computes of record ``view``), or the digest
    the reader that claimed ``view`` computed of the same bytes as it copied them."""
    if not _RECORDS or not view.nbytes:  # records open before the checks that ask start
        return digest(view)
    with _LOCK:
        record = _RECORDS.get(_key(view))
        if record is not None and record.state == _OPEN:
            record.state = _CHECKED  # this check hashes it; its reader only copies it
    if record is not None and record.state == _CLAIMED:
        record.done.wait()
        if record.digest is not None:
            return record.digest
    return digest(view)


class Claims:
    """The records of one read that its reader may hash as it copies them.

    Args:
        wanted: whether to open a read's records to claims at all, given their
            views (a restore does for what it copies on the CPU, in enough records
            to keep every copying thread busy).
    """

    def __init__(self, wanted: Callable[[Sequence[memoryview]], bool]) -> None:
        self._wanted = wanted
        self._open: dict[int, _Record] = {}
        #: The read's views, when they were wanted.
        self.records: Sequence[memoryview] = ()

    def __contains__(self, record: int) -> bool:
        """Whether record ``record`` (its index in the read's views) is this reader's
        to claim or hash."""
        return record in self._open

    @contextmanager
    def taken(self, views: Sequence[memoryview]) -> Iterator[None]:
        """Open every record of ``views`` no other reader has to claims (when
        ``wanted``); on exit drop every claim (an unresolved one makes its check hash
        the record) and close them."""
        keys: list[tuple[int, int]] = []
        if self._wanted(views):
            self.records = views
            with _LOCK:
                for i, view in enumerate(views):
                    key = _key(view)
                    if view.nbytes and key not in _RECORDS:
                        keys.append(key)
                        self._open[i] = _RECORDS[key] = _Record()
                        if view.nbytes >= RESERVED_MIN_BYTES:
                            self._open[i].state = _CLAIMED
        try:
            yield
        finally:
            self.drop()
            self.records = ()
            with _LOCK:
                for key in keys:
                    del _RECORDS[key]

    def claim_open(self) -> set[int]:
        """Claim every record of this reader's that no check has begun hashing (the
        checks hash the rest): their indices in the read's views."""
        with _LOCK:
            for found in self._open.values():
                if found.state == _OPEN:
                    found.state = _CLAIMED
            # Those just claimed and those claimed as they were opened.
            return {i for i, found in self._open.items() if found.state == _CLAIMED}

    def resolve(self, record: int, digest: int) -> None:
        """Hand the checks claimed record ``record``'s payload digest (computed over
        exactly the bytes the record format's check hashes)."""
        found = self._open[record]
        found.digest = digest
        found.done.set()

    def drop(self) -> None:
        """Give up every claim not resolved yet, and claim nothing more: the checks
        hash those records."""
        with _LOCK:
            for found in self._open.values():
                if found.state == _OPEN:
                    found.state = _CHECKED
                found.done.set()
        self._open = {}
