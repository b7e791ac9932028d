"""Arrays a CUDA GPU gathers straight out of host pages: the store's own.

A lossless restore's rows sit in the store's pages (numpy views into the LMDB
map), each layer's rows spread over one record per block. Staged the plain way
(:func:`kvstore.codecs.cuda.upload`), a host thread first copies each layer's
rows out of those pages into a pinned slot, and only then do they cross the
bus: on an H200 host that gather runs at about 2 GB/s per thread over freshly
mapped 4 KiB pages, and it was 34 of a 76 ms restore of 4096 tokens of
llama-8B.

Here the host copies nothing. The pages the rows are in are page-locked where
they are (``cuMemHostRegister`` with ``CU_MEMHOSTREGISTER_READ_ONLY``: the map
is read-only), on :func:`register_threads` threads in address order, and each
span, as soon as it is locked, is copied whole into device memory by the copy
engine (:data:`STAGE_SPANS`); one kernel then gathers the rows of up to 64 arrays
there, the zeros past them included. Where that memory cannot be had, kernels read the
rows from the locked pages over PCIe instead: a group of records' rows at a time
into a buffer on the device, each group as soon as its records are locked, then
one kernel per array joins them there (:func:`_group_buffers`); rows in one span
of pages are read by one kernel per array straight away. Measured there
(``tools/bench/gpu/pages_probe.py``, 16 records of 32 MiB, a fresh process):
registering the 512 MiB takes 14 ms on 12 threads, the 64 gathers 13 ms
(40 GB/s), bit-exact; unregistering (7 ms) happens on a staging thread a
moment after the restore returns (:data:`RELEASE_DELAY_SECONDS`), off the first
token's path. In a restore the registrations end about 21 ms in on 4 threads or
12; in groups the first rows cross from ~14 ms in, and G1's restore took 39.7 ms
(``tools/bench/results/gpu/7220a03/``).

The caller keeps the pages mapped until the arrays are evaluated (a restore
gathers inside its read transaction). Pages another thread's gather holds are
not registered twice: such a restore, and any whose rows are not laid out as a
gather reads them, gets ``None`` and stages the plain way.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import math
import mmap
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kvstore.codecs import cuda, device_joins, gather_tables
from kvstore.codecs.arrays import MLX_DTYPES
from kvstore.codecs.one_buffer import buffer_starts, views_in
from kvstore.knobs import (
    choice_from_env,
    count_from_env,
    mib_from_env,
    ms_from_env,
    switch_from_env,
)
from kvstore.threads import KeptPool

__all__ = [
    "GATHER_MIN_BYTES",
    "RELEASE_DELAY_SECONDS",
    "PinnedPages",
    "pin",
    "register_threads",
    "gathered",
    "gathered_flat",
    "settle",
    "trial_done",
]

#: Below this many bytes in all, staging through slots costs less than page-locking.
GATHER_MIN_BYTES = mib_from_env("KVSTORE_CUDA_GATHER_MIN_MIB", 16)

#: Groups of spans a gather of rows in several spans crosses the bus in (at most
#: :data:`~kvstore.codecs.cuda.ASSEMBLE_INPUTS`; 1: a gather per array, after every span
#: is locked): :func:`_group_buffers`.
GATHER_GROUPS = min(cuda.ASSEMBLE_INPUTS, count_from_env("KVSTORE_CUDA_GATHER_GROUPS", 8, "groups"))

#: Whether each span is copied into device memory as soon as it is locked, on the
#: thread that locked it (``KVSTORE_CUDA_STAGE_SPANS``, default on; ``0``: the gathers
#: read the rows from the host pages, in groups as they are locked). The copy engine then
#: moves the bytes while later spans are still being locked and the restore's own thread
#: still parses and plans, and the gathers read the rows at the device memory's speed
#: once it is done: no group buffers, no assemble. Before, the rows crossed only once
#: that thread reached its first gather (H200, 4096 tokens of llama-8B: 19.4 ms in,
#: with every page locked by 20.8, and the bus needing ~10 ms for the 512 MiB:
#: ``tools/bench/results/gpu/7837ba3/ab-graphs.txt``). For that moment the rows are on
#: the device twice, as in groups.
STAGE_SPANS = switch_from_env("KVSTORE_CUDA_STAGE_SPANS")

#: How a restore's records reach the device memory its gathers read
#: (``KVSTORE_CUDA_PAGES_ROUTE``). ``lock``: the store's pages are page-locked where they
#: are and each span copied from there (:data:`STAGE_SPANS`); the driver locks pages no
#: faster on more threads (~3.6 GB/s a thread, 4 threads at most pay: a TurboQuant 4/4
#: restore's 133 MiB were locked 2 -> 16 ms in on the H200, ``results/gpu/8e1beb9/``).
#: ``copy``: no page is locked; the staging threads (:func:`cuda.workers`) each map a
#: chunk of a record in (``MADV_POPULATE_READ``: 512 MiB in 2.7 ms on 16 threads
#: there), copy it into a staging slot (pinned once for the process:
#: :func:`cuda.prepare_slots_later`) and from there into the device memory, so every
#: core moves bytes. A restore taken before the slots are made locks its pages.
#: Measured slower on the H200 (``results/gpu/067a216/``: TurboQuant 4/4 22.3 -> 42.6 ms,
#: lossless 34.9 -> 66.6): a chunk took ~1 ms of CPU per 3 MiB, no faster a byte than the
#: driver's locking, and waited ~4 ms more for the GIL, taken back some eight times a
#: chunk, which held the restore's own thread back as long. Kept for hosts where locking
#: is slower; it would win with each chunk's work done in one call that keeps no GIL.
PAGES_ROUTE = choice_from_env("KVSTORE_CUDA_PAGES_ROUTE", ("lock", "copy"), "lock")

#: The most bytes one staging thread copies at a time on the ``copy`` route
#: (``KVSTORE_CUDA_COPY_CHUNK_MIB``): each record is cut into about equal chunks of at
#: most this, so that a restore's few records keep every thread busy.
COPY_CHUNK_BYTES = max(mmap.PAGESIZE, mib_from_env("KVSTORE_CUDA_COPY_CHUNK_MIB", 4))

#: Registrations at once (``KVSTORE_CUDA_REGISTER_THREADS``). The driver locks a
#: restore's pages no faster on more threads, only all of them later: H200, 4096 tokens
#: of llama-8B (16 records), the last registration ended 20.6 ms into the restore on 12
#: threads and on 4 alike, 22.5 on 3, 27.5 on 2. On 4, in address order, the first
#: records are locked by 9 ms and their rows cross the bus while the rest are
#: (:data:`GATHER_GROUPS`): restore 35.7 ms on 12 threads, a gather per array, against
#: 33.6 on 4 in 4 groups (``tools/bench/results/gpu/0a997c3/ab-threads*.txt``).
REGISTER_THREADS_DEFAULT = 4

#: The GIL switch interval while pages are being locked (Python's default is 5 ms).
#: Each registration is a ctypes call, whose thread takes the GIL to make it and again
#: to return, while the restore's own thread parses and plans, keeping the GIL for a
#: whole interval each time. H200, 4096 tokens of llama-8B, 16 records: the
#: registrations ended 45.7 -> 21.8 ms into the restore, which took 67.8 -> 51.2 ms.
#: (Locking each record in pieces, to start gathers sooner, cost more than it saved:
#: 74-97 ms with pieces of 8, 4 or 2 MiB, a call costing about 4 ms whatever its size.)
#: At least 1 us: sys.setswitchinterval refuses 0.
SWITCH_SECONDS = max(1e-6, ms_from_env("KVSTORE_CUDA_SWITCH_MS", 0.5))

#: How long a restore's pages stay locked after it returns. Unregistering 512 MiB takes
#: the driver about 7 ms, and kernels launched meanwhile wait on it: H200, the one-token
#: forward right after a 4096-token llama-8B restore evaluated in 13.2 ms with the pages
#: let go at once, 9.5 ms with them let go first (8.5 ms over the model's own caches;
#: ``tools/bench/results/gpu/0b78bf9/forward-profile.txt``). Let go later, that cost
#: leaves the first token's path. A restore that needs the same pages sooner starts
#: their release at once and locks them after it (:func:`_pinned`).
RELEASE_DELAY_SECONDS = ms_from_env("KVSTORE_CUDA_RELEASE_DELAY_MS", 250)

_PAGE = mmap.PAGESIZE
_LOCK = threading.Lock()
#: Page spans registered now (or being), as sorted ``(start, end)``: a live gather's,
#: or an earlier one's until its release (:data:`_RELEASES`) is done, when a later
#: gather's span may share its pages (and be registered once it is let go).
_HELD: list[tuple[int, int]] = []


class PinnedPages:
    """Host pages page-locked for the GPU to read, the registrations running on the
    staging threads from the moment :func:`pin` returns (a restore parses and plans
    meanwhile), in address order. :meth:`shift` waits only for the span it needs, so a
    gather can start while later spans are still being locked.
    :meth:`release` lets them go, after the gathers that read them."""

    def __init__(
        self,
        transport: cuda.Transport,
        spans: list[tuple[int, int]],
        *,
        inline: bool = False,
        after: Sequence[Sequence[Future[None]]] | None = None,
        stage: bool | None = None,
        copy: bool = False,
    ) -> None:
        self._transport = transport
        self.spans = sorted(spans)
        #: Per span, the earlier releases of pages it shares, to finish before it is locked.
        waits = list(after) if after is not None else [[] for _ in self.spans]
        self._starts_array = np.array([start for start, _ in self.spans], np.uint64)
        self._ends_array = np.array([end for _, end in self.spans], np.uint64)
        #: Each span's device address once locked; ``None`` where the driver refused.
        self._futures: list[Future[int | None]] = []
        self._released = False
        #: Device memory each span is copied into once locked (:data:`STAGE_SPANS`), at
        #: ``_offsets[span]``; ``None``: the gathers read the host pages. Allocated on a
        #: thread of its own once the registrations are started (on the H200 the first
        #: allocation of a process took 1.3 ms, which held back the first registration
        #: as long: ``tools/bench/results/gpu/4637b44/ab-stage.txt``). Each registration
        #: waits for it (:attr:`_staging_made`) before queuing its copy.
        self._staging: cuda.Staging | None = None
        self._staging_made = threading.Event()
        sizes = [end - start for start, end in self.spans]
        self._offsets = list(itertools.accumulate(sizes, initial=0))[:-1]
        self._copy_failed = False
        self._copied: bool | None = None  # every span locked and copied (once asked)
        self._copy_lock = threading.Lock()
        #: The ``copy`` route (:data:`PAGES_ROUTE`): chunks still to copy per span,
        #: whether one of a span's failed, and whether the copies are called off.
        self._copy = copy
        self._chunks_left: list[int] = []
        self._chunk_failed: list[bool] = []
        self._cancelled = False
        self._chunks_lock = threading.Lock()
        if inline:  # locked here, now (a staging thread's own small gather)
            self._make_staging(stage)
            for number, (span, wait) in enumerate(zip(self.spans, waits, strict=True)):
                self._futures.append(Future())
                self._futures[-1].set_result(self._lock_and_copy(number, span, wait))
            return
        if not self.spans:
            self._staging_made.set()
            return
        if copy:
            self._start_copies()
            return
        _hurry(+1)
        for number, (span, wait) in enumerate(zip(self.spans, waits, strict=True)):
            self._futures.append(_register_pool().submit(self._lock_and_copy, number, span, wait))
        _hurry_back_after(self._futures)
        # On a thread of its own: the allocation waits on the driver behind the first
        # registrations at times (H200: 0.4-6.3 ms of the restore's own thread,
        # tools/bench/results/gpu/d1643e2/), and nothing reads it before a gather.
        _ALLOCATE_POOL.get().submit(self._make_staging, stage)

    def _make_staging(self, stage: bool | None) -> None:
        try:
            self._staging = _staging(self._transport, self.spans, stage)
        finally:  # the registrations must not wait forever, whatever happened
            self._staging_made.set()

    def _start_copies(self) -> None:
        """Each span copied to the device a chunk at a time on the staging threads,
        through their slots (the ``copy`` route); a span's future is done when its
        last chunk is."""
        _hurry(+1)
        _ALLOCATE_POOL.get().submit(self._make_staging, True)
        parts = [_chunks(start, end) for start, end in self.spans]
        self._chunks_left = [len(chunks) for chunks in parts]
        self._chunk_failed = [False] * len(parts)
        self._futures = [Future() for _ in parts]
        _hurry_back_after(self._futures)
        workers = cuda.pool()
        for number, chunks in enumerate(parts):
            for start, nbytes in chunks:
                workers.submit(self._copy_chunk, number, start, nbytes)

    def _copy_chunk(self, number: int, start: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``start`` (in span ``number``) into its place in the
        device memory, through a staging slot: mapped in, copied into the slot by this
        core, and from there by the copy engine."""
        ok = False
        try:
            if not self._cancelled:
                with cuda.borrowed_slot(nbytes) as slot:
                    _populate(start, nbytes)
                    np.copyto(slot.array[:nbytes], _host_bytes(start, nbytes))
                    self._staging_made.wait()
                    if self._staging is not None:
                        offset = self._offsets[number] + start - self.spans[number][0]
                        self._staging.copy_now(offset, int(slot.array.ctypes.data), nbytes)
                        ok = True
        except (OSError, RuntimeError):
            ok = False
        finally:
            with self._chunks_lock:
                self._chunk_failed[number] |= not ok
                self._chunks_left[number] -= 1
                last = not self._chunks_left[number]
            if last:
                failed = self._chunk_failed[number] or self._staging is None
                self._futures[number].set_result(None if failed else self._staging_address())

    def _staging_address(self) -> int:
        assert self._staging is not None
        return self._staging.address

    @property
    def staged(self) -> bool:
        """Whether the spans are copied to the device as they are locked."""
        self._staging_made.wait()
        return self._staging is not None

    def _lock_and_copy(
        self, number: int, span: tuple[int, int], after: Sequence[Future[None]]
    ) -> int | None:
        """Lock span ``number`` (:func:`_lock_after`) and queue its copy to the device."""
        base = _lock_after(self._transport, span, after)
        self._staging_made.wait()
        if base is not None and self._staging is not None:
            try:
                self._staging.copy(self._offsets[number], span[0], span[1] - span[0])
            except (OSError, RuntimeError):
                self._copy_failed = True  # the gathers then stage the plain way
        return base

    def spans_holding(self, addresses: np.ndarray, nbytes: np.ndarray) -> np.ndarray | None:
        """Which span holds each of host ``addresses`` (uint64; ``nbytes`` from each);
        ``None`` when one lies outside every span, or once released. Waits for nothing."""
        if self._released:
            return None
        at = np.searchsorted(self._starts_array, addresses, side="right") - 1
        if len(at) and (at.min() < 0 or np.any(addresses + nbytes > self._ends_array[at])):
            return None
        return at

    def shift(self, span: int) -> int | None:
        """What turns a host address in span ``span`` into the GPU's (modulo 2**64, for
        uint64 sums), once that span is locked (waits for it); ``None`` for a span the
        driver refused."""
        base = self._futures[span].result()
        if base is None:
            return None
        if self._staging is None:
            return (base - self.spans[span][0]) % (1 << 64)
        if not self._all_copied():
            return None
        return (self._staging.address + self._offsets[span] - self.spans[span][0]) % (1 << 64)

    def _all_copied(self) -> bool:
        """Whether every span is locked and its copy on the device done (waits for them,
        once: one gather reads them all)."""
        with self._copy_lock:
            if self._copied is None:
                locked = all(f.result() is not None for f in self._futures)
                copied = locked and not self._copy_failed
                if copied:
                    try:
                        assert self._staging is not None
                        self._staging.wait()
                    except (OSError, RuntimeError):
                        copied = False
                self._copied = copied
            return self._copied

    def release(self) -> None:
        """Let the pages go, on a staging thread (after their registrations finish),
        :data:`RELEASE_DELAY_SECONDS` from now, or sooner when a restore needs them
        (:func:`_pinned`) or :func:`settle` asks."""
        if self._released:
            return
        self._released = True
        if self._copy:  # nothing locked: the copies called off, waited for, memory back
            self._cancelled = True
            for future in self._futures:
                future.result()
            self._staging_made.wait()
            if self._staging is not None:
                self._staging.free()
            return
        self._staging_made.wait()
        if self._staging is not None:
            _free_after(self._staging, self._futures)

        def let_go() -> None:
            try:
                for span, future in zip(self.spans, self._futures, strict=True):
                    if future.result() is not None:
                        self._transport.unregister(span[0])
            finally:  # a refused unregistration must not keep the pages held forever
                with _LOCK:
                    for span in self.spans:  # one each: a later gather may hold it too
                        if span in _HELD:
                            _HELD.remove(span)

        _let_go_later(self.spans, let_go, RELEASE_DELAY_SECONDS)


def _free_after(staging: cuda.Staging, registrations: Sequence[Future[int | None]]) -> None:
    """Give ``staging`` back once no registration can queue a copy into it any more: now
    when all are done (a restore's gathers waited for them), else when the last is (a
    restore that stopped early does not wait for them)."""
    pending = [future for future in registrations if not future.done()]
    if not pending:
        staging.free()
        return
    left, lock = [len(pending)], threading.Lock()

    def one_done(_: Future[int | None]) -> None:
        with lock:
            left[0] -= 1
            last = not left[0]
        if last:
            staging.free()

    for future in pending:  # a future done meanwhile runs its callback at once
        future.add_done_callback(one_done)


def _staging(
    transport: cuda.Transport, spans: Sequence[tuple[int, int]], stage: bool | None
) -> cuda.Staging | None:
    """Device memory for ``spans``' bytes (``stage``, by default :data:`STAGE_SPANS`),
    where the device has room for them and the arrays gathered from them
    (:func:`_room_for_twice`)."""
    nbytes = sum(end - start for start, end in spans)
    if not (STAGE_SPANS if stage is None else stage) or not nbytes or not _room_for_twice(nbytes):
        return None
    return transport.staging(nbytes)


def _chunks(start: int, end: int) -> list[tuple[int, int]]:
    """``[start, end)`` (page-aligned) cut into about equal page-aligned chunks of at
    most :data:`COPY_CHUNK_BYTES`: ``(start, nbytes)`` each."""
    count = -(-(end - start) // COPY_CHUNK_BYTES)
    size = -(-(end - start) // count // _PAGE) * _PAGE if count else 0
    return [(at, min(size, end - at)) for at in range(start, end, size)] if size else []


def _host_bytes(start: int, nbytes: int) -> np.ndarray:
    """The ``nbytes`` of host memory at ``start``, as a numpy view (no copy)."""
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(start))


#: ``madvise(2)``'s advice that maps a range's pages in, read (Linux 5.14 and later).
_MADV_POPULATE_READ = 22
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _populate(start: int, nbytes: int) -> None:
    """Map the pages of ``[start, start + nbytes)`` in at once, before a copy reads them
    (a fault per few pages otherwise: ~2 GB/s a thread over fresh pages on the H200).
    Where the kernel cannot, the copy faults them in itself."""
    if _LIBC is not None:
        first = start - start % _PAGE
        _LIBC.madvise(
            ctypes.c_void_p(first), ctypes.c_size_t(start + nbytes - first), _MADV_POPULATE_READ
        )


def _lock_after(
    transport: cuda.Transport, span: tuple[int, int], after: Sequence[Future[None]]
) -> int | None:
    """:func:`_lock`, once the releases ``after`` (of pages ``span`` shares) are done.
    They were submitted to the same threads before this, so they run first."""
    for release in after:
        try:
            release.result()
        except Exception:  # noqa: BLE001 - its pages are let go of either way; if the
            pass  # driver still holds them, this registration is refused and says so
    return _lock(transport, span)


def _lock(transport: cuda.Transport, span: tuple[int, int]) -> int | None:
    """Page-lock ``span``: the device address of its start; ``None`` when the driver
    refuses."""
    try:
        return transport.register(span[0], span[1] - span[0])
    except (OSError, RuntimeError):
        return None


_HURRY_LOCK = threading.Lock()
#: Pinned pages with registrations still running, and the switch interval before them.
_HURRIED = [0]
_SAVED_INTERVAL = [0.0]


def _hurry(step: int) -> None:
    """One more (``+1``) or one fewer (``-1``) set of registrations running: the GIL
    switch interval is :data:`SWITCH_SECONDS` while any are, and back to what it was
    after the last."""
    with _HURRY_LOCK:
        if step > 0 and not _HURRIED[0]:
            _SAVED_INTERVAL[0] = sys.getswitchinterval()
            sys.setswitchinterval(min(_SAVED_INTERVAL[0], SWITCH_SECONDS))
        _HURRIED[0] += step
        if step < 0 and not _HURRIED[0]:
            sys.setswitchinterval(_SAVED_INTERVAL[0])


def _hurry_back_after(futures: Sequence[Future[int | None]]) -> None:
    """``_hurry(-1)`` once every one of ``futures`` (the registrations or copies a
    ``_hurry(+1)`` was for) is done."""
    if not futures:
        _hurry(-1)
        return
    left = [len(futures)]

    def one_done(_: Future[int | None]) -> None:
        with _HURRY_LOCK:
            left[0] -= 1
            last = not left[0]
        if last:
            _hurry(-1)

    for future in futures:  # one done already runs its callback at once
        future.add_done_callback(one_done)


def pin(buffers: Sequence[Any]) -> PinnedPages | None:
    """Start page-locking the memory of ``buffers`` (a read's record views) for the GPU
    to gather from; ``None`` (nothing done) when too few bytes, no gather route here,
    or pages another gather holds."""
    # The route first: a process's first restore of any size starts the try of a gather
    # (a restore of one small block, a session's warm-up, then leaves it done).
    if not _route() or sum(memoryview(b).nbytes for b in buffers) < GATHER_MIN_BYTES:
        return None
    ranges = []
    for buffer in buffers:
        view = np.frombuffer(buffer, np.uint8)
        if view.size:
            ranges.append((int(view.ctypes.data), int(view.ctypes.data) + view.size))
    spans = _spans(ranges)
    if _copying(spans):
        return PinnedPages(cuda.transport(), spans, copy=True)
    return _pinned(spans)


def _copying(spans: Sequence[tuple[int, int]]) -> bool:
    """Whether ``spans`` go the ``copy`` route (:data:`PAGES_ROUTE`): it is asked for,
    the staging slots are made (else their making starts now, for a later restore), and
    the device has room for the rows twice (the copies' memory, then the arrays)."""
    if PAGES_ROUTE != "copy" or not STAGE_SPANS:
        return False
    if not cuda.slots_ready():
        cuda.prepare_slots_later()
        return False
    return _room_for_twice(sum(end - start for start, end in spans))


def _pinned(
    spans: list[tuple[int, int]], *, inline: bool = False, stage: bool | None = None
) -> PinnedPages | None:
    """Pages ``spans`` pinned (or being pinned) for this gather; ``None`` when another
    gather holds some of them. Pages an earlier gather holds only until its delayed
    release are not waited for here: that release starts now, and each span sharing
    its pages is locked, on its staging thread, once it is done (a restore of the same
    prefix right after another, as a session's warm-up and then its first restore, no
    longer holds its own thread for the driver's unregistration: ~7 ms on the H200,
    ``results/gpu/c98ebeb/restore-profile.txt``)."""
    ordered = sorted(spans)
    for attempt in range(2):
        with _LOCK:
            leaving = [(number, release.spans) for number, release in _RELEASES.items()]
            blocked = _overlaps(ordered, _staying(leaving))
            if not blocked:
                waits = [
                    [number for number, gone in leaving if _shares(span, gone)] for span in ordered
                ]
                _HELD.extend(ordered)
                _HELD.sort()
        if not blocked:
            started = {number: _start_release(number) for number in set().union(*waits)}
            after = [[f for number in wait if (f := started[number]) is not None] for wait in waits]
            return PinnedPages(cuda.transport(), ordered, inline=inline, after=after, stage=stage)
        if attempt or inline:
            break
        settle()  # an earlier gather's pages, being let go: wait, and look again
    return None  # another thread's gather holds some of these pages


def _staying(leaving: Sequence[tuple[int, list[tuple[int, int]]]]) -> list[tuple[int, int]]:
    """The spans registered now less those of ``leaving`` releases (under _LOCK): the
    pages live gathers hold, sorted and disjoint."""
    going = Counter(span for _, gone in leaving for span in gone)
    staying = []
    for span in _HELD:
        if going[span]:
            going[span] -= 1
        else:
            staying.append(span)
    return staying


def _shares(span: tuple[int, int], others: Sequence[tuple[int, int]]) -> bool:
    """Whether ``span`` shares a page with any of ``others``."""
    return any(start < span[1] and span[0] < end for start, end in others)


def _overlaps(spans: Sequence[tuple[int, int]], held: Sequence[tuple[int, int]]) -> bool:
    """Whether any of ``spans`` shares a page with one of ``held`` (sorted, disjoint)."""
    for start, end in spans:
        at = bisect.bisect_left(held, (start, start))
        if at < len(held) and held[at][0] < end:
            return True  # one starting inside
        if at and held[at - 1][1] > start:
            return True  # the one before reaching into it
    return False


def gathered(
    specs: Sequence[cuda.LeafSpec],
    pieces: Sequence[Sequence[np.ndarray] | gather_tables.RowsLayout],
    pages: PinnedPages | None = None,
    *,
    one_buffer: bool = False,
    lazy: bool = False,
) -> list[mx.array] | None:
    """Evaluated device arrays of ``specs``, array ``i`` the rows of ``pieces[i]`` joined
    (zeros past them; host arrays, or a
    :func:`~kvstore.codecs.gather_tables.stored_layout` of rows in ``pages``), read by
    the GPU out of the pieces' own pages; ``None`` (nothing
    done) when that cannot be: too few bytes, pieces not laid out for it, pages some
    other gather holds, or a registration the driver refuses.

    Args:
        pages: the pieces' pages, pinned already (:func:`pin`); else they are pinned
            here, and let go after.
        one_buffer: every array a view into one output (for arrays a restore decodes
            and drops: a lossy restore's 192 joined tensors took 40 ms as a kernel each
            on an H200), made by one gather, or, rows in several spans, by a gather per
            group of spans as they are locked and one assemble of them all; else each
            array a buffer of its own, launched as soon as its pages are locked.
        lazy: with ``pages``, the arrays unevaluated, for the caller to evaluate with
            what it computes from them (a lossy restore's decode): one evaluation, and
            one CUDA graph, instead of two. It lets ``pages`` go only after that.

    The pieces' memory must stay mapped until this returns (``lazy``: until the arrays
    are evaluated).
    """
    if one_buffer:
        flat = gathered_flat(specs, pieces, pages, lazy=lazy)
        return None if flat is None else views_in(flat, specs)
    if not specs or sum(map(cuda.nbytes_of, specs)) < GATHER_MIN_BYTES or not proven():
        return None
    return _gather(specs, pieces, pages, lazy=lazy and pages is not None)


def gathered_flat(
    specs: Sequence[cuda.LeafSpec],
    pieces: Sequence[Sequence[np.ndarray] | gather_tables.RowsLayout] | np.ndarray,
    pages: PinnedPages | None = None,
    *,
    lazy: bool = False,
) -> mx.array | None:
    """:func:`gathered` with ``one_buffer``, as the one uint8 device array that holds
    every array of ``specs``, each at its :func:`buffer_starts` (:func:`views_in` cuts
    them; :func:`~kvstore.codecs.one_buffer.stacked_view` takes a run of them as one
    array). ``pieces`` may be their segment table, made already
    (:func:`~kvstore.codecs.gather_tables.alike_table`; with ``pages``)."""
    if not specs or sum(map(cuda.nbytes_of, specs)) < GATHER_MIN_BYTES or not proven():
        return None
    made = _gather(specs, pieces, pages, one_buffer=True, lazy=lazy and pages is not None)
    return None if made is None else made[0]


def _gather(
    specs: Sequence[cuda.LeafSpec],
    pieces: Sequence[Sequence[np.ndarray] | gather_tables.RowsLayout] | np.ndarray,
    pages: PinnedPages | None,
    *,
    inline: bool = False,
    one_buffer: bool = False,
    stage: bool | None = None,
    lazy: bool = False,
) -> list[mx.array] | None:
    given: np.ndarray | None = None  # a one-buffer gather's segment table, made already
    if isinstance(pieces, np.ndarray):
        if pages is None or not one_buffer:
            return None
        given, pieces, layouts = pieces, [], []
    else:
        found = [
            p
            if isinstance(p, gather_tables.RowsLayout)
            else gather_tables.host_layout(p, shape, name)
            for p, (shape, name) in zip(pieces, specs, strict=True)
        ]
        layouts = [layout for layout in found if layout is not None]
        if len(layouts) < len(found):
            return None
    own = pages is None
    if pages is None:
        if any(isinstance(p, gather_tables.RowsLayout) for p in pieces):
            return None  # described rows are read from pages pinned already
        extents = (
            (int(piece.ctypes.data), int(piece.ctypes.data) + _extent(piece))
            for column in pieces
            if not isinstance(column, gather_tables.RowsLayout)
            for piece in column
            if piece.size
        )
        pages = _pinned(_spans(extents), inline=inline, stage=stage)
        if pages is None:
            return None
    transport = cuda.transport()
    arrays: list[mx.array] = []
    launched: list[mx.array] = []  # kernels that read the pages, evaluated or in flight
    done = False
    try:
        if one_buffer:
            starts = buffer_starts(specs)
            table = given if given is not None else gather_tables.segment_table(layouts, starts)
            on_device = _DeviceTable(table, pages)
            groups = _groups(pages, starts[-1])
            if groups > 1:
                # a group of spans at a time as they are locked, then one join of all
                grouped = _group_buffers(transport, on_device, groups, launched)
                if grouped is None:
                    return None
                buffers, joins = grouped
                flat = transport.assemble(_params(joins), buffers, starts[-1])
            else:
                device = on_device.params()
                if device is None:
                    return None
                flat = transport.gather(device, starts[-1])
            launched.append(flat)
            arrays.append(flat)
        else:
            table, owners = gather_tables.segment_tables(layouts, [0] * len(layouts))
            order = np.argsort(owners, kind="stable")  # each array's segments together
            on_device = _DeviceTable(table[order], pages)
            ends = np.cumsum(np.bincount(owners, minlength=len(specs))).tolist()
            groups = _groups(pages, sum(map(cuda.nbytes_of, specs)))
            if groups > 1:
                # rows gathered a group of pages at a time, then joined
                grouped = _group_buffers(transport, on_device, groups, launched)
                if grouped is None:
                    return None
                buffers, joins = grouped
                for begin, end, spec in zip([0, *ends], ends, specs, strict=False):
                    device = _params(joins[begin:end])
                    array = transport.assemble(device, buffers, cuda.nbytes_of(spec))
                    arrays.append(array.view(MLX_DTYPES[spec[1]]).reshape(spec[0]))
            elif pages.staged:  # every row on the device already: few kernels make them all
                made = _gather_many(transport, on_device, owners[order], ends, specs)
                if made is None:
                    return None
                launched.extend(made)
                for array, spec in zip(made, specs, strict=True):
                    arrays.append(array.view(MLX_DTYPES[spec[1]]).reshape(spec[0]))
            else:
                for begin, end, spec in zip([0, *ends], ends, specs, strict=False):
                    device = on_device.params(begin, end)
                    if device is None:
                        return None
                    array = transport.gather(device, cuda.nbytes_of(spec))
                    mx.async_eval(array)  # evaluated one by one as their pages are locked
                    launched.append(array)
                    arrays.append(array.view(MLX_DTYPES[spec[1]]).reshape(spec[0]))
        if not lazy:
            mx.eval(arrays)
        done = True
    finally:
        if not done and launched:
            mx.eval(launched)  # kernels in flight read the pages: let them finish first
        if own:  # the kernels have read every byte: let go off the restore's path
            pages.release()
    return arrays


def _gather_many(
    transport: cuda.Transport,
    on_device: _DeviceTable,
    owners: np.ndarray,
    ends: Sequence[int],
    specs: Sequence[cuda.LeafSpec],
) -> list[mx.array] | None:
    """The uint8 arrays of ``specs``, :data:`~kvstore.codecs.cuda.GATHER_OUTPUTS` to a
    kernel (:meth:`~kvstore.codecs.cuda.Transport.gather_many`); ``on_device``'s
    segments in array order, ``owners`` the array each writes, ``ends`` where each
    array's segments end. ``None`` where a span's pages were refused."""
    made: list[mx.array] = []
    begins = [0, *ends]
    for first in range(0, len(specs), cuda.GATHER_OUTPUTS):
        last = min(first + cuda.GATHER_OUTPUTS, len(specs))
        sizes = [cuda.nbytes_of(spec) for spec in specs[first:last]]
        table = on_device.rows(slice(begins[first], ends[last - 1]))
        if table is None:
            return None
        if not len(table):  # arrays of no bytes
            made.extend(mx.zeros((n,), mx.uint8) for n in sizes)
            continue
        table = table.copy()
        output = owners[begins[first] : ends[last - 1]].astype(np.uint64) - np.uint64(first)
        table[:, 2] |= output << np.uint64(cuda.OUTPUT_OFFSET_BITS)
        made.extend(transport.gather_many(_params(table), sizes))
    return made


class _DeviceTable:
    """Segments ``table`` with each host address turned into the GPU's, a slice at a
    time (:meth:`params`, :meth:`rows`), each waiting only for the spans its rows lie
    in. The numpy work is done once per span, not per slice (64 slices in a lossless
    restore)."""

    def __init__(self, table: np.ndarray, pages: PinnedPages) -> None:
        self.pages = pages
        self.table = table
        self.device = table.copy()
        reads = np.flatnonzero(table[:, 0])  # the rest write zeros
        src = table[reads, 0]
        extent = (table[reads, 5] - 1) * table[reads, 1] + table[reads, 4]
        at = pages.spans_holding(src, extent)
        self.inside = at is not None
        #: Each segment's span; -1 for one writing zeros.
        self.span_of = np.full(len(table), -1, np.intp)
        self._rows: dict[int, np.ndarray] = {}  # each span's reading segments
        if at is not None:
            self.span_of[reads] = at
            order = np.argsort(at, kind="stable")
            held, firsts = np.unique(at[order], return_index=True)
            for span, rows in zip(held.tolist(), np.split(reads[order], firsts[1:]), strict=True):
                self._rows[span] = rows
        self._locked: set[int] = {-1}

    def rows(self, which: np.ndarray | slice) -> np.ndarray | None:
        """Segments ``which`` with their GPU addresses, once the pages they read are
        locked; ``None`` for rows outside the pinned pages, or pages the driver
        refused."""
        if not self.inside:
            return None
        for span in sorted(set(self.span_of[which].tolist()) - self._locked):  # locking order
            shift = self.pages.shift(span)
            if shift is None:
                return None
            self.device[self._rows[span], 0] += np.uint64(shift)
            self._locked.add(span)
        return self.device[which]

    def params(self, begin: int = 0, end: int | None = None) -> np.ndarray | None:
        """The kernel's parameters for segments ``[begin, end)`` (:meth:`rows`)."""
        table = self.rows(slice(begin, end))
        return None if table is None else _params(table)


def _groups(pages: PinnedPages, nbytes: int) -> int:
    """The groups of spans a gather of ``nbytes`` from ``pages`` crosses in
    (:func:`_group_buffers`): up to :data:`GATHER_GROUPS`, one per span at most; 1 (a
    gather straight into the arrays) for one span, or where the device has no room for
    the rows twice (:func:`_room_for_twice`)."""
    if pages.staged:  # the rows are on the device already: one gather reads them there
        return 1
    groups = min(GATHER_GROUPS, len(pages.spans))
    return groups if groups > 1 and _room_for_twice(nbytes) else 1


def _room_for_twice(nbytes: int) -> bool:
    """Whether the device has room for ``nbytes`` of arrays twice over, as a gather in
    groups needs for a moment (the group buffers, then the arrays joined from them):
    within MLX's memory limit (on CUDA 0.8 of the device's) with what is allocated now;
    a backend that reports no limit (0) has room. Else a gather per array."""
    limit = mx.get_memory_limit()
    return not limit or mx.get_active_memory() + 2 * nbytes <= limit


def _params(table: np.ndarray) -> np.ndarray:
    """A segments kernel's parameters: the count, then the segments' words."""
    return np.concatenate([np.array([len(table)], np.uint64), table.ravel()])


def _group_buffers(
    transport: cuda.Transport, on_device: _DeviceTable, groups: int, launched: list[mx.array]
) -> tuple[list[mx.array], np.ndarray] | None:
    """The rows ``on_device``'s segments read, gathered into ``groups`` device buffers,
    one per run of spans (in locking order), each launched once its spans are locked;
    and the segments (``on_device``'s, in its order) that join them from there into the
    arrays. ``None``: rows outside the pinned pages, or pages the driver refused.

    A gather per array must wait for every span (each array has rows in every
    record), so the GPU sits idle until the last page is locked. Here the first groups
    cross the bus while later spans are still being locked (on
    :data:`REGISTER_THREADS_DEFAULT` threads, in address order, the spans are locked a
    few at a time), and the join is a copy within the device, at its memory's speed.
    For that moment the rows are on the device twice (512 MiB more for 4096 tokens of
    llama-8B)."""
    table = on_device.table
    width, height = table[:, 4], table[:, 5]
    pitch = -(-width // 16) * 16  # each run at a 16-byte boundary: the kernel's fast path
    sizes = pitch * height
    spans = len(on_device.pages.spans)
    group_of = np.where(on_device.span_of >= 0, on_device.span_of * groups // spans, -1)
    joins = table.copy()
    buffers = []
    for group in range(groups):
        which = np.flatnonzero(group_of == group)
        if not len(which):  # no rows in these spans: a buffer no join reads
            buffers.append(mx.zeros((16,), mx.uint8))
            continue
        gathered = on_device.rows(which)
        if gathered is None:
            return None
        offsets = np.concatenate([np.zeros(1, np.uint64), np.cumsum(sizes[which])])
        gathered = gathered.copy()
        gathered[:, 2] = offsets[:-1]
        gathered[:, 3] = np.where(height[which] > 1, pitch[which], 0)
        buffer = transport.gather(_params(gathered), max(16, int(offsets[-1])))
        mx.async_eval(buffer)  # crosses the bus while later groups' pages are being locked
        launched.append(buffer)
        buffers.append(buffer)
        joins[which, 0] = offsets[:-1] + np.uint64((group + 1) << cuda.ASSEMBLE_OFFSET_BITS)
        joins[which, 1] = gathered[:, 3]
    return buffers, joins


_WORKS: bool | None = None
#: Whether the try's joins on the device (:func:`_try_device_joins`) passed.
_JOINS_WORK: bool | None = None
_WORKS_FUTURE: Future[bool] | None = None
_TRY_LOCK = threading.Lock()


def _route() -> bool:
    """Whether gathers may be tried here: staging works and the once-per-process try of
    a gather (:func:`_works`) has not failed. The try starts in the background, so that
    a fresh process's first restore does not wait for the kernel to load (nor, later,
    for the registration threads to start)."""
    global _WORKS_FUTURE
    if not cuda.available() or _WORKS is False:
        return False
    with _LOCK:
        if _WORKS is None and _WORKS_FUTURE is None:
            _WORKS_FUTURE = cuda.pool().submit(_works)
    _register_pool()
    _ALLOCATE_POOL.get()
    return True


#: The thread that allocates a gather's device memory (:meth:`PinnedPages._make_staging`).
_ALLOCATE_POOL = KeptPool("kvstore-cuda-allocate", lambda: 1)


def _register_pool() -> ThreadPoolExecutor:
    """The threads that lock pages (:func:`register_threads`), in submission order;
    kept for the process."""
    return _REGISTER_POOL.get()


def register_threads() -> int:
    """The threads that lock a restore's pages (:data:`REGISTER_THREADS_DEFAULT`,
    ``KVSTORE_CUDA_REGISTER_THREADS``): the cores a big restore on a CUDA GPU keeps busy
    besides its own thread and the checks."""
    return count_from_env("KVSTORE_CUDA_REGISTER_THREADS", REGISTER_THREADS_DEFAULT)


_REGISTER_POOL = KeptPool("kvstore-cuda-register", register_threads)


def proven() -> bool:
    """Whether the try of a gather here (:func:`_works`) is done and passed; starts it
    in the background when it has not run. A restore does not wait for it (the first
    load of its kernel on a machine compiles it, about a second): it stages as before."""
    return _route() and _WORKS is True  # _WORKS is set once the try is done


def joins_proven() -> bool:
    """Whether the same try also joined rows on the device right
    (:mod:`~kvstore.codecs.device_joins`); a failure there leaves the gathers on, and
    those joins are then made by a concatenation each."""
    return proven() and _JOINS_WORK is True


def trial_done() -> bool:
    """Wait for this process's one trial of a gather, if a restore has started it: whether
    the route passed (``False`` also where none was started, or none can be here).

    A session's warm-up (one small restore starts the trial in the background) calls
    this so that its first big restore takes the route rather than racing the trial."""
    future = _WORKS_FUTURE
    if future is None:
        return _WORKS is True
    return bool(future.result())


def _works() -> bool:
    """Whether a gather here returns the bytes it was asked for (its kernel compiles and
    reads registered pages), tried once per process on a few pages of its own."""
    global _WORKS, _JOINS_WORK
    if _WORKS is None:
        with _TRY_LOCK:
            if _WORKS is None:
                _JOINS_WORK = _try_device_joins()  # set before _WORKS says the try is done
                _WORKS = _try_a_gather()
    return _WORKS


def _try_a_gather() -> bool:
    """Both routes (spans copied to the device, and rows read from the host pages in
    groups) on two maps of pages: two spans, as a big restore's (the gather and assemble
    kernels load here, off its path). Each route's maps stay mapped until both have
    run: a second route on pages of the first (mapped anew at the same addresses)
    would wait for their release, queued behind this try on the staging threads."""
    kept: list[mmap.mmap] = []
    return all(_try_a_gather_by(stage, kept) for stage in dict.fromkeys([STAGE_SPANS, False]))


def _try_device_joins() -> bool:
    """Three arrays joined from pieces in three device buffers by one kernel
    (:func:`~kvstore.codecs.device_joins.joined`): one padded with zeros, one of pieces
    from two buffers, one whose rows are not whole 16-byte words."""
    rng = np.random.default_rng(1)
    wholes = [rng.integers(0, 1 << 16, shape, dtype=np.uint16) for shape in _TRIED_WHOLES]
    a, b, c = (mx.array(w) for w in wholes)
    columns = [
        [(a[:1], a, 0)],
        [(a[1:], a, a.nbytes // 2), (b, b, 0)],
        [(c, c, 0)],
    ]
    specs = [((1, 2, 7, 8), "uint16"), ((1, 2, 7, 8), "uint16"), ((1, 2, 6, 3), "uint16")]
    want = [np.zeros(shape, np.uint16) for shape, _ in specs]
    want[0][:, :, :5] = wholes[0][:1]
    want[1][...] = np.concatenate([wholes[0][1:], wholes[1]], axis=2)
    want[2][:, :, :4] = wholes[2]
    try:
        got = device_joins.joined(specs, columns)
        return got is not None and all(
            np.array_equal(np.array(g), w) for g, w in zip(got, want, strict=True)
        )
    except (OSError, RuntimeError, ValueError):
        return False


#: The buffers :func:`_try_device_joins` joins pieces of.
_TRIED_WHOLES = ((2, 2, 5, 8), (1, 2, 2, 8), (1, 2, 4, 3))


def _try_a_gather_by(stage: bool, kept: list[mmap.mmap]) -> bool:
    rng = np.random.default_rng(0)
    shape = (1, 2, 3 * _PAGE // 64, 40)
    nbytes = math.prod(shape) * 2
    maps = [mmap.mmap(-1, -(-nbytes // _PAGE) * _PAGE) for _ in range(2)]
    kept.extend(maps)
    hosts = [np.frombuffer(m, np.uint16, math.prod(shape)).reshape(shape) for m in maps]
    for host in hosts:
        host[...] = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    pieces = [hosts[0][:, :, 1:9], hosts[1][:, :, 20:31], hosts[0][:, :, 40:43]]  # unaligned
    second = [hosts[1][:, :, 50:56]]  # a second array: one kernel makes several
    want = np.zeros((1, 2, 24, 40), np.uint16)
    want[:, :, :22] = np.concatenate(pieces, axis=2)
    specs = [((1, 2, 24, 40), "uint16"), ((1, 2, 6, 40), "uint16")]
    try:
        got = _gather(specs, [pieces, second], None, inline=True, stage=stage)
        return (
            got is not None
            and bool(np.array_equal(np.array(got[0]), want))
            and bool(np.array_equal(np.array(got[1]), second[0]))
        )
    except (OSError, RuntimeError, ValueError):
        return False
    finally:
        del hosts, pieces, second


def _extent(piece: np.ndarray) -> int:
    """Bytes from ``piece``'s first element to the end of its last."""
    return (
        sum((n - 1) * s for n, s in zip(piece.shape, piece.strides, strict=True)) + piece.itemsize
    )


def _spans(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges widened to whole pages, sorted, ones sharing a page merged. Ranges
    that only touch (a restore's records lie back to back in the store's file) stay
    apart, each locked by a call of its own, unless :data:`LOCK_SPANS` joins them."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted((s - s % _PAGE, -(-e // _PAGE) * _PAGE) for s, e in ranges):
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    calls = _lock_calls(merged)
    return _joined_spans(merged, calls) if calls else merged


#: About how many page-locking calls a restore's records are joined into
#: (``KVSTORE_CUDA_LOCK_SPANS``: a number; ``auto``, :func:`_lock_calls`; 0: a call per
#: record; unset: ``auto`` for records under :data:`SMALL_RECORD_BYTES`, else a call per
#: record). On the H200 a fresh process locked 16 records of 32 MiB, back to back, in
#: 16.5 ms as 16 calls on 4 threads and in 10.3 as 4 (9.7 as one); 16 of 8 MiB in 6.0
#: against 4.1 (``tools/bench/results/gpu/cb892dd/register-probe.txt``). In whole
#: fresh-process restores (``0045756/``) ``auto`` took q8's (17 MiB records) from 26.9 to
#: 22.5 ms and TurboQuant 4/4's (8.3 MiB) from 27.4 to 25.4, but lossless (32 MiB) from
#: 29.4 to 31.0: a large record's call costs little beside its pages.
LOCK_SPANS = choice_from_env("KVSTORE_CUDA_LOCK_SPANS", ("auto",), "", counting="calls")

#: What a page-locking call costs the driver whatever its size, and how fast a locked
#: span crosses to the device (H200: ``cb892dd/register-probe.txt``, ``probe.json``).
_CALL_SECONDS, _COPY_BYTES_PER_SECOND = 0.45e-3, 51e9

#: Records smaller than this on average are joined into ``auto``'s calls by default.
SMALL_RECORD_BYTES = 24 << 20


def _lock_calls(spans: Sequence[tuple[int, int]]) -> int:
    """The calls to lock the records' ``spans`` in (0: one per record). ``auto``: the
    count that makes the calls' own cost (``n`` of :data:`_CALL_SECONDS`) and the last
    span's copy, which starts only when its call ends (``bytes / n`` at
    :data:`_COPY_BYTES_PER_SECOND`), least: ``n = sqrt(bytes / (call * rate))``, 5 for
    512 MiB, 10 for 2 GiB, 2 for 133 MiB. Unset: ``auto`` for records averaging under
    :data:`SMALL_RECORD_BYTES`, else one call per record."""
    if LOCK_SPANS not in ("", "auto"):
        return int(LOCK_SPANS)
    nbytes = sum(end - start for start, end in spans)
    if not LOCK_SPANS and (not spans or nbytes >= SMALL_RECORD_BYTES * len(spans)):
        return 0
    return max(1, round(math.sqrt(nbytes / (_CALL_SECONDS * _COPY_BYTES_PER_SECOND))))


def _joined_spans(spans: list[tuple[int, int]], most: int) -> list[tuple[int, int]]:
    """Sorted disjoint ``spans``, those that touch joined into ``most`` groups of about
    equal bytes (each span in the group its middle byte falls in; more groups where they
    do not touch)."""
    if len(spans) <= most:
        return spans
    share = sum(end - start for start, end in spans) / most
    joined: list[tuple[int, int]] = []
    before, last_group = 0, -1
    for start, end in spans:
        group = min(most - 1, int((before + (end - start) / 2) / share))
        if joined and group == last_group and start == joined[-1][1]:
            joined[-1] = (joined[-1][0], end)
        else:
            joined.append((start, end))
        before, last_group = before + end - start, group
    return joined


@dataclass
class _Release:
    """An earlier gather's pages on their way out: its spans, what lets them go, and
    the future of that once started (``None`` while it waits for its delay)."""

    spans: list[tuple[int, int]]
    let_go: Callable[[], None]
    future: Future[None] | None = None


#: Releases not finished, by number (:func:`_let_go_later`).
_RELEASES: dict[int, _Release] = {}
_NUMBERS = itertools.count()


def _let_go_later(spans: list[tuple[int, int]], let_go: Callable[[], None], delay: float) -> None:
    """Run ``let_go`` (which lets ``spans`` go) on a staging thread ``delay`` seconds
    from now (at once for 0)."""
    number = next(_NUMBERS)
    with _LOCK:
        _RELEASES[number] = _Release(list(spans), let_go)
    if delay <= 0:
        _start_release(number)
        return
    timer = threading.Timer(delay, _start_release, (number,))
    timer.daemon = True
    timer.start()


def _start_release(number: int) -> Future[None] | None:
    """Start release ``number`` now, if it waits: its future; ``None`` when it is done
    (or the interpreter is exiting: the process lets go of everything)."""
    with _LOCK:
        release = _RELEASES.get(number)
        if release is None:
            return None
        if release.future is None:
            try:
                release.future = cuda.pool().submit(_run_release, number, release.let_go)
            except RuntimeError:  # the interpreter is exiting
                return None
        return release.future


def _run_release(number: int, let_go: Callable[[], None]) -> None:
    try:
        let_go()
    finally:
        with _LOCK:
            _RELEASES.pop(number, None)


def settle() -> None:
    """Let go at once of every page an earlier gather registered, and wait until they
    are (each gather's are let go on a staging thread, :data:`RELEASE_DELAY_SECONDS`
    after it returns)."""
    with _LOCK:
        numbers = list(_RELEASES)
    for future in [_start_release(number) for number in numbers]:
        if future is not None:
            future.result()
