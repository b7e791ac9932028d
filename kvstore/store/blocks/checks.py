"""Checking many records at once: each record's checks, two at a time.

A record's ``verify`` is two kinds of work: parsing its header (Python,
holding the GIL) and hashing its payload (xxhash, which releases the GIL).
On two threads, one record's header is parsed while another's payload is
hashed, so a restore of many large records waits for roughly the larger of
the two totals instead of their sum. Small reads stay on the caller's thread
(starting a thread costs more than it saves).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence

from kvstore.errors import CorruptEntryError, FormatVersionError

__all__ = ["PARALLEL_MIN_BYTES", "Verdict", "check_records"]

#: Below this many bytes in all, the records are checked on the caller's thread.
PARALLEL_MIN_BYTES = 8 << 20

#: What checking one record found: ``None`` (intact) or the error ``verify`` raised.
Verdict = CorruptEntryError | FormatVersionError | None


def check_records(
    verify: Callable[[memoryview], None], records: Sequence[memoryview]
) -> list[Verdict]:
    """The verdicts of ``verify`` on the leading ``records``, in order, up to the
    first one that fails (included).

    Any exception but ``CorruptEntryError``/``FormatVersionError`` propagates.
    """
    if len(records) < 2 or sum(r.nbytes for r in records) < PARALLEL_MIN_BYTES:
        verdicts: list[Verdict] = []
        for record in records:
            verdicts.append(_check(verify, record))
            if verdicts[-1] is not None:
                break
        return verdicts
    found: list[Verdict] = [None] * len(records)
    raised: list[BaseException] = []
    turns = itertools.count()  # next() on a count is atomic under the GIL

    def work() -> None:
        for i in turns:
            if i >= len(records) or raised:
                return
            try:
                found[i] = _check(verify, records[i])
            except BaseException as exc:  # re-raised on the caller's thread
                raised.append(exc)
                return

    helper = threading.Thread(target=work, name="kvstore-verify", daemon=True)
    helper.start()
    try:
        work()
    finally:
        helper.join()
    if raised:
        raise raised[0]
    first_bad = next((i for i, verdict in enumerate(found) if verdict is not None), None)
    return found if first_bad is None else found[: first_bad + 1]


def _check(verify: Callable[[memoryview], None], record: memoryview) -> Verdict:
    try:
        verify(record)
    except (CorruptEntryError, FormatVersionError) as exc:
        return exc
    return None
