"""A record's bytes handed to where they will be stored while it is still being written.

A durable save writes each record (a copy into the save's arena and its checksum, on
a pool of threads) and then its store writes the record where it keeps it: a second
pass, which on an LMDB store's value file is a ``pwrite`` whose pages the disk can
start on only then. A :class:`Placement` lets the two overlap: the record's writer
hands over each part as soon as it is written (:meth:`Placement.written`), and the
store, once it knows where the record goes (inside its write transaction), attaches a
*sink* that writes parts there (:meth:`Placement.attach`): the parts written before
it came are written at once, the rest by the writer's own thread as they come. On the
2-core CI VM a 64 MiB save's records written and synced that way took 21.9 ms against
32.0 written whole after their checksums (parts of 4 MiB; 256 MiB 76 against 100 ms,
1 GiB 316 against 363: ``tools/bench/save_parts.py``).

Every part is kept (views of the writer's buffer, no copy), so a transaction that
aborts (:meth:`Placement.detach`) and is retried attaches a new sink that gets every
part again. A sink's error is kept and raised by :meth:`Placement.check`: the store
then fails the transaction as a write of the whole record would have.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Placement", "Sink"]

#: ``sink(offset, part)``: write ``part`` at byte ``offset`` of the record's place.
Sink = Callable[[int, memoryview], None]


class Placement:
    """Where the parts of one record being written go (see the module docstring)."""

    __slots__ = ("_lock", "_idle", "_sink", "_parts", "_busy", "_error", "moved")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._sink: Sink | None = None
        #: Every part written so far: ``(offset in the record, bytes)``.
        self._parts: list[tuple[int, memoryview]] = []
        self._busy = 0  # sink calls under way
        self._error: BaseException | None = None
        #: The writer moved bytes it had handed over (a record whose head came out
        #: shorter than planned): the parts do not make the record; the store writes it
        #: whole instead.
        self.moved = False

    # -- the record's writer ------------------------------------------------------------
    def written(self, offset: int, part: memoryview) -> None:
        """Bytes ``part`` of the record, at ``offset``, are written and will not change:
        to the sink now if one is attached (on this thread), else kept until one is."""
        with self._lock:
            self._parts.append((offset, part))
            sink = self._sink
            if sink is None or self._error is not None:
                return
            self._busy += 1
        self._send(sink, [(offset, part)])

    # -- the store, inside its write transaction -----------------------------------------
    def attach(self, sink: Sink) -> None:
        """Write every part through ``sink``: those written so far now, on this thread,
        the rest on the writer's as they come."""
        with self._lock:
            self._sink, self._error = sink, None
            parts = list(self._parts)
            self._busy += 1
        self._send(sink, parts)

    def detach(self) -> None:
        """No part goes to the sink any more; returns once none is being written (the
        transaction that attached it may end: nothing writes into its space after)."""
        with self._lock:
            self._sink = None
            while self._busy:
                self._idle.wait()

    def check(self) -> None:
        """Raise what a sink raised (the record is not where it was to be)."""
        with self._lock:
            if self._error is not None:
                raise self._error

    def _send(self, sink: Sink, parts: list[tuple[int, memoryview]]) -> None:
        try:
            for offset, part in parts:
                sink(offset, part)
        except BaseException as exc:  # raised on the store's thread by check()
            with self._lock:
                if self._sink is sink and self._error is None:
                    self._error = exc
        finally:
            with self._lock:
                self._busy -= 1
                self._idle.notify_all()
