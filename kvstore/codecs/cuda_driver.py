"""The few CUDA driver calls host staging needs, through ctypes: host memory page-locked
for the GPU (:class:`PinnedBuffer`, and a file's pages in place), streams of their own,
copies on the copy engine, and device memory to stage into (:class:`DeviceStaging`).

MLX's CUDA backend hands out neither the driver nor device addresses, so these go to
``libcuda.so.1`` directly, in the primary context MLX's runtime API uses (one memory
space). Every call lets the GIL go. Nothing here uses MLX, and a test runs it against a
stand-in library (``tests/test_codecs/test_cuda_driver.py``).
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from typing import Protocol

import numpy as np

from kvstore.codecs.host_memory import advise_huge_pages
from kvstore.knobs import choice_from_env

__all__ = ["PINNED_PAGES", "PinnedBuffer", "Driver", "Staging", "DeviceStaging"]

_CU_MEMHOSTREGISTER_PORTABLE = 0x01
_CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
_CU_MEMHOSTREGISTER_READ_ONLY = 0x08
_CU_STREAM_NON_BLOCKING = 0x01

#: How a pinned buffer's pages are mapped (``KVSTORE_PINNED_PAGES``). ``shared``: shared
#: anonymous memory (Python's ``mmap.mmap(-1, n)``; shmem, which Linux backs with 4 KiB
#: pages only where ``shmem_enabled`` is ``never``, as on the machines measured). ``huge``:
#: private anonymous memory advised 2 MiB pages (:func:`advise_huge_pages`): fewer
#: faults when a buffer is first touched, and fewer TLB misses for the CPU reading it (a
#: save's hash and LMDB's puts read the arena: 118 ms for 512 MiB on the H200). Not
#: measured on a GPU yet: ``shared`` stays the default until it is.
PINNED_PAGES = choice_from_env("KVSTORE_PINNED_PAGES", ("shared", "huge"), "shared")


class PinnedBuffer:
    """Host memory the GPU can read and write: anonymous pages, touched and page-locked.

    Attributes:
        array: the bytes, as a flat uint8 numpy array.
        device_pointer: its address as the GPU sees it.
    """

    def __init__(self, nbytes: int, driver: Driver | None) -> None:
        size = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        huge = PINNED_PAGES == "huge"
        flags = mmap.MAP_PRIVATE if huge else mmap.MAP_SHARED  # anonymous either way
        self._map: mmap.mmap | None = mmap.mmap(-1, size, flags=flags)
        self.array = np.frombuffer(self._map, np.uint8)
        if huge:
            advise_huge_pages(self.array)
        self.array[:: mmap.PAGESIZE] = 0  # fault every page in before locking it
        self._driver = driver
        # Without a driver (a test's stand-in) the memory is plain, seen at its address.
        self.device_pointer = (
            driver.register(self.array) if driver is not None else int(self.array.ctypes.data)
        )
        self.nbytes = size

    def __del__(self) -> None:
        # An arena dropped while records still refer to it: unlock; the pages go with them.
        if getattr(self, "_map", None) is not None and self._driver is not None:
            try:
                self._driver.unregister(self.array)
            except Exception:  # noqa: BLE001 - at exit the driver may be gone already
                pass

    def release(self) -> None:
        """Unlock and unmap (nothing may use the buffer afterwards)."""
        if self._map is None:
            return
        if self._driver is not None:
            self._driver.unregister(self.array)
            self._driver = None
        del self.array
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere: the pages go with it
            pass
        self._map = None


class Driver:
    """The few CUDA driver calls staging needs, through ctypes (raises OSError/RuntimeError
    when there is no driver or a call fails)."""

    def __init__(self) -> None:
        self._cu = ctypes.CDLL("libcuda.so.1")
        # Every call lets the GIL go, even those that return at once: making the quick
        # ones hold it (``ctypes.PyDLL``) was measured on the H200 to hold the restore's
        # own thread back instead (lossless 34.8 -> 44.2 ms, its plans done at 13.8 ->
        # 29.2 ms: tools/bench/results/gpu/cca0a00/ab-stage.txt).
        self._bound = threading.local()
        self._check(self._cu.cuInit(0), "cuInit")
        device = ctypes.c_int()
        self._check(self._cu.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
        self._ctx = ctypes.c_void_p()
        # The primary context is the one MLX's runtime API uses: same memory space.
        self._check(
            self._cu.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), device),
            "cuDevicePrimaryCtxRetain",
        )
        self.bind()

    @staticmethod
    def _check(code: int, call: str) -> None:
        if code != 0:
            raise RuntimeError(f"[cuda] {call} failed with CUresult {code}.")

    def bind(self) -> None:
        """Make the context current on the calling thread (driver calls need one), once
        per thread (MLX's runtime API uses the same primary context)."""
        if getattr(self._bound, "context", None) == self._ctx.value:
            return
        self._check(self._cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        self._bound.context = self._ctx.value

    def register(self, array: np.ndarray) -> int:
        """Page-lock ``array``'s memory (a staging slot the GPU reads and writes)."""
        return self.register_pages(int(array.ctypes.data), array.nbytes, read_only=False)

    def unregister(self, array: np.ndarray) -> None:
        self.unregister_pages(int(array.ctypes.data))

    def register_pages(self, base: int, nbytes: int, *, read_only: bool = True) -> int:
        """Page-lock ``nbytes`` at ``base`` for the GPU (``read_only``: it only reads
        them, which a read-only file map needs): their device address. Nothing stays
        registered when a call fails."""
        self.bind()
        flags = _CU_MEMHOSTREGISTER_PORTABLE | _CU_MEMHOSTREGISTER_DEVICEMAP
        if read_only:
            flags |= _CU_MEMHOSTREGISTER_READ_ONLY
        address = ctypes.c_void_p(base)
        self._check(
            self._cu.cuMemHostRegister_v2(address, ctypes.c_size_t(nbytes), flags),
            "cuMemHostRegister",
        )
        pointer = ctypes.c_uint64()
        code = self._cu.cuMemHostGetDevicePointer_v2(ctypes.byref(pointer), address, 0)
        if code != 0:
            self._cu.cuMemHostUnregister(address)
            self._check(code, "cuMemHostGetDevicePointer")
        return int(pointer.value)

    def unregister_pages(self, base: int) -> None:
        self.bind()
        self._cu.cuMemHostUnregister(ctypes.c_void_p(base))

    def stream(self) -> int:
        """A new stream that does not wait for the legacy default one (MLX's kernels)."""
        self.bind()
        stream = ctypes.c_void_p()
        self._check(
            self._cu.cuStreamCreate(ctypes.byref(stream), ctypes.c_uint(_CU_STREAM_NON_BLOCKING)),
            "cuStreamCreate",
        )
        return int(stream.value or 0)

    def allocate(self, nbytes: int, stream: int) -> int:
        """``nbytes`` of device memory, ordered on ``stream`` (the device's memory pool:
        no device-wide synchronisation, unlike ``cuMemAlloc``): its address."""
        self.bind()
        pointer = ctypes.c_uint64()
        self._check(
            self._cu.cuMemAllocAsync(
                ctypes.byref(pointer), ctypes.c_size_t(nbytes), ctypes.c_void_p(stream)
            ),
            "cuMemAllocAsync",
        )
        return int(pointer.value)

    def copy_to_device(self, device: int, host: int, nbytes: int, stream: int) -> None:
        """Queue a copy of ``nbytes`` of page-locked host memory to ``device`` on ``stream``
        (the copy engine: no kernel, no core)."""
        self.bind()
        self._check(
            self._cu.cuMemcpyHtoDAsync_v2(
                ctypes.c_uint64(device),
                ctypes.c_void_p(host),
                ctypes.c_size_t(nbytes),
                ctypes.c_void_p(stream),
            ),
            "cuMemcpyHtoDAsync",
        )

    def copy_to_host(self, host: int, device: int, nbytes: int, stream: int) -> None:
        """Queue a copy of ``nbytes`` at ``device`` into page-locked host memory at
        ``host`` on ``stream`` (the copy engine)."""
        self.bind()
        self._check(
            self._cu.cuMemcpyDtoHAsync_v2(
                ctypes.c_void_p(host),
                ctypes.c_uint64(device),
                ctypes.c_size_t(nbytes),
                ctypes.c_void_p(stream),
            ),
            "cuMemcpyDtoHAsync",
        )

    def synchronize(self, stream: int) -> None:
        """Wait until everything queued on ``stream`` is done."""
        self.bind()
        self._check(self._cu.cuStreamSynchronize(ctypes.c_void_p(stream)), "cuStreamSynchronize")

    def free(self, device: int, stream: int) -> None:
        """Give ``device`` (from :meth:`allocate`) back after ``stream``'s work."""
        self.bind()
        self._cu.cuMemFreeAsync(ctypes.c_uint64(device), ctypes.c_void_p(stream))

    def thread_stream(self) -> int:
        """The calling thread's own stream (:meth:`stream`, made at its first call and
        kept): copies queued there wait for nobody else's."""
        stream = getattr(self._bound, "stream", None)
        if stream is None:
            stream = self._bound.stream = self.stream()
        return int(stream)

    def drop_stream(self, stream: int) -> None:
        """Destroy ``stream`` (its queued work still runs)."""
        self.bind()
        self._cu.cuStreamDestroy_v2(ctypes.c_void_p(stream))


class Staging(Protocol):
    """Device memory host spans are copied into as they are page-locked
    (:mod:`kvstore.codecs.cuda_pages`), for kernels to read at the device memory's speed."""

    #: The device address of its first byte.
    address: int

    def copy(self, offset: int, host: int, nbytes: int) -> None:
        """Queue ``nbytes`` of page-locked host memory at ``host`` into ``offset``."""

    def copy_now(self, offset: int, host: int, nbytes: int) -> None:
        """Copy ``nbytes`` of page-locked host memory at ``host`` (a staging slot) into
        ``offset``, and wait for that copy alone (on the calling thread's own stream):
        the slot may be written again when this returns."""

    def wait(self) -> None:
        """Wait until every queued copy is done."""

    def free(self) -> None:
        """Give the memory back (once no kernel reads it any more; after queued copies)."""


class DeviceStaging:
    """:class:`Staging` in device memory of the driver's own, copied into on a stream of
    its own by the copy engine (``cuMemcpyHtoDAsync``)."""

    def __init__(self, driver: Driver, nbytes: int) -> None:
        self._driver = driver
        self._stream = driver.stream()
        try:
            self.address = driver.allocate(max(16, nbytes), self._stream)
        except (RuntimeError, AttributeError):  # no memory, or a driver without the call
            driver.drop_stream(self._stream)
            raise
        # Copies on other threads' streams (:meth:`copy_now`) need the memory made first.
        driver.synchronize(self._stream)
        self._freed = False
        self._lock = threading.Lock()

    def copy(self, offset: int, host: int, nbytes: int) -> None:
        self._driver.copy_to_device(self.address + offset, host, nbytes, self._stream)

    def copy_now(self, offset: int, host: int, nbytes: int) -> None:
        stream = self._driver.thread_stream()
        self._driver.copy_to_device(self.address + offset, host, nbytes, stream)
        self._driver.synchronize(stream)

    def wait(self) -> None:
        self._driver.synchronize(self._stream)

    def free(self) -> None:
        with self._lock:
            if self._freed:
                return
            self._freed = True
        self._driver.free(self.address, self._stream)
        self._driver.drop_stream(self._stream)
