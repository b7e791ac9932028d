"""Compiled CUDA kernels kept on disk, so a process loads what an earlier one compiled.

One file per kernel under ``<cache_dir>/cuda-kernels/`` (:mod:`kvstore.cache_dir`),
named by a digest of everything that made it (the kernel's whole source, the
device's architecture, NVRTC's version, :data:`FORMAT`): a changed kernel, another
GPU or another compiler is another file, never a stale one. The file is a magic, a
SHA-256 of the cubin, then the cubin: a torn, truncated or flipped file is not
served (MLX would load a bad module at evaluation, where nothing can fall back), it
is compiled again and rewritten. Writes go to a temporary file renamed over the
name, so a reader in another process sees a whole file or none; a cache that cannot
be written (a read-only home) only costs the next process the compile.

The folder is bounded (:data:`MAX_MIB`, as CUDA's own JIT cache is by
``CUDA_CACHE_MAXSIZE``): a read marks its file used (its modification time), and a
write past the bound removes the files used least recently, so kernels of kvstore
versions or GPUs no longer run go, and the ones in use stay.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvstore.cache_dir import cache_dir
from kvstore.knobs import mib_from_env

__all__ = ["DEFAULT_MAX_MIB", "FORMAT", "MAX_MIB", "cached_cubin", "kernel_key", "kernels_dir"]

log = logging.getLogger("kvstore.cuda")

#: The file layout's version: part of every key, so a new layout never reads an old file.
FORMAT = b"kvstore-cubin/1"
_MAGIC = b"KVCUBIN1"
_DIGEST = hashlib.sha256().digest_size

#: The variable bounding the folder's bytes (MiB, 0 or more), and its default: one
#: deployment uses a few MB of kernels (7-100 KB each; all 503 variants of one version
#: for one GPU are 10.4 MiB: `compile_check`).
MAX_MIB = "KVSTORE_KERNEL_CACHE_MIB"
DEFAULT_MAX_MIB = 64

#: A writer's temporary file older than this was left by a process that died mid-write.
_ABANDONED_S = 3600.0


def kernels_dir() -> Path:
    return cache_dir() / "cuda-kernels"


def kernel_key(source: str, architecture: int, compiler_version: tuple[int, int]) -> str:
    """The hex digest a kernel's file is named by."""
    h = hashlib.sha256(FORMAT)
    h.update(f"\0sm_{architecture}\0nvrtc {compiler_version[0]}.{compiler_version[1]}\0".encode())
    h.update(source.encode())
    return h.hexdigest()


def cached_cubin(key: str, compile_: Callable[[], bytes]) -> bytes:
    """The cubin kept under ``key``, or ``compile_()``'s, kept there for the next process."""
    limit = mib_from_env(MAX_MIB, DEFAULT_MAX_MIB)  # a bad value says so before any compile
    path = kernels_dir() / f"{key[:40]}.cubin"
    cubin = _read(path)
    if cubin is None:
        cubin = compile_()
        if _write(path, cubin):
            _prune(path.parent, path, limit)
    else:
        _mark_used(path)
    return cubin


def _read(path: Path) -> bytes | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head = len(_MAGIC) + _DIGEST
    payload = data[head:]
    if (
        len(data) <= head
        or data[: len(_MAGIC)] != _MAGIC
        or data[len(_MAGIC) : head] != hashlib.sha256(payload).digest()
    ):
        log.warning("kvstore: the compiled kernel %s is damaged; compiling it again", path)
        return None
    return payload


def _write(path: Path, cubin: bytes) -> bool:
    """Whether ``cubin`` was kept at ``path``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + hashlib.sha256(cubin).digest() + cubin)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        log.info("kvstore: the compiled kernel is not kept (%s): the next process compiles it", exc)
        return False
    return True


def _mark_used(path: Path) -> None:
    """``path``'s modification time set to now: the pruning keeps what was used last."""
    try:
        os.utime(path)
    except OSError:
        pass  # a read-only cache is never pruned either


def _prune(folder: Path, keep: Path, limit: int) -> None:
    """Remove the kernel files of ``folder`` used least recently until their bytes are
    within ``limit`` (never ``keep``, just written), and writers' temporary files
    abandoned for an hour. Another process pruning at once is harmless (a file gone
    is skipped); a folder that cannot be listed is left as it is."""
    try:
        files, now = [], time.time()
        with os.scandir(folder) as entries:
            for entry in entries:
                if not entry.name.endswith(".cubin") or not entry.is_file(follow_symlinks=False):
                    continue
                stat = entry.stat(follow_symlinks=False)
                if entry.name.startswith(".tmp-"):  # another writer's, unless abandoned
                    if now - stat.st_mtime > _ABANDONED_S:
                        _remove(Path(entry.path))
                    continue
                files.append((stat.st_mtime_ns, stat.st_size, entry.path))
    except OSError as exc:
        log.info("kvstore: the compiled kernels' folder is not pruned (%s)", exc)
        return
    total = sum(size for _, size, _ in files)
    for _, size, name in sorted(files):
        if total <= limit:
            break
        if name != str(keep) and _remove(Path(name)):
            total -= size


def _remove(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return True  # another process pruned it
    except OSError as exc:
        log.info("kvstore: the compiled kernel %s is not removed (%s)", path, exc)
        return False
    return True
