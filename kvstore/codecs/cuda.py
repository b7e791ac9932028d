"""Host <-> CUDA device copies of KV tensors at PCIe speed, for restores and saves.

MLX's CUDA backend has no fast way for host bytes to reach a device array, nor
back. ``mx.array(numpy)`` copies into *managed* memory on one thread, and the
GPU then faults every page across (about 2 GB/s end to end on an H200);
``mx.load`` stages each tensor in fresh pageable memory (about 5 GB/s); and any
host access to a device array (``numpy.asarray``, ``memoryview``) moves its
whole buffer into managed memory, where later kernels fault it back.

This module takes the direct route. Staging buffers are ordinary host memory
page-locked once with ``cuMemHostRegister`` through the CUDA driver API
(``libcuda.so.1``, which MLX's CUDA build itself links), so the GPU can read
and write them over PCIe; two tiny MLX CUDA kernels copy between such a
buffer and a device array in MLX's own stream order:

* :func:`upload`: arrays built from host bytes. Worker threads (each taking a
  pinned slot of :func:`slot_min_bytes` or more, all kept for the process) fill
  a slot with an array's bytes -- from store pages, say, already in the cache's
  layout -- and launch the copy into a fresh device array; while one array
  crosses the bus the other workers are filling theirs.
* :func:`download`: the bytes of a device array into a pinned buffer (a save's
  records are then hashed and written from there).

Measured on an H200 (PCIe 5, 16 cores; ``tools/bench/gpu/probe.py``): a kernel
reading pinned host memory moves 49.7 GB/s, writing it 50.1 GB/s; 8 workers
staging 64 arrays of 8 MiB reach 29 GB/s, 12 reach 34 GB/s; page-locking 256
MiB costs 9.6 ms (``cuMemHostAlloc`` of the same, 127 ms).

Only used where the default device is a CUDA GPU; everything falls back to the
plain paths when the driver, the kernels or a buffer are not to be had (set
``KVSTORE_CUDA_STAGING=0`` to turn it off). Tests on machines without a GPU
swap :data:`TRANSPORT` for a host-memory stand-in to exercise the threading.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from kvstore.codecs.arrays import MLX_DTYPES, byte_view, numpy_dtype
from kvstore.codecs.cuda_driver import DeviceStaging, Driver, PinnedBuffer, Staging
from kvstore.cuda_kernel import Kernel, cuda_kernel
from kvstore.devices import default_is_cuda
from kvstore.knobs import choice_from_env, count_from_env, mib_from_env, switch_from_env
from kvstore.threads import KeptPool, cores

log = logging.getLogger("kvstore.cuda")

__all__ = [
    "LeafSpec",
    "Fill",
    "PinnedBuffer",
    "Staging",
    "Transport",
    "TRANSPORT",
    "available",
    "transport",
    "pool",
    "workers",
    "nbytes_of",
    "SEGMENT_WORDS",
    "upload",
    "download",
    "download_later",
    "DOWNLOAD_ROUTE",
    "slots_ready",
    "prepare_slots_later",
    "borrowed_slot",
    "transport_kernels",
]

#: One array to build: ``(shape, dtype name)``.
LeafSpec = tuple[tuple[int, ...], str]
#: ``fill(i, view)`` writes every byte of array ``i`` into ``view`` (its slot, shaped).
Fill = Callable[[int, np.ndarray], None]

#: Threads per copy kernel launch (and per block): enough to saturate PCIe.
_GRID, _BLOCK = 1024 * 256, 256
#: How a save's payloads cross to its pinned arena (``KVSTORE_CUDA_DOWNLOAD_ROUTE``):
#: ``copy`` (the default), the copy engine (``cuMemcpyDtoHAsync``), no kernel and no
#: SM, each record on the pool thread that then hashes it (:func:`download_later`);
#: ``kernel``, a copy kernel on the saving thread's MLX stream, one record after the
#: other. On one H100 host, two G3 runs each way alternating (results/gpu/ba12939-h100):
#: the durable save 370/351 -> 307/328 ms at 4096 tokens, 1.53/1.55 -> 1.37/1.51 s at
#: 16384; the longest decode step during it 35.0/31.7 -> 25.9/29.3 ms and 60.4/34.5 ->
#: 33.9/35.5 ms.
DOWNLOAD_ROUTE = choice_from_env("KVSTORE_CUDA_DOWNLOAD_ROUTE", ("copy", "kernel"), "copy")

_COPY_BODY = """
    const unsigned char* s = reinterpret_cast<const unsigned char*>({src});
    unsigned char* d = reinterpret_cast<unsigned char*>({dst});
    size_t n = (size_t)params[1];
    size_t n16 = n / 16;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    const uint4* s16 = reinterpret_cast<const uint4*>(s);
    uint4* d16 = reinterpret_cast<uint4*>(d);
    for (size_t j = i; j < n16; j += stride) d16[j] = s16[j];
    if (i == 0) {{
        for (size_t j = n16 * 16; j < n; ++j) d[j] = s[j];
        {done}
    }}
"""
#: Host (pinned, ``params[0]``) -> the new device array ``out``.
_UPLOAD_SOURCE = _COPY_BODY.format(src="params[0]", dst="out", done="")
#: Device array ``inp`` -> host (pinned, ``params[0]``). In one launch: 4 MiB launches, each
#: evaluated before the next, made a 4096-token save's download 76-93 ms against 41-53 on
#: an H100 and spared the decode step beside it nothing
#: (tools/bench/results/gpu/ba12939-h100/run1/save-stall-4096-piece4.txt).
_DOWNLOAD_SOURCE = _COPY_BODY.format(src="inp", dst="params[0]", done="done[0] = 1;")
#: The device address of ``inp``'s first byte (MLX hands none out), for the copy engine
#: to read it from.
_ADDRESS_SOURCE = """
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        out[0] = reinterpret_cast<unsigned long long>(inp);
    }
"""
#: Words per gather segment: ``src, src_pitch, dst_offset, dst_pitch, width, height``.
SEGMENT_WORDS = 6
#: Segments of registered host memory -> the new device array ``out``
#: (:mod:`kvstore.codecs.cuda_pages`). ``params``: the segment count, then
#: :data:`SEGMENT_WORDS` words per segment, as named there (bytes; ``src``
#: 0 writes zeros). Block ``b`` copies a share of segment ``b % count``, 16 bytes at a
#: time where the segment's addresses and pitches allow (a row's last ``width % 16``
#: bytes one at a time).
_SEGMENTS_BODY = """
    {prologue}
    const unsigned long long* p = reinterpret_cast<const unsigned long long*>(params);
    unsigned long long count = p[0];
    unsigned long long seg = blockIdx.x % count;
    unsigned long long part = blockIdx.x / count, parts = gridDim.x / count;
    const unsigned long long* s = p + 1 + seg * SEGMENT_WORDS;
    unsigned long long src = s[0], sp = s[1], doff = s[2], dp = s[3], w = s[4], h = s[5];
    const unsigned char* s1 = {source};
    unsigned long long at = reinterpret_cast<unsigned long long>(s1);
    {destination}
    unsigned long long first = part * blockDim.x + threadIdx.x, step = parts * blockDim.x;
    if (((at | sp | doff | dp) & 15) == 0) {{
        const uint4* s16 = reinterpret_cast<const uint4*>(s1);
        uint4* d16 = reinterpret_cast<uint4*>(d + doff);
        unsigned long long w16 = w / 16, tail = w - w16 * 16;
        for (unsigned long long j = first; j < w16 * h; j += step) {{
            unsigned long long r = j / w16, c = j - r * w16;
            d16[r * (dp / 16) + c] = src ? s16[r * (sp / 16) + c] : make_uint4(0, 0, 0, 0);
        }}
        for (unsigned long long j = first; j < tail * h; j += step) {{
            unsigned long long r = j / tail, c = w16 * 16 + j - r * tail;
            d[doff + r * dp + c] = src ? s1[r * sp + c] : 0;
        }}
    }} else {{
        for (unsigned long long j = first; j < w * h; j += step) {{
            unsigned long long r = j / w, c = j - r * w;
            d[doff + r * dp + c] = src ? s1[r * sp + c] : 0;
        }}
    }}
""".replace("SEGMENT_WORDS", str(SEGMENT_WORDS))
#: Where a segment writes: the one output ``out``.
_ONE_OUTPUT = "unsigned char* d = reinterpret_cast<unsigned char*>(out);"


def _segments_source(
    *, source: str, prologue: str = "", destination: str = _ONE_OUTPUT, **constants: int
) -> str:
    """:data:`_SEGMENTS_BODY` reading each segment from ``source`` and writing it where
    ``destination`` says, after ``prologue``; each of ``constants`` spelled out."""
    text = _SEGMENTS_BODY.format(prologue=prologue, source=source, destination=destination)
    for name, value in constants.items():
        text = text.replace(name, str(value))
    return text


def _byte_pointers(name: str, prefix: str, count: int, *, const: bool) -> str:
    """A C array ``name`` of the kernel's buffers ``prefix0`` .. ``prefix{count - 1}``, as
    byte pointers."""
    kind = "const unsigned char*" if const else "unsigned char*"
    casts = ", ".join(f"reinterpret_cast<{kind}>({prefix}{i})" for i in range(count))
    return f"{kind} {name}[{count}] = {{{casts}}};"


#: Where a segment reads: ``src`` itself, a device address.
_FROM_ADDRESS = "reinterpret_cast<const unsigned char*>(src)"
_GATHER_SOURCE = _segments_source(source=_FROM_ADDRESS)
#: Outputs of one :meth:`KernelTransport.gather_many` kernel: a restore's arrays are
#: made this many to a launch (a 32-layer model's 64 in one).
GATHER_OUTPUTS = 64
#: Bits of a :meth:`~KernelTransport.gather_many` segment's ``dst_offset`` that hold the
#: offset into its output; the bits above hold the output's number.
OUTPUT_OFFSET_BITS = 48
#: As :data:`_GATHER_SOURCE`, into outputs ``out0`` .. ``out63``: each segment's
#: ``dst_offset`` names an output and an offset into it (:data:`OUTPUT_OFFSET_BITS`).
#: On the H200 a lossless 4096-token restore's 64 gathers, a kernel each, took 2.2 ms to
#: launch and 4.1 ms more to finish, for 0.3 ms of copying: each kernel is a node
#: of the CUDA graph MLX instantiates afresh in a new process
#: (``tools/bench/results/gpu/3be324c/restore-profiles.txt``).
_OUTPUTS = _byte_pointers("outs", "out", GATHER_OUTPUTS, const=False)
#: Where a segment writes: the output its ``dst_offset``'s high bits name.
_TO_NAMED_OUTPUT = (
    "unsigned char* d = outs[doff >> OUTPUT_OFFSET_BITS]; doff &= (1ull << OUTPUT_OFFSET_BITS) - 1;"
)
_GATHER_MANY_SOURCE = _segments_source(
    prologue=_OUTPUTS,
    source=_FROM_ADDRESS,
    destination=_TO_NAMED_OUTPUT,
    OUTPUT_OFFSET_BITS=OUTPUT_OFFSET_BITS,
)
#: Inputs of the assemble kernel besides ``params``: the buffers its segments read.
ASSEMBLE_INPUTS = 8
#: Bits of an assemble segment's ``src`` that hold the offset into its buffer; the bits
#: above hold the buffer's number plus one (``src`` 0 still writes zeros).
ASSEMBLE_OFFSET_BITS = 48
#: Segments of device buffers ``b0`` .. ``b7`` -> the new device array ``out``: as
#: :data:`_GATHER_SOURCE`, each ``src`` naming a buffer and an offset into it
#: (:data:`ASSEMBLE_OFFSET_BITS`). How :mod:`kvstore.codecs.cuda_pages` joins rows it
#: gathered a group of pages at a time, while later pages were still being locked.
_BUFFERS = _byte_pointers("bufs", "b", ASSEMBLE_INPUTS, const=True)
#: Where a segment reads: the buffer its ``src``'s high bits name (0: zeros).
_FROM_NAMED_BUFFER = (
    "src ? bufs[(src >> ASSEMBLE_OFFSET_BITS) - 1] + "
    "(src & ((1ull << ASSEMBLE_OFFSET_BITS) - 1)) : nullptr"
)
_ASSEMBLE_SOURCE = _segments_source(
    prologue=_BUFFERS, source=_FROM_NAMED_BUFFER, ASSEMBLE_OFFSET_BITS=ASSEMBLE_OFFSET_BITS
)

#: As :data:`_ASSEMBLE_SOURCE`, into outputs ``out0`` .. ``out63`` as
#: :data:`_GATHER_MANY_SOURCE` writes them: each segment's ``src`` names a buffer
#: (:data:`ASSEMBLE_OFFSET_BITS`) and its ``dst_offset`` an output
#: (:data:`OUTPUT_OFFSET_BITS`). How a lossy restore gives each cache its own buffer of
#: the rows it decoded for all layers at once (:mod:`kvstore.codecs.device_joins`): one
#: kernel where a concatenation and a zero fill per array were ~128 nodes of the CUDA
#: graph a fresh process instantiates (q8, 4096 tokens of llama-8B on an H200: ~10.6 ms
#: after the decode, ``tools/bench/results/gpu/1a8cb38/ab-env.txt``).
_ASSEMBLE_MANY_SOURCE = _segments_source(
    prologue=_BUFFERS + _OUTPUTS,
    source=_FROM_NAMED_BUFFER,
    destination=_TO_NAMED_OUTPUT,
    ASSEMBLE_OFFSET_BITS=ASSEMBLE_OFFSET_BITS,
    OUTPUT_OFFSET_BITS=OUTPUT_OFFSET_BITS,
)


class Transport(Protocol):
    """How bytes cross between a pinned slot and the device (swapped in tests)."""

    def slot(self, nbytes: int) -> PinnedBuffer:
        """A new pinned buffer of at least ``nbytes``."""

    def to_device(self, slot: PinnedBuffer, nbytes: int) -> mx.array:
        """A new evaluated uint8 device array of the slot's first ``nbytes``."""

    def to_host(self, array: mx.array, slot: PinnedBuffer, offset: int) -> None:
        """Copy the bytes of the contiguous uint8 ``array`` to ``slot[offset:]`` (waits)."""

    def addresses(self, arrays: Sequence[mx.array]) -> list[int]:
        """Each contiguous uint8 device array's address, once it exists (evaluates them,
        on the calling thread); the caller holds the arrays while it copies from them."""

    def copy_down(self, address: int, slot: PinnedBuffer, offset: int, nbytes: int) -> None:
        """Copy ``nbytes`` at device ``address`` to ``slot[offset:]`` by the copy engine,
        on the calling thread's own stream (waits): any thread may call it."""

    def register(self, base: int, nbytes: int) -> int:
        """Page-lock host pages ``[base, base + nbytes)`` for the GPU to read: the
        device address of ``base`` (raises OSError/RuntimeError when refused)."""

    def unregister(self, base: int) -> None:
        """Let go of the pages :meth:`register` locked at ``base``."""

    def staging(self, nbytes: int) -> Staging | None:
        """``nbytes`` of device memory to copy page-locked spans into; ``None`` where it
        cannot be had (a gather then reads the rows from the host pages)."""

    def gather(self, params: np.ndarray, nbytes: int) -> mx.array:
        """A new lazy uint8 device array of ``nbytes`` written by the segments of
        ``params`` (uint64 words: see :data:`_GATHER_SOURCE`) from registered pages
        or a :class:`Staging`'s memory."""

    def gather_many(self, params: np.ndarray, nbytes: Sequence[int]) -> list[mx.array]:
        """New lazy uint8 device arrays of ``nbytes`` each (at most
        :data:`GATHER_OUTPUTS`), made by one kernel: as :meth:`gather`, each segment's
        ``dst_offset`` naming its array (:data:`OUTPUT_OFFSET_BITS`)."""

    def assemble(self, params: np.ndarray, buffers: Sequence[mx.array], nbytes: int) -> mx.array:
        """A new lazy uint8 device array of ``nbytes`` written by the segments of
        ``params`` from the uint8 device ``buffers`` (at most :data:`ASSEMBLE_INPUTS`;
        see :data:`_ASSEMBLE_SOURCE`)."""

    def assemble_many(
        self, params: np.ndarray, buffers: Sequence[mx.array], nbytes: Sequence[int]
    ) -> list[mx.array]:
        """New lazy uint8 device arrays of ``nbytes`` each (at most
        :data:`GATHER_OUTPUTS`), made by one kernel: as :meth:`assemble`, each segment's
        ``dst_offset`` naming its array (:data:`OUTPUT_OFFSET_BITS`)."""


def transport_kernels() -> dict[str, Kernel]:
    """:class:`KernelTransport`'s kernels by role (nothing compiles before a call)."""
    many = [f"out{i}" for i in range(GATHER_OUTPUTS)]
    buffers = [f"b{i}" for i in range(ASSEMBLE_INPUTS)]
    return {
        "upload": cuda_kernel("kvstore_upload", ["params"], ["out"], _UPLOAD_SOURCE),
        "download": cuda_kernel("kvstore_download", ["params", "inp"], ["done"], _DOWNLOAD_SOURCE),
        "address": cuda_kernel("kvstore_address", ["inp"], ["out"], _ADDRESS_SOURCE),
        "gather": cuda_kernel("kvstore_gather", ["params"], ["out"], _GATHER_SOURCE),
        "gather_many": cuda_kernel("kvstore_gather_many", ["params"], many, _GATHER_MANY_SOURCE),
        "assemble": cuda_kernel(
            "kvstore_assemble", ["params", *buffers], ["out"], _ASSEMBLE_SOURCE
        ),
        "assemble_many": cuda_kernel(
            "kvstore_assemble_many", ["params", *buffers], many, _ASSEMBLE_MANY_SOURCE
        ),
    }


class KernelTransport:
    """The real one: the driver for pinned memory, MLX CUDA kernels for the copies."""

    _upload: Any
    _download: Any
    _gather: Any

    def __init__(self) -> None:
        self.driver = Driver()
        kernels = transport_kernels()
        self._upload = kernels["upload"]
        self._download = kernels["download"]
        self._address = kernels["address"]
        self._gather = kernels["gather"]
        self._gather_many = kernels["gather_many"]
        self._assemble = kernels["assemble"]
        self._assemble_many = kernels["assemble_many"]

    def slot(self, nbytes: int) -> PinnedBuffer:
        return PinnedBuffer(nbytes, self.driver)

    def to_device(self, slot: PinnedBuffer, nbytes: int) -> mx.array:
        params = mx.array(np.array([slot.device_pointer, nbytes], np.uint64))
        (out,) = self._upload(
            inputs=[params],
            output_shapes=[(nbytes,)],
            output_dtypes=[mx.uint8],
            grid=(_GRID, 1, 1),
            threadgroup=(_BLOCK, 1, 1),
        )
        mx.eval(out)
        return out

    def to_host(self, array: mx.array, slot: PinnedBuffer, offset: int) -> None:
        nbytes = int(array.nbytes)
        if offset + nbytes > slot.nbytes or (slot.device_pointer + offset) % 16:
            raise ValueError(
                f"[cuda] {nbytes} bytes at {offset} do not fit a {slot.nbytes}-byte slot at a "
                f"16-byte boundary."
            )
        if DOWNLOAD_ROUTE == "copy":
            try:
                self.copy_down(self.addresses([array])[0], slot, offset, nbytes)
                return
            except (OSError, RuntimeError) as exc:  # the kernel then, from now on
                give_up_copy_route(exc)
        words = [slot.device_pointer + offset, nbytes]
        (done,) = self._download(
            inputs=[mx.array(np.array(words, np.uint64)), array],
            output_shapes=[(1,)],
            output_dtypes=[mx.uint32],
            grid=(_GRID, 1, 1),
            threadgroup=(_BLOCK, 1, 1),
        )
        mx.eval(done)

    def addresses(self, arrays: Sequence[mx.array]) -> list[int]:
        # A one-thread kernel reads each address (MLX hands none out); evaluating them
        # waits for the arrays to exist.
        found = [
            self._address(
                inputs=[array],
                output_shapes=[(1,)],
                output_dtypes=[mx.uint64],
                grid=(1, 1, 1),
                threadgroup=(1, 1, 1),
            )[0]
            for array in arrays
        ]
        mx.eval(found)
        return [int(a) for a in np.array(mx.concatenate(found))] if found else []

    def copy_down(self, address: int, slot: PinnedBuffer, offset: int, nbytes: int) -> None:
        if offset + nbytes > slot.nbytes:
            raise ValueError(
                f"[cuda] {nbytes} bytes at {offset} do not fit a {slot.nbytes}-byte slot."
            )
        stream = self.driver.thread_stream()
        self.driver.copy_to_host(int(slot.array.ctypes.data) + offset, address, nbytes, stream)
        self.driver.synchronize(stream)

    def register(self, base: int, nbytes: int) -> int:
        return self.driver.register_pages(base, nbytes)

    def unregister(self, base: int) -> None:
        self.driver.unregister_pages(base)

    def staging(self, nbytes: int) -> Staging | None:
        try:
            return DeviceStaging(self.driver, nbytes)
        except (OSError, RuntimeError, AttributeError):  # no memory, or an older driver
            return None

    def gather(self, params: np.ndarray, nbytes: int) -> mx.array:
        return self._segments(self._gather, params, [], [nbytes])[0]

    def gather_many(self, params: np.ndarray, nbytes: Sequence[int]) -> list[mx.array]:
        sizes = _all_outputs(nbytes)
        return self._segments(self._gather_many, params, [], sizes)[: len(nbytes)]

    def assemble(self, params: np.ndarray, buffers: Sequence[mx.array], nbytes: int) -> mx.array:
        inputs = _all_inputs(buffers)
        return self._segments(self._assemble, params, inputs, [nbytes])[0]

    def assemble_many(
        self, params: np.ndarray, buffers: Sequence[mx.array], nbytes: Sequence[int]
    ) -> list[mx.array]:
        inputs, sizes = _all_inputs(buffers), _all_outputs(nbytes)
        return self._segments(self._assemble_many, params, inputs, sizes)[: len(nbytes)]

    @staticmethod
    def _segments(
        kernel: Any, params: np.ndarray, inputs: list[mx.array], nbytes: Sequence[int]
    ) -> list[mx.array]:
        count = int(params[0])
        words = params[1:].reshape(count, SEGMENT_WORDS)
        largest = int((words[:, 4] * words[:, 5]).max()) if count else 0
        # Enough blocks per segment for each thread to copy a few 16-byte words.
        parts = max(1, min(64, largest // (16 * _BLOCK * 4)))
        return list(
            kernel(
                inputs=[mx.array(params), *inputs],
                output_shapes=[(n,) for n in nbytes],
                output_dtypes=[mx.uint8] * len(nbytes),
                grid=(count * parts * _BLOCK, 1, 1),
                threadgroup=(_BLOCK, 1, 1),
            )
        )


def _all_inputs(buffers: Sequence[mx.array]) -> list[mx.array]:
    """``buffers`` and as many more as make an assemble kernel's
    :data:`ASSEMBLE_INPUTS`: no segment reads those, so they are bound to one of the
    buffers (no new array).

    Raises:
        ValueError: more buffers than a kernel reads.
    """
    if len(buffers) > ASSEMBLE_INPUTS:
        raise ValueError(f"[cuda] {len(buffers)} buffers; assemble reads {ASSEMBLE_INPUTS}.")
    spare = buffers[0] if buffers else mx.zeros((16,), mx.uint8)
    return [*buffers, *[spare] * (ASSEMBLE_INPUTS - len(buffers))]


def _all_outputs(nbytes: Sequence[int]) -> list[int]:
    """The sizes of a many-output kernel's :data:`GATHER_OUTPUTS` outputs: ``nbytes``,
    then 16 bytes for each that no segment writes (dropped).

    Raises:
        ValueError: no arrays, or more than a kernel makes.
    """
    if not 0 < len(nbytes) <= GATHER_OUTPUTS:
        raise ValueError(f"[cuda] {len(nbytes)} arrays; a kernel makes 1 to {GATHER_OUTPUTS}.")
    return [*nbytes, *[16] * (GATHER_OUTPUTS - len(nbytes))]


#: The transport in use; ``None`` until first needed (then a :class:`KernelTransport`,
#: or ``False`` when there is none to be had).
TRANSPORT: Transport | None | bool = None
_LOCK = threading.Lock()
_POOL = KeptPool("kvstore-cuda", lambda: workers())
#: Staging slots not in use; a worker takes one for an array and gives it back after.
_FREE: queue.SimpleQueue[PinnedBuffer] = queue.SimpleQueue()
_SLOTS_MADE = False
#: Set once the slots :func:`_prepare_slots` makes are free to take.
_SLOTS_READY = threading.Event()


def workers() -> int:
    """Staging threads: most of the cores, at most 12 (34 GB/s measured there; the
    bus, not the cores, is the limit beyond); ``KVSTORE_CUDA_THREADS`` sets them."""
    return count_from_env("KVSTORE_CUDA_THREADS", max(1, min(12, cores() - 2)))


def in_use() -> bool:
    """Whether :func:`available` has found CUDA staging working in this process; sets
    nothing up (a store read alone does not compile the staging kernels)."""
    return TRANSPORT is not None and TRANSPORT is not False


def available() -> bool:
    """True when the default device is a CUDA GPU and staging works here."""
    global TRANSPORT
    if TRANSPORT is False:
        return False
    if TRANSPORT is not None:
        return True
    if not switch_from_env("KVSTORE_CUDA_STAGING"):
        TRANSPORT = False
        return False
    on_cuda = default_is_cuda()
    with _LOCK:
        if TRANSPORT is None:
            try:
                TRANSPORT = _checked(KernelTransport()) if on_cuda else False
            except (OSError, RuntimeError, ValueError, AttributeError):
                TRANSPORT = False
    return TRANSPORT is not False


def _checked(transport: KernelTransport) -> KernelTransport | bool:
    """``transport`` if a round trip through it returns every byte (its kernels compile
    and read and write pinned memory here), else False: staging is then not used."""
    data = np.random.default_rng(0).integers(0, 256, (1 << 20) + 13, dtype=np.uint8)
    back = -(-data.nbytes // 64) * 64
    slot = transport.slot(back + data.nbytes)
    np.copyto(slot.array[: data.nbytes], data)
    device = transport.to_device(slot, data.nbytes)
    transport.to_host(device, slot, back)
    ok = bool(np.array_equal(slot.array[back : back + data.nbytes], data))
    del device
    slot.release()
    return transport if ok else False


def transport() -> Transport:
    if not available():
        raise RuntimeError("[cuda] No CUDA staging here (see kvstore.codecs.cuda.available).")
    assert TRANSPORT is not None and TRANSPORT is not False and TRANSPORT is not True
    return TRANSPORT


def pool() -> ThreadPoolExecutor:
    """The staging threads (:func:`workers` of them), kept for the process."""
    return _POOL.get()


def slot_min_bytes() -> int:
    """The size every staging slot starts at (``KVSTORE_CUDA_SLOT_MIB``, default 32 MiB):
    one record of a 256-token block of a llama-8B-shaped model, or one layer's keys of a
    16k-token prompt, so a restore does not grow slots (page-locking is a ~1 ms call per
    8 MiB, touching the pages more)."""
    return mib_from_env("KVSTORE_CUDA_SLOT_MIB", 32)


def _prepare_slots() -> None:
    """The staging slots, one per worker, made at once on the workers (the first upload
    of a process pays this, not the ones after)."""
    global _SLOTS_MADE
    with _LOCK:
        if _SLOTS_MADE:
            return
        _SLOTS_MADE = True
    size = slot_min_bytes()
    try:
        for slot in pool().map(lambda _: transport().slot(size), range(workers())):
            _FREE.put(slot)
    finally:
        _SLOTS_READY.set()


def slots_ready() -> bool:
    """Whether the staging slots are made (:func:`prepare_slots_later`)."""
    return _SLOTS_READY.is_set()


def prepare_slots_later() -> None:
    """Start making the staging slots on the staging threads, if nobody has (a first
    upload makes them too); :func:`slots_ready` says when they are."""
    if not _SLOTS_MADE:  # not on a staging thread: it waits for them to make the slots
        threading.Thread(target=_prepare_slots, name="kvstore-cuda-slots", daemon=True).start()


@contextlib.contextmanager
def borrowed_slot(nbytes: int) -> Iterator[PinnedBuffer]:
    """A free staging slot of at least ``nbytes``, for the block, then free again."""
    slot = _take_slot(nbytes)
    try:
        yield slot
    finally:
        _FREE.put(slot)


def _take_slot(nbytes: int) -> PinnedBuffer:
    """A free slot of at least ``nbytes`` (one grown, or a new one, when none is)."""
    try:
        slot = _FREE.get_nowait()
    except queue.Empty:
        return transport().slot(max(nbytes, slot_min_bytes()))
    if slot.nbytes < nbytes:
        slot.release()
        slot = transport().slot(max(nbytes, slot_min_bytes()))
    return slot


def nbytes_of(spec: LeafSpec) -> int:
    shape, name = spec
    return math.prod(shape) * numpy_dtype(name).itemsize


def upload(specs: Sequence[LeafSpec], fill: Fill) -> list[mx.array]:
    """New evaluated device arrays of ``specs``, array ``i`` written by ``fill(i, view)``.

    ``fill`` runs on staging threads, several at once, each writing into its own
    slot: it may only write the view it is given, which is uninitialised.

    Raises:
        RuntimeError: no CUDA staging here (call :func:`available` first).
        Whatever ``fill`` raises.
    """
    staging = transport()
    _prepare_slots()

    def one(i: int) -> mx.array:
        nbytes = nbytes_of(specs[i])
        shape, name = specs[i]
        slot = _take_slot(nbytes)
        try:
            view = slot.array[:nbytes].view(numpy_dtype(name)).reshape(shape)
            fill(i, view)
            flat = staging.to_device(slot, nbytes)
            # Evaluated here: MLX evaluates a graph only on the thread whose stream built it
            # (and the slot is free again only once its bytes have crossed).
            array = flat.view(MLX_DTYPES[name]).reshape(shape)
            mx.eval(array)
        finally:
            _FREE.put(slot)
        return array

    return list(pool().map(one, range(len(specs))))


def download(
    arrays: Sequence[mx.array],
    slot: PinnedBuffer,
    offsets: Sequence[int],
    *,
    done: Callable[[int], None] | None = None,
) -> None:
    """The bytes of each contiguous device array into ``slot`` at its offset (waits);
    ``done(i)`` as soon as array ``i``'s are there, before the next one's download."""
    staging = transport()
    flats = [byte_view(a) for a in arrays]
    mx.eval(flats)
    for i, (flat, offset) in enumerate(zip(flats, offsets, strict=True)):
        staging.to_host(flat, slot, offset)
        if done is not None:
            done(i)


def download_later(
    arrays: Sequence[mx.array], slot: PinnedBuffer, offsets: Sequence[int]
) -> Callable[[int], None] | None:
    """Under the ``copy`` route (:data:`DOWNLOAD_ROUTE`): ``fetch(i)``, which copies
    array ``i``'s bytes into ``slot`` at its offset by the copy engine and waits, on
    whichever thread calls it (the arrays are evaluated now, on this one, and held by
    ``fetch``); else ``None`` (:func:`download` then, on this thread)."""
    if DOWNLOAD_ROUTE != "copy":
        return None
    staging = transport()
    flats = [byte_view(a) for a in arrays]
    try:
        addresses = staging.addresses(flats)
    except (OSError, RuntimeError) as exc:  # this save, and the later ones, by the kernel
        give_up_copy_route(exc)
        return None

    def fetch(i: int) -> None:  # holds ``flats`` (their memory is read) while it lives
        try:
            staging.copy_down(addresses[i], slot, offsets[i], int(flats[i].nbytes))
        except (OSError, RuntimeError) as exc:  # this save fails; the next ones by the kernel
            give_up_copy_route(exc)
            raise

    return fetch


def give_up_copy_route(exc: BaseException) -> None:
    """The ``copy`` route failed here (a driver without the call, a copy refused): this
    process downloads by the kernel from now on (:data:`DOWNLOAD_ROUTE`), said once."""
    global DOWNLOAD_ROUTE
    if DOWNLOAD_ROUTE == "copy":
        DOWNLOAD_ROUTE = "kernel"
        log.warning("kvstore: the copy engine's download failed (%s); saves use the kernel", exc)


def new_buffer(nbytes: int) -> PinnedBuffer:
    """A pinned buffer of at least ``nbytes`` (a save's record arena)."""
    return transport().slot(nbytes)
