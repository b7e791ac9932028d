"""Serving a read's run of records: checked before the views are handed out, or,
for :meth:`~kvstore.abc.store.PrefixStore.read_checking`, while they are.

Either way the same checks decide what is served (:func:`~.checks.served_run`:
the leading intact records) and report what ended the run; the views are
released when the read ends, after any checks still reading them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, cast

from kvstore.abc.store import Backend, BlockRef, CheckingViews, Claim, MissReason
from kvstore.codecs.copied_sums import takes_digests
from kvstore.errors import CorruptEntryError, FormatVersionError
from kvstore.store.blocks.checks import Verdict, in_background, served_run
from kvstore.store.blocks.stats import Counters

__all__ = ["Report", "served_views", "count_read_end", "why_absent", "release"]

#: ``report(served, verdict, absent)``: what ended a run (see :func:`.checks.served_run`).
Report = Callable[[int, Verdict, "int | None"], None]


@contextmanager
def served_views(
    values: Sequence[Any | None],
    verify: Callable[[memoryview], None],
    report: Report,
    *,
    checking: bool,
    claim: Claim | None = None,
) -> Iterator[list[memoryview]]:
    """The views a read serves of ``values`` (one per block, ``None`` where not stored).

    ``checking``: a :class:`~kvstore.abc.store.CheckingViews` of every leading
    stored record, its checks running on other threads (``intact()`` waits
    for them); else the verified views, checked here first. ``report`` is
    called once, from whichever thread ran the checks. ``claim``: with
    ``checking``, entered with the views before the checks start and left before
    they are waited for (:meth:`~kvstore.abc.store.PrefixStore.read_checking`).
    """
    served: list[list[memoryview]] = []

    def check() -> int:
        views, verdict, absent = served_run(verify, values)
        served.append(views)
        report(len(views), verdict, absent)
        return len(views)

    claimed = ExitStack()
    if checking:
        stored = [memoryview(cast(Any, v)) for v in itertools.takewhile(_is_stored, values)]
        if claim is not None and takes_digests(verify):  # else no check would take them
            claimed.enter_context(claim(stored))
        pending = in_background(check)
        out: list[memoryview] = CheckingViews(stored, pending.result)
    else:
        check()
        out = stored = served[0]
    try:
        yield out
    finally:
        if checking:
            claimed.close()  # a check waiting on a claim left unresolved hashes itself
            pending.result()  # the hashing threads read the views: wait, then release
        release(stored)
        release(served[0] if served else [])


def count_read_end(
    counters: Counters,
    absent_reason: Callable[[bytes], str],
    blocks: Sequence[BlockRef],
    served: int,
    verdict: Verdict,
    absent: int | None,
    *,
    corrupt: list[bytes],
) -> None:
    """Count what ended a read's run of ``blocks`` (``served`` of them intact) in
    ``counters``; a corrupt record's key (or one the server dropped) joins ``corrupt``,
    to be removed like one."""
    if isinstance(verdict, CorruptEntryError):
        corrupt.append(blocks[served].key)
        counters.miss(MissReason.CORRUPT)
        counters.add(corruptions=1)
    elif isinstance(verdict, FormatVersionError):
        counters.miss(MissReason.VERSION)
    elif absent is not None:
        reason = absent_reason(blocks[absent].key)
        counters.miss(reason)
        if reason == MissReason.SERVER_EVICTED:
            corrupt.append(blocks[absent].key)


def why_absent(key: bytes, quarantine: Collection[bytes], backend: Backend) -> str:
    """Why a matched block's record could not be read."""
    if key in quarantine:
        return MissReason.CORRUPT
    if backend.contains_many([key])[0]:
        return MissReason.SERVER_EVICTED  # indexed, but the server dropped its record
    return MissReason.VANISHED


def release(views: list[memoryview]) -> None:
    """Release ``views``: using one afterwards raises instead of reading pages the
    store may reuse. (Arrays or slices made from a view cannot be revoked: copy
    what you keep inside the read.)"""
    for mv in views:
        mv.release()


def _is_stored(value: Any) -> bool:
    return value is not None
