"""Fresh MLX arrays filled in place by the caller: one write per byte, no zero fill.

MLX has no uninitialised allocation: ``mx.zeros`` (and ``mx.empty``) write
every byte before the caller can write the real ones, a second pass over
the memory of a restore. MLX's safetensors loader does allocate without
initialising: ``mx.load(file_like, format="safetensors")`` allocates each
tensor the header describes and asks the file object to ``readinto`` it.
So :func:`filled_arrays` hands MLX a *virtual* safetensors file
(:class:`LeafStream`) whose header describes a few flat buffers and whose
``readinto`` writes nothing: the buffers come back allocated, the arrays are cut
from them as views (the loader costs ~70 us per array it allocates), and the
caller then writes every one of them through a numpy view of its memory, all at
once on every core (:func:`~kvstore.codecs.copies.each_on_threads`). Writing each inside
its ``readinto`` cost a thread switch and a GIL hand-off per array on MLX's I/O
threads, which read one array at a time: 64 arrays of a 512-token llama-8B
restore took 25.9 ms that way and 17.8 ms written afterwards on 2 cores.

MLX reads on its own I/O threads (``PyFileReader.read(data, n, offset)``:
a seek and a ``readinto`` under one GIL hold), and the arrays are evaluated
before ``mx.load`` returns. The stream therefore keeps a position per
thread, and records every failure rather than raising it into MLX (whose
I/O task would drop the exception). An array is handed out only once every
byte of it was written: when MLX reads in a pattern the stream does not serve,
or a write fails, the arrays are discarded and made again the plain way.

The plain way, and the way for restores under :data:`DIRECT_MIN_BYTES`, where the
loader's cost is more than the copies: each array written into a host
buffer and copied once into MLX's memory (``mx.array``). The buffer is the same freed
block of the heap for every array (``keep_freed_memory``), so it is written and read
back in the CPU's cache: 48 arrays of 128 KiB (a 512-token qwen-0.5B restore) in
0.74 ms, against 1.45 zero-filled by ``mx.zeros`` and then written, and 1.69 through
the loader.
"""

from __future__ import annotations

import json
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import BinaryIO, Protocol, cast

import mlx.core as mx
import numpy as np

from kvstore.codecs import cuda
from kvstore.codecs.arrays import as_mlx, numpy_dtype, word_dtype
from kvstore.codecs.copies import each_on_threads
from kvstore.codecs.host_memory import HUGE_PAGES, advise_huge_pages, keep_freed_memory
from kvstore.codecs.one_buffer import buffer_starts, host_views_in, padded_nbytes, views_in
from kvstore.knobs import mib_from_env
from kvstore.threads import keep_thread_state

__all__ = [
    "ALIGN_BYTES",
    "BUFFER_MAX_BYTES",
    "DIRECT_MIN_BYTES",
    "LeafSpec",
    "Fill",
    "LeafStream",
    "Units",
    "common_alignment",
    "filled_arrays",
]

#: Below this many bytes in all, writing each array into a host buffer and copying it
#: into MLX's memory costs less than the loader's allocation, which then writes on
#: every core (2-core x86 CPU, arrays written from two to 32 row pieces each,
#: ``python -m tools.bench.fill_paths`` with the loader's few buffers: 6 MiB in 48 arrays
#: 0.77 ms copied against 1.69 through the loader, 24 MiB 2.43 against 3.06; 64 MiB in
#: 64 arrays 6.52 against 5.05, 256 MiB in 64 24.0 against 15.8). A whole restore, with
#: its checks hashing beside, crosses sooner (``tools.bench.restore_python --cpu-route``,
#: qwen-0.5B: 2048 tokens, 24 MiB, 8.1-8.7 ms copied against 6.2-6.8 through the loader;
#: 512 tokens, 6 MiB, a tie at 3.1-3.5 ms). With more cores the loader wins sooner still.
DIRECT_MIN_BYTES = 16 << 20

#: The most bytes of arrays the loader allocates as one buffer: an array is a view of
#: its buffer, which lives as long as any of its arrays does (a cache whose first
#: step after a restore replaces its arrays frees its buffer once every cache in it
#: has), so a restore holds at most this much more memory, for a moment, than with a
#: buffer per array.
BUFFER_MAX_BYTES = 64 << 20

#: On the CPU, an array of at least this many bytes gets a buffer of its own from the
#: loader (~70 us more an array on the 2-core CI VM, ~120 before its I/O threads kept
#: their Python states: :func:`kvstore.threads.keep_thread_state`). MLX writes into an
#: array in place only when nothing else shares its buffer, so a cache's first step
#: after a restore copies an array cut from a shared one whole, on one core, to write
#: one token into its room (``python -m tools.bench.first_step``, restore + that step):
#: a 2048-token llama-8B restore (64 arrays of 4.5 MiB) 50.3 ms shared (22.5 + 27.7)
#: against 32.6 (31.3 + 1.3) with a buffer each, 8192 tokens 181 against 105. Under 4 MiB
#: the arrays stay together, though with the loader at ~70 us an array a buffer each
#: would shorten the restore and its step there too (``6f7837f``: llama-8B 1024 tokens,
#: 2.25 MiB arrays, 27.6 -> 18.4 ms; 512, 1.5 MiB, 16.8 -> 13.6; qwen-0.5B 8192, 2.1
#: MiB, 22.2 -> 20.8, but 4096 13.0 -> 13.6 and 2048 8.0 -> 10.1): the restore alone
#: would pay 4.7-7.9 ms more (llama-8B 512 tokens 7.8 -> 12.7 ms, P1's bar against
#: mlx-lm's load at ~0.92x -> ~0.6x), and small tensors lose the strided copies of
#: :mod:`~kvstore.codecs.host_alike`. A new process pays far more for that step: it
#: copies into memory the process faults in (D2 with its first step, fresh processes
#: alternated: llama-8B 512 tokens 98 ms restore + step at 4 MiB against 39 at 1 MiB,
#: mlx-lm's load + step 94; qwen-0.5B 8192 104 against 56, mlx-lm 120; gemma-swa 512 83
#: against 35). ``KVSTORE_OWN_BUFFER_MIB`` sets it (1: the first token of a new session
#: on the CPU first, the restore alone after). On a GPU the copy runs at the device's
#: bandwidth and the loader's hand-offs would cost more than it.
OWN_BUFFER_MIN_BYTES = mib_from_env("KVSTORE_OWN_BUFFER_MIB", 4)

#: The arrays of a restore start at the same address modulo this many bytes as the rows
#: copied into them (``align``): on the x86 CI VM a copy of 512 KiB tensors into arrays
#: 16 bytes further on in their 4 KiB page took twice as long (4.3 against 1.8-2.1 ms
#: for 32 MiB), 48, 80, 112... bytes on ~20% longer, the multiples of 32 the fastest.
#: Where MLX's allocator happened to place a 512-token llama-8B restore's buffers so,
#: the restore took 11.8-12.2 ms instead of 10.1-10.4, from one build to the next.
ALIGN_BYTES = 64

#: How long :func:`filled_arrays` waits for MLX to drop its reader (it takes microseconds).
_RELEASE_TIMEOUT_S = 5.0

#: One array to allocate: ``(shape, dtype name)``.
LeafSpec = tuple[tuple[int, ...], str]
#: ``fill(i, view)`` writes every byte of array ``i`` through ``view``, a writable
#: numpy view of its memory (``numpy_dtype(name)``: bfloat16 as tagged words).
Fill = Callable[[int, np.ndarray], None]

#: The safetensors dtype of each MLX dtype an array is allocated as (``word_dtype``).
_SAFETENSORS_DTYPES = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.uint16: "U16",
    mx.uint32: "U32",
    mx.uint64: "U64",
    mx.int8: "I8",
    mx.int16: "I16",
    mx.int32: "I32",
    mx.int64: "I64",
    mx.float16: "F16",
    mx.float32: "F32",
}
# safetensors aligns the data section to 8 bytes by padding the header with spaces.
_HEADER_ALIGN = 8


class LeafStream:
    """A read-only file object that MLX's loader reads as a safetensors file.

    The header lists ``specs`` as tensors ``"0"``, ``"1"``..., each of its
    :func:`~kvstore.codecs.arrays.word_dtype`; a ``readinto`` of tensor ``i``'s
    byte range writes nothing into the buffer MLX allocated for it. After
    ``mx.load`` returned, :attr:`complete` says whether every tensor was read
    exactly once, whole, and nothing failed: only then are the arrays MLX made
    exactly those of ``specs``.

    Args:
        specs: the arrays, in order.
    """

    closed = False

    def __init__(self, specs: Sequence[LeafSpec]) -> None:
        header, offset, self._starts = {}, 0, {}
        for i, spec in enumerate(specs):
            shape, name = spec
            nbytes = cuda.nbytes_of(spec)
            header[str(i)] = {
                "dtype": _SAFETENSORS_DTYPES[word_dtype(name)],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._starts[offset] = (i, nbytes)
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % _HEADER_ALIGN)
        self._head = struct.pack("<Q", len(text)) + text
        self._size = len(self._head) + offset
        self._local = threading.local()
        self._lock = threading.Lock()
        self._read = [False] * len(specs)
        #: What went wrong, if anything (the first problem only).
        self.problem: str | None = None

    @property
    def complete(self) -> bool:
        """True when every array was read once, whole, and no read failed."""
        return self.problem is None and all(self._read)

    # The file protocol MLX's PyFileReader uses: seek, tell, readinto, closed.
    def seek(self, offset: int, whence: int = 0) -> int:
        keep_thread_state()  # MLX's I/O thread keeps its Python state for the next read
        base = (0, self.tell(), self._size)[whence]
        self._local.pos = base + offset
        return int(self._local.pos)

    def tell(self) -> int:
        return int(getattr(self._local, "pos", 0))

    def readinto(self, buffer: memoryview) -> int:
        # Never raise into MLX: its I/O task would drop the error and hand out the array.
        pos, n = self.tell(), len(buffer)
        try:
            if pos < len(self._head):
                n = min(n, len(self._head) - pos)
                buffer[:n] = self._head[pos : pos + n]
            else:
                self._leaf_read(pos - len(self._head), n)
        except Exception as exc:  # recorded; filled_arrays discards the arrays
            self._fail(f"{type(exc).__name__}: {exc}")
        self._local.pos = pos + n
        return n

    def _leaf_read(self, offset: int, n: int) -> None:
        i, nbytes = self._starts.get(offset, (None, 0))
        if i is None or n != nbytes:
            self._fail(f"a read of {n} bytes at data offset {offset} is not one array")
            return
        with self._lock:
            twice, self._read[i] = self._read[i], True
        if twice:
            self._fail(f"array {i} was read twice")

    def _fail(self, problem: str) -> None:
        with self._lock:
            if self.problem is None:
                self.problem = problem


class Units(Protocol):
    """The writes of a restore's arrays cut otherwise than one per array (record by
    record: :mod:`~kvstore.codecs.record_copies`)."""

    #: How many units there are.
    count: int

    def write(self, k: int, targets: Sequence[np.ndarray]) -> None:
        """Unit ``k``: its bytes of ``targets`` (a writable view of every array); the
        units together write every byte, no two the same one."""

    def unused(self) -> None:
        """Called when the arrays are written by ``fill`` instead."""


def filled_arrays(
    specs: Sequence[LeafSpec],
    fill: Fill,
    *,
    direct: bool | None = None,
    units: Units | None = None,
    align: int | None = None,
) -> list[mx.array]:
    """Fresh, evaluated MLX arrays of ``specs``, each written by ``fill``.

    Args:
        specs: ``(shape, dtype name)`` of each array.
        fill: ``fill(i, view)`` must write every byte of array ``i`` (its memory is
            uninitialised either way); with ``direct`` it runs on several threads
            at once, for different arrays, so it may only write its own array.
        direct: allocate through MLX's loader, without a zero fill (False: each
            array written into a host buffer on this thread, one after another, and
            copied into MLX's memory: the fallback); default: with ``units``, or for
            at least :data:`DIRECT_MIN_BYTES` in all. Not used on a CUDA GPU, where the arrays
            are staged through pinned memory (:func:`kvstore.codecs.cuda.upload`).
        units: what writes the arrays allocated through the loader, instead of
            ``fill`` (which writes them on every other way, after ``units.unused()``).
        align: the address of the rows copied into the arrays modulo
            :data:`ALIGN_BYTES`: the arrays start so too (a few buffers do).

    Returns:
        The arrays, in order, each its own bytes: through the loader, views of a few
        buffers of :data:`BUFFER_MAX_BYTES` (no two overlapping), otherwise each its
        own buffer.

    Raises:
        What ``fill`` raises, when it fails again on the host buffers.
    """
    if not specs:
        return []
    if cuda.available():  # a CUDA GPU: through pinned staging, every core copying
        if units is not None:
            units.unused()
        return cuda.upload(specs, fill)
    keep_freed_memory()  # the arrays reuse freed heap, not fresh pages (3x, host_memory)
    if direct is None:
        # Units write records whole, the arrays' first writes: no host buffer between,
        # whose fresh pages a new process's restore would fault in too (D2, qwen-0.5B
        # at 512 tokens, 6 MiB: 8.9-9.4 ms through the loader, 13.2-14.2 through one
        # host buffer copied into MLX's memory at once).
        direct = units is not None or sum(map(cuda.nbytes_of, specs)) >= DIRECT_MIN_BYTES
    if direct:
        owned = _allocated(specs, align)
        if owned is not None and _written(owned, specs, fill, units):
            return [array for array, _ in owned]
        del owned  # an array not written completely is never handed out
    if units is not None:
        units.unused()
    return _copied(specs, fill)


def _copied(specs: Sequence[LeafSpec], fill: Fill) -> list[mx.array]:
    """Each array of ``specs`` written by ``fill`` into a host buffer, then copied once
    into MLX's memory (a new buffer each: owned), all evaluated."""
    arrays = []
    for i, (shape, name) in enumerate(specs):
        host = np.empty(shape, numpy_dtype(name))
        fill(i, host)
        arrays.append(as_mlx(host))  # a copy; a bfloat16 array is a view of its words
        del host  # freed before the next is allocated: the same block, in the cache
    mx.eval(arrays)
    return arrays


def _written(
    owned: list[tuple[mx.array, np.ndarray]],
    specs: Sequence[LeafSpec],
    fill: Fill,
    units: Units | None,
) -> bool:
    """Whether ``fill`` (or ``units``) wrote every one of the ``owned`` arrays, on every
    core."""
    try:
        if units is not None:
            targets = [view for _, view in owned]
            each_on_threads(units.count, lambda k: units.write(k, targets))
        else:
            each_on_threads(len(specs), lambda i: fill(i, owned[i][1]))
    except Exception:  # noqa: BLE001 - the fallback writes them again, raising if it fails again
        return False
    return True


def common_alignment(addresses: Iterable[int]) -> int | None:
    """The most common of ``addresses`` modulo :data:`ALIGN_BYTES` (``None``: none), for
    :func:`filled_arrays`' ``align``."""
    found = Counter(a % ALIGN_BYTES for a in addresses).most_common(1)
    return found[0][0] if found else None


def _shift(host: np.ndarray, align: int | None) -> int:
    """Where in buffer ``host`` (:data:`ALIGN_BYTES` longer than its arrays) they start:
    at an address of ``align`` modulo :data:`ALIGN_BYTES` (``None``: at its start)."""
    return 0 if align is None else (align - int(host.ctypes.data)) % ALIGN_BYTES


def _allocated(
    specs: Sequence[LeafSpec], align: int | None = None
) -> list[tuple[mx.array, np.ndarray]] | None:
    """Arrays of ``specs`` in buffers allocated by MLX's loader, uninitialised, each
    with a writable view of its memory (``numpy_dtype``); ``None`` when MLX did not
    read the stream as expected.

    The loader costs ~70 us an array it allocates (a hand-off to Python and back on
    its I/O threads: 4.5 ms for a 2048-token llama-8B restore's 64 arrays on this
    2-core VM, 6.1 before those threads kept their Python states), so it allocates a few
    buffers of at most :data:`BUFFER_MAX_BYTES` (0.3 ms), and the arrays are views cut
    from them (:mod:`~kvstore.codecs.one_buffer`).
    """
    groups = _buffer_groups(specs)
    slack = 0 if align is None else ALIGN_BYTES
    sizes = [buffer_starts(group)[-1] + slack for group in groups]
    stream = LeafStream([((size,), "uint8") for size in sizes])
    unshared = sys.getrefcount(stream)
    try:
        loaded = mx.load(cast(BinaryIO, stream), format="safetensors")  # duck-typed file
    except (RuntimeError, ValueError):  # MLX refused the stream: make them the plain way
        loaded = {}
    # MLX's reader of the stream takes the GIL in its destructor, which now and then
    # runs on an MLX thread just after mx.load returned. At interpreter exit that
    # thread could not take the GIL and the process would abort ("terminate called
    # without an active exception"), so wait here until the reader is gone.
    deadline = time.monotonic() + _RELEASE_TIMEOUT_S
    while sys.getrefcount(stream) > unshared and time.monotonic() < deadline:
        time.sleep(0)  # hands the GIL to MLX's thread
    if not (stream.complete and isinstance(loaded, dict) and len(loaded) == len(groups)):
        return None
    arrays: list[mx.array] = []
    views: list[np.ndarray] = []
    for k, group in enumerate(groups):
        flat = loaded[str(k)]
        host = np.asarray(flat)
        if HUGE_PAGES:  # a fresh buffer's pages: 2 MiB each as they fault in
            advise_huge_pages(host)
        shift = _shift(host, align)
        arrays += views_in(flat[shift:] if shift else flat, group)
        views += host_views_in(host[shift:], group)
    mx.eval(arrays)
    return list(zip(arrays, views, strict=True))


def _buffer_groups(specs: Sequence[LeafSpec]) -> list[Sequence[LeafSpec]]:
    """``specs`` cut into runs of at most :data:`BUFFER_MAX_BYTES` each, in order; an
    array over it, or on the CPU of at least :data:`OWN_BUFFER_MIN_BYTES`, a run of its
    own."""
    groups: list[Sequence[LeafSpec]] = []
    first, size = 0, 0
    own_from = OWN_BUFFER_MIN_BYTES if mx.default_device() == mx.cpu else None
    for i, spec in enumerate(specs):
        nbytes = padded_nbytes(spec)
        alone = own_from is not None and nbytes >= own_from
        if i > first and (alone or size + nbytes > BUFFER_MAX_BYTES):
            groups.append(specs[first:i])
            first, size = i, 0
        size += nbytes
        if alone:
            groups.append(specs[i : i + 1])
            first, size = i + 1, 0
    if first < len(specs):
        groups.append(specs[first:])
    return groups
