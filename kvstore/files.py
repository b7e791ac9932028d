"""File-system steps more than one layer takes (the store's value file, the benchmarks)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_path", "sync_data"]


def fsync_path(path: Path) -> None:
    """``fsync`` the file or directory at ``path`` (a directory: the names in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_data(fd: int) -> None:
    """Sync the data written to ``fd`` (and what reading it back needs): ``fdatasync``
    where the OS has it, else ``fsync``.

    Python has no ``os.fdatasync`` on macOS, where MLX mostly runs (a durable save that
    wrote into the value file raised ``AttributeError`` there). ``fsync`` hands the data
    to the drive, not through its cache (``F_FULLFSYNC`` would, at a cost per save that
    SQLite, too, leaves off by default): a record a power cut takes from the drive's
    cache after its pointer committed fails its checksum when read, a miss, never bytes
    served wrong.
    """
    sync = getattr(os, "fdatasync", None) or os.fsync  # looked up per call: tests take it away
    sync(fd)
