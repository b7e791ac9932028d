"""NVRTC, NVIDIA's runtime compiler, through ctypes: CUDA C++ source to a cubin.

MLX compiles every ``mx.fast.cuda_kernel`` with NVRTC at its first use in each
process and keeps the result in that process only (``custom_kernel.cpp`` asks its
JIT cache for no disk copy), after prepending its own device headers: on one H100
each of kvstore's staging kernels took 1.5-2.3 s at its first use, in every process
(``tools/bench/results/gpu/``). :mod:`kvstore.cuda_kernel` compiles them here
instead, with only the headers they use, and keeps the cubins on disk
(:mod:`kvstore.kernel_cache`).

The library is the one MLX's CUDA backend loaded (read from the process's mapped
libraries, else found by its soname), else NVIDIA's
``nvidia-cuda-nvrtc`` wheel, else the CUDA toolkit's (``CUDA_HOME``, ``CUDA_PATH``,
``/usr/local/cuda``); the CUDA headers (``cuda_bf16.h``, ``cuda_fp16.h``) are looked
for the same way. :func:`compiler` is ``None`` where there is none.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from pathlib import Path

__all__ = ["Compiler", "NvrtcError", "compiler", "device_architecture"]

#: The sonames tried first (a library already loaded by MLX is found by them).
_SONAMES = ("libnvrtc.so.13", "libnvrtc.so.12")
#: Where NVIDIA's wheels put the library and the headers, under a ``nvidia`` package.
_WHEEL_DIRS = {13: ("cu13",), 12: ("cuda_nvrtc", "cuda_runtime")}


class NvrtcError(RuntimeError):
    """A source NVRTC would not compile (the message holds its log), or a failed call."""


class Compiler:
    """One NVRTC library and the CUDA headers beside it."""

    def __init__(self, library: ctypes.CDLL, include: Path | None) -> None:
        self._lib = library
        self._lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        self.include = include
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self._lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "Version")
        #: ``(major, minor)``: part of every compiled kernel's cache key.
        self.version = (major.value, minor.value)
        count = ctypes.c_int()
        self._check(self._lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)), "NumSupportedArchs")
        archs = (ctypes.c_int * count.value)()
        self._check(self._lib.nvrtcGetSupportedArchs(archs), "SupportedArchs")
        #: Compute capabilities it can emit a cubin for (``90`` for sm_90).
        self.architectures = frozenset(archs)
        # NVRTC programs are independent, but its documentation asks nothing of
        # concurrent compiles; one at a time costs nothing on a first use.
        self._lock = threading.Lock()

    def _check(self, result: int, call: str) -> None:
        if result != 0:
            text = self._lib.nvrtcGetErrorString(result) or b"?"
            raise NvrtcError(f"[nvrtc] nvrtc{call} failed: {text.decode()} ({result}).")

    def cubin(self, source: str, name: str, architecture: int) -> bytes:
        """``source`` compiled for ``sm_<architecture>`` (raises :class:`NvrtcError`
        with NVRTC's log if it does not compile)."""
        options = [f"--gpu-architecture=sm_{architecture}".encode()]
        if self.include is not None:
            options.append(f"--include-path={self.include}".encode())
        with self._lock:
            prog = ctypes.c_void_p()
            self._check(
                self._lib.nvrtcCreateProgram(
                    ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None
                ),
                "CreateProgram",
            )
            try:
                status = self._lib.nvrtcCompileProgram(
                    prog, len(options), (ctypes.c_char_p * len(options))(*options)
                )
                if status != 0:
                    size = ctypes.c_size_t()
                    self._lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                    log = ctypes.create_string_buffer(size.value + 1)
                    self._lib.nvrtcGetProgramLog(prog, log)
                    raise NvrtcError(
                        f"[nvrtc] {name} does not compile for sm_{architecture}:\n"
                        f"{log.value.decode(errors='replace').strip()}"
                    )
                size = ctypes.c_size_t()
                self._check(self._lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "GetCUBINSize")
                out = ctypes.create_string_buffer(size.value)
                self._check(self._lib.nvrtcGetCUBIN(prog, out), "GetCUBIN")
                return out.raw
            finally:
                self._lib.nvrtcDestroyProgram(ctypes.byref(prog))


@functools.cache
def compiler() -> Compiler | None:
    """The process's NVRTC, or ``None`` where none is found or it does not load."""
    for library in _libraries():
        try:
            found = Compiler(ctypes.CDLL(str(library)), None)
        except (OSError, AttributeError, NvrtcError):
            continue
        found.include = _headers(found.version[0])  # the headers of its CUDA version
        return found
    return None


def _libraries() -> list[str | Path]:
    # The one MLX's CUDA backend loaded first: the compiler MLX itself trusts with this
    # driver (another on the library path may be newer than the driver runs).
    found: list[str | Path] = [*_loaded(), *_SONAMES]
    for major in (13, 12):
        library_dir = _WHEEL_DIRS[major][0]  # the library's wheel folder; the headers may differ
        for base in _wheel_roots():
            found += sorted((base / library_dir / "lib").glob(f"libnvrtc.so.{major}*"))
    for root in _toolkit_roots():
        found += sorted((root / "lib64").glob("libnvrtc.so.*"))
        found += sorted((root / "lib").glob("libnvrtc.so.*"))
    return found


def _loaded() -> list[Path]:
    """NVRTC libraries this process has mapped already (Linux: ``/proc/self/maps``)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    paths = {line.split(None, 5)[-1] for line in maps.splitlines() if "/libnvrtc.so" in line}
    return sorted(Path(p) for p in paths if p.startswith("/"))


def _headers(major: int) -> Path | None:
    """The folder holding ``cuda_bf16.h`` for NVRTC of ``major``, or ``None``."""
    subs = _WHEEL_DIRS.get(major, ())
    candidates = [base / sub / "include" for base in _wheel_roots() for sub in subs]
    candidates += [root / "include" for root in _toolkit_roots()]
    return next((c for c in candidates if (c / "cuda_bf16.h").is_file()), None)


def _wheel_roots() -> list[Path]:
    try:
        import nvidia  # type: ignore[import-not-found]  # NVIDIA's namespace package
    except ImportError:
        return []
    return [Path(p) for p in getattr(nvidia, "__path__", [])]


def _toolkit_roots() -> list[Path]:
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    return [Path(r) for r in roots if r]


@functools.cache
def device_architecture() -> int:
    """The compute capability of CUDA device 0 -- MLX's default GPU -- as ``90`` for
    9.0 (raises ``OSError``/``RuntimeError`` without a driver or a device)."""
    cu = ctypes.CDLL("libcuda.so.1")

    def check(result: int, call: str) -> None:
        if result != 0:
            raise RuntimeError(f"[cuda] {call} failed with CUresult {result}.")

    device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    check(cu.cuInit(0), "cuInit")
    check(cu.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR and _MINOR
    check(cu.cuDeviceGetAttribute(ctypes.byref(major), 75, device), "cuDeviceGetAttribute")
    check(cu.cuDeviceGetAttribute(ctypes.byref(minor), 76, device), "cuDeviceGetAttribute")
    return major.value * 10 + minor.value
