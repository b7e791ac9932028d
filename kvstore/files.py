"""File-system steps more than one layer takes (the store's value file, the benchmarks)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_path"]


def fsync_path(path: Path) -> None:
    """``fsync`` the file or directory at ``path`` (a directory: the names in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
