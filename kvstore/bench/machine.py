"""What a run ran on: CPU, memory, OS, Python, package versions, BLAS, git revision,
and how fast fresh memory is faulted in.

The BLAS matters (BENCHMARKS.md "The BLAS caveat"): the ``mlx[cpu]`` Linux
wheel bundles the reference BLAS, ~10x slower at matmul than an OpenBLAS
preloaded with ``LD_PRELOAD``. Which one MLX calls is read from the
libraries mapped into this process (``/proc/self/maps``): a BLAS named in
``LD_PRELOAD`` and mapped wins symbol lookup over the bundled one.

So does a page's first touch (:func:`memory_touch`). On the microVMs the figures were
measured on, the host backs a guest page only when the guest first touches it: 18 GiB
took 41 s to touch on a fresh CI VM and 11 s the second time. Every fresh page a save
or a restore writes (a growing store's page cache, a new buffer) pays that there, and
a long-running machine or bare metal does not; the rates say which kind a run was.
"""

from __future__ import annotations

import mmap
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "describe",
    "machine_info",
    "memory_touch",
    "package_versions",
    "blas_info",
    "git_revision",
    "PACKAGES",
]

#: Distributions whose versions a run records.
PACKAGES = (
    "mlx-kvstore",
    "mlx",
    "mlx-metal",
    "mlx-cpu",
    "mlx-lm",
    "numpy",
    "lmdb",
    "redis",
    "msgpack",
    "xxhash",
    "matplotlib",
)

_BLAS_NAME = re.compile(r"(blas|lapack|mkl|blis|accelerate)", re.IGNORECASE)
_REFERENCE_BUNDLE = "mlx_cpu.libs"
_SLOW_NOTE = "slow for model compute; see BENCHMARKS.md 'The BLAS caveat'"


def describe() -> dict[str, Any]:
    """``{"machine":, "versions":, "git":}`` for this process (the machine's facts with
    :func:`memory_touch`'s rates)."""
    machine = {**machine_info(), "memory_touch": memory_touch()}
    return {"machine": machine, "versions": package_versions(), "git": git_revision()}


def memory_touch(nbytes: int = 256 << 20) -> dict[str, float] | None:
    """GB/s at which this process faults ``nbytes`` of new anonymous memory in, a byte
    per page: ``first``, a mapping of its own; ``reused``, a second one made after the
    first is unmapped (the kernel hands back pages it has just freed). ``first`` far
    below ``reused``: memory the host backs only on its first touch (a microVM not
    long started). ``None`` where memory cannot be mapped so."""
    page = mmap.PAGESIZE
    rates = {}
    for label in ("first", "reused"):
        try:
            mapped = mmap.mmap(-1, nbytes)
        except (OSError, ValueError):
            return None
        view = memoryview(mapped)
        start = time.perf_counter()
        view[::page] = bytes(len(range(0, nbytes, page)))  # one byte per page
        rates[label] = nbytes / max(time.perf_counter() - start, 1e-9) / 1e9
        view.release()
        mapped.close()
    return rates


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory, OS, Python, load average and the BLAS in use."""
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity
        usable = os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "memory_bytes": _memory_bytes(),
        "os": platform.platform(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "blas": blas_info(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def package_versions() -> dict[str, str | None]:
    """Installed version of each of :data:`PACKAGES` (None when not installed)."""
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def blas_info(
    maps: str | None = None,
    environ: Mapping[str, str] | None = None,
    platform_name: str = sys.platform,
) -> dict[str, Any]:
    """Which BLAS MLX calls, and every BLAS-like library mapped into the process.

    Args:
        maps: the text of ``/proc/self/maps`` (read when None).
        environ: the environment (``os.environ`` when None), for ``LD_PRELOAD``.
        platform_name: ``sys.platform``.

    Returns:
        ``{"mlx": description, "preloaded": [...], "loaded": [...]}``.
    """
    env = os.environ if environ is None else environ
    preload = [p for p in re.split(r"[:\s]+", env.get("LD_PRELOAD", "")) if p]
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            maps = ""
    loaded = sorted(
        {
            path
            for line in maps.splitlines()
            if len(parts := line.split()) >= 6
            and (path := parts[-1]).startswith("/")
            and _BLAS_NAME.search(Path(path).name)
        }
    )
    preloaded = [p for p in preload if _BLAS_NAME.search(Path(p).name)]
    return {
        "mlx": _mlx_blas(preloaded, loaded, platform_name),
        "preloaded": preloaded,
        "loaded": loaded,
    }


def _mlx_blas(preloaded: list[str], loaded: list[str], platform_name: str) -> str:
    if platform_name == "darwin":
        return "Accelerate (macOS)"
    mapped_preloads = [p for p in preloaded if p in loaded or os.path.realpath(p) in loaded]
    if mapped_preloads:
        # The preloaded libblas.so.3 of Debian's OpenBLAS pulls in libopenblas*.so.
        openblas = [p for p in loaded if "openblas" in Path(p).name.lower() and "scipy" not in p]
        name = "OpenBLAS" if openblas or "openblas" in mapped_preloads[0].lower() else "a BLAS"
        return f"{name} via LD_PRELOAD={':'.join(mapped_preloads)}"
    if any(_REFERENCE_BUNDLE in p and "libblas" in Path(p).name for p in loaded):
        return f"reference BLAS bundled with mlx[cpu] ({_SLOW_NOTE})"
    return "unknown (mlx not loaded, or an unrecognised BLAS)"


def git_revision(directory: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """``{"revision", "branch", "dirty"}`` of the checkout holding ``directory`` (default: the
    kvstore package); None when it is not a git checkout (an installed wheel).

    ``KVSTORE_BENCH_GIT=revision[:branch]`` names it instead: a copy of a checkout
    measured elsewhere (the GPU machine gets files, not the repository)."""
    named = os.environ.get("KVSTORE_BENCH_GIT")
    if named:
        revision, _, branch = named.partition(":")
        return {"revision": revision, "branch": branch or None, "dirty": False}
    if directory is None:
        import kvstore

        directory = Path(kvstore.__file__).resolve().parent
    head = _git(directory, "rev-parse", "HEAD")
    if head is None:
        return None
    revision = head
    status = _git(directory, "status", "--porcelain", "--untracked-files=no")
    return {
        "revision": revision,
        "branch": _git(directory, "rev-parse", "--abbrev-ref", "HEAD"),
        "dirty": bool(status),
    }


def _git(directory: str | os.PathLike[str], *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", os.fspath(directory), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()
