"""A large save committed in waves: the next wave encoded while the last one commits.

A save encodes its missing blocks (rows copied into the arena -- across the bus on
a GPU -- and checksummed), then puts them into the backend and commits. In that
order the encode waits for nothing and the commit (LMDB's copy into its pages, the
write-out, the fsync) waits for the whole encode. A save of at least two waves'
bytes (:data:`WAVE_BYTES`) therefore goes in waves: its first block alone, then
waves of about :data:`WAVE_BYTES` each; while one wave's transaction runs on the
commit thread, the caller's thread encodes the next. The time of the smaller of the
two mostly disappears: on the 2-core CI VM a 256 MiB save spent 39 ms encoding,
24 ms in LMDB's puts and 115 ms in the commit (``tools/bench/save_profile.py
--phases``).

Each wave is one transaction over the save's blocks up to its last. The blocks of
earlier waves are stored then: pinned against the wave's evictions and touched,
never written twice. A save stopped between waves -- killed, or failing on a full
store -- leaves the blocks of the waves before: a shorter prefix of the prompt,
fully usable, as a save of that prefix would have left it. ``KVSTORE_SAVE_WAVE_MIB=0``
commits every save in one transaction, as before.

Saves grouped into one transaction (``durability="group"``) and saves that upgrade
stored blocks with a checkpoint are committed whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import wait
from dataclasses import replace
from typing import Any

from kvstore.knobs import mib_from_env
from kvstore.store.blocks import saving
from kvstore.store.blocks.saving import SaveJob, SaveOutcome, Span
from kvstore.threads import KeptPool

__all__ = ["WAVE_BYTES", "save_in_waves", "wave_spans", "worth_waves"]

#: A wave's bytes (``KVSTORE_SAVE_WAVE_MIB``, 0: no waves).
WAVE_BYTES = mib_from_env("KVSTORE_SAVE_WAVE_MIB", 128)

#: The thread the waves after the first are encoded on. The transactions stay on the
#: caller's: LMDB binds a write transaction to its thread, and glibc serves a thread
#: other than the main one big blocks (LMDB's pages for a record) from heaps it unmaps
#: when they empty: 32 MiB puts took ~7 ms each there against ~2.7 on the main thread
#: (CI VM), which turned waves committed on a thread of their own 1.6x slower.
_ENCODES = KeptPool("kvstore-encode", lambda: 1)

#: ``commit(wave job, size hint) -> its outcome``: one transaction.
Commit = Callable[[SaveJob, int], SaveOutcome]
#: ``encode(spans, into)``: the records of ``spans`` into the dict ``into``.
Encode = Callable[[list[Span], dict[int, Any]], None]


def worth_waves(first_record_nbytes: int, spans: int) -> bool:
    """Whether ``spans`` blocks whose first record is ``first_record_nbytes`` make at
    least two waves' bytes."""
    return WAVE_BYTES > 0 and spans > 1 and first_record_nbytes * spans >= 2 * WAVE_BYTES


def wave_spans(todo: Sequence[Span], first_record_nbytes: int) -> list[list[Span]]:
    """``todo`` cut into waves: the first block alone (already encoded: the pipeline
    starts at once), then runs of about :data:`WAVE_BYTES`."""
    per = max(1, WAVE_BYTES // max(1, first_record_nbytes))
    rest = list(todo[1:])
    return [list(todo[:1]), *(rest[i : i + per] for i in range(0, len(rest), per))]


def save_in_waves(job: SaveJob, waves: list[list[Span]], encode: Encode, commit: Commit) -> None:
    """Commit ``waves`` one transaction each on this thread, the next wave encoded on
    another meanwhile; the first wave's records are in ``job.encoded`` already. Each
    committed wave's outcome is appended to ``job.committed``, so a wave that raises
    (a concurrent eviction's :class:`~kvstore.store.blocks.saving.Stale`, a full
    store, an encode's error) leaves the caller what the earlier ones wrote."""
    pool = _ENCODES.get()
    for i, wave in enumerate(waves):
        # The last wave spans the whole prompt: its tail's cover, every block touched.
        end = len(job.spans) if i == len(waves) - 1 else wave[-1].index + 1
        records = {s.index: job.encoded.pop(s.index) for s in wave}
        size = sum(saving.record_nbytes(r) for r in records.values())
        wave_job = replace(job, spans=job.spans[:end], encoded=records, committed=[])
        del records
        upcoming: dict[int, Any] = {}
        future = pool.submit(encode, waves[i + 1], upcoming) if i + 1 < len(waves) else None
        try:
            out = commit(wave_job, size)
        finally:
            wave_job.encoded.clear()  # the records' buffer may be reused
            if future is not None:
                wait([future])  # done before anything leaves: it writes into the arena
        if future is not None:
            future.result()  # its error, after the commit's
        job.encoded.update(upcoming)
        job.committed.append(out)
