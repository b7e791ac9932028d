"""Fresh MLX arrays filled in place by the caller: one write per byte, no zero fill.

MLX has no uninitialised allocation: ``mx.zeros`` (and ``mx.empty``) write
every byte before the caller can write the real ones, a second pass over
the memory of a restore. MLX's safetensors loader does allocate without
initialising: ``mx.load(file_like, format="safetensors")`` allocates each
tensor the header describes and asks the file object to ``readinto`` it.
So :func:`filled_arrays` hands MLX a *virtual* safetensors file
(:class:`LeafStream`) whose header describes the arrays wanted and whose
``readinto`` lets the caller write each array's bytes straight into MLX's
buffer -- from store pages, say, in one copy.

MLX reads on its own I/O threads (``PyFileReader.read(data, n, offset)``:
a seek and a ``readinto`` under one GIL hold, possibly from several threads
at once, while numpy copies release the GIL), and the arrays are evaluated
before ``mx.load`` returns. The stream therefore keeps a position per
thread, and records every failure rather than raising it into MLX (whose
I/O task would drop the exception): an array the stream could not fill
completely is never handed out. Whenever that happens -- or MLX reads in
a pattern the stream does not serve -- the arrays are discarded and made
again the plain way: ``mx.zeros`` plus a writable numpy view of each
(:func:`~kvstore.codecs.arrays.owned_arrays`), which costs the zero fill.
"""

from __future__ import annotations

import json
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import BinaryIO, cast

import mlx.core as mx
import numpy as np

from kvstore.codecs import cuda
from kvstore.codecs.arrays import numpy_dtype, owned_arrays
from kvstore.codecs.copies import spread
from kvstore.codecs.host_memory import keep_freed_memory

__all__ = ["DIRECT_MIN_BYTES", "LeafSpec", "Fill", "LeafStream", "filled_arrays"]

#: Below this many bytes in all, zero-filling every array in one evaluation costs less
#: than the loader's evaluation per array (measured on a 2-core x86 CPU: 27 MiB in 48
#: arrays is a tie, 96 MiB in 64 arrays saves a third).
DIRECT_MIN_BYTES = 32 << 20

#: How long :func:`filled_arrays` waits for MLX to drop its reader (it takes microseconds).
_RELEASE_TIMEOUT_S = 5.0

#: One array to allocate: ``(shape, dtype name)``.
LeafSpec = tuple[tuple[int, ...], str]
#: ``fill(i, view)`` writes every byte of array ``i`` through ``view``, a writable
#: numpy view of its memory (``numpy_dtype(name)``: bfloat16 as tagged words).
Fill = Callable[[int, np.ndarray], None]

_SAFETENSORS_DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
}
# safetensors aligns the data section to 8 bytes by padding the header with spaces.
_HEADER_ALIGN = 8


class LeafStream:
    """A read-only file object that MLX's loader reads as a safetensors file.

    The header lists ``specs`` as tensors ``"0"``, ``"1"``...; a ``readinto``
    of tensor ``i``'s byte range calls ``fill(i, view)`` on the buffer MLX
    allocated for it. After ``mx.load`` returned, :attr:`complete` says
    whether every tensor was filled exactly once and nothing failed.

    Args:
        specs: the arrays, in order.
        fill: writes array ``i`` (see :data:`Fill`).
    """

    closed = False

    def __init__(self, specs: Sequence[LeafSpec], fill: Fill) -> None:
        self._specs = list(specs)
        self._fill = fill
        header, offset, self._starts = {}, 0, {}
        for i, spec in enumerate(self._specs):
            shape, name = spec
            nbytes = cuda.nbytes_of(spec)
            header[str(i)] = {
                "dtype": _SAFETENSORS_DTYPES[name],
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
        self._filled = [False] * len(self._specs)
        #: What went wrong, if anything (the first problem only).
        self.problem: str | None = None

    @property
    def complete(self) -> bool:
        """True when every array was filled once and no read failed."""
        return self.problem is None and all(self._filled)

    # The file protocol MLX's PyFileReader uses: seek, tell, readinto, closed.
    def seek(self, offset: int, whence: int = 0) -> int:
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
                self._fill_leaf(pos - len(self._head), buffer)
        except Exception as exc:  # recorded; filled_arrays discards the arrays
            self._fail(f"{type(exc).__name__}: {exc}")
        self._local.pos = pos + n
        return n

    def _fill_leaf(self, offset: int, buffer: memoryview) -> None:
        i, nbytes = self._starts.get(offset, (None, 0))
        if i is None or len(buffer) != nbytes:
            self._fail(f"a read of {len(buffer)} bytes at data offset {offset} is not one array")
            return
        shape, name = self._specs[i]
        view = np.frombuffer(buffer, dtype=numpy_dtype(name)).reshape(shape)
        with spread():  # MLX reads one array at a time: its copies go on every core
            self._fill(i, view)
        with self._lock:
            twice, self._filled[i] = self._filled[i], True
        if twice:
            self._fail(f"array {i} was read twice")

    def _fail(self, problem: str) -> None:
        with self._lock:
            if self.problem is None:
                self.problem = problem


def filled_arrays(
    specs: Sequence[LeafSpec], fill: Fill, *, direct: bool | None = None
) -> list[mx.array]:
    """Fresh, evaluated MLX arrays of ``specs``, each written by ``fill``.

    Args:
        specs: ``(shape, dtype name)`` of each array.
        fill: ``fill(i, view)`` must write every byte of array ``i`` (with
            ``direct`` its memory is uninitialised); it runs on MLX's I/O
            threads, possibly for several arrays at once, so it may only
            write its own array.
        direct: let MLX's loader allocate without a zero fill (False: always
            ``mx.zeros`` first, the fallback); default: for at least
            :data:`DIRECT_MIN_BYTES` in all. Not used on a CUDA GPU, where
            the arrays are staged through pinned memory
            (:func:`kvstore.codecs.cuda.upload`).

    Returns:
        The arrays, owned (no other array shares their memory), in order.
    """
    if not specs:
        return []
    if cuda.available():  # a CUDA GPU: through pinned staging, every core copying
        return cuda.upload(specs, fill)
    keep_freed_memory()  # the arrays reuse freed heap, not fresh pages (3x, host_memory)
    if direct is None:
        direct = sum(map(cuda.nbytes_of, specs)) >= DIRECT_MIN_BYTES
    if direct:
        stream = LeafStream(specs, fill)
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
        if stream.complete and isinstance(loaded, dict) and len(loaded) == len(specs):
            return [loaded[str(i)] for i in range(len(specs))]
        del loaded  # an array not filled completely is never handed out
    arrays = []
    with spread():
        for i, ((array, view), (_, name)) in enumerate(
            zip(owned_arrays(specs), specs, strict=True)
        ):
            fill(i, view.view(numpy_dtype(name)))
            arrays.append(array)
    return arrays
