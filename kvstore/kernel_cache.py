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
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvstore.cache_dir import cache_dir

__all__ = ["FORMAT", "cached_cubin", "kernel_key", "kernels_dir"]

log = logging.getLogger("kvstore.cuda")

#: The file layout's version: part of every key, so a new layout never reads an old file.
FORMAT = b"kvstore-cubin/1"
_MAGIC = b"KVCUBIN1"
_DIGEST = hashlib.sha256().digest_size


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
    path = kernels_dir() / f"{key[:40]}.cubin"
    cubin = _read(path)
    if cubin is None:
        cubin = compile_()
        _write(path, cubin)
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


def _write(path: Path, cubin: bytes) -> None:
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
