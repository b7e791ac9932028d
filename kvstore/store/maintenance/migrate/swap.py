"""Swapping two directories in one step, for ``migrate --in-place`` on LMDB stores.

``rename(2)`` cannot replace a non-empty directory, and two renames leave a
moment with no store at the path. Linux's ``renameat2(RENAME_EXCHANGE)`` and
macOS's ``renamex_np(RENAME_SWAP)`` exchange two paths atomically: every
process sees either the old store or the new one at the path. Where neither
exists (or the filesystem refuses), in-place migration is refused up front.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import tempfile
from pathlib import Path

from kvstore.errors import CapabilityError

__all__ = ["exchange_paths", "require_exchange"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h
_RENAME_SWAP = 2  # macOS sys/stdio.h
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV)


def _libc_call(a: bytes, b: bytes) -> tuple[int, int]:
    """``(return code, errno)`` of the platform's exchange call; ``(-1, ENOSYS)`` if none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return -1, errno.ENOSYS
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        rc = libc.renameat2(_AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE)
    elif sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        rc = libc.renamex_np(a, b, _RENAME_SWAP)
    else:
        return -1, errno.ENOSYS
    return rc, ctypes.get_errno() if rc else 0


def exchange_paths(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> None:
    """Atomically exchange the directory entries ``a`` and ``b`` (both must exist).

    Raises:
        CapabilityError: the platform or filesystem cannot exchange atomically.
        OSError: any other failure (nothing was exchanged).
    """
    rc, err = _libc_call(os.fsencode(a), os.fsencode(b))
    if rc == 0:
        return
    if err in _UNSUPPORTED:
        raise CapabilityError(
            f"[migrate] This platform or filesystem cannot swap two directories atomically "
            f"({os.strerror(err)}), which --in-place needs. Migrate into a new DST and "
            f"replace the store yourself while nothing uses it.",
            errno=err,
        )
    raise OSError(err, f"exchanging {a} and {b}: {os.strerror(err)}")


def require_exchange(directory: str | os.PathLike[str]) -> None:
    """Check, with two empty probe directories, that ``directory``'s filesystem can
    exchange paths atomically.

    Raises:
        CapabilityError: it cannot.
    """
    with tempfile.TemporaryDirectory(prefix=".kvstore-swap-probe-", dir=directory) as probe:
        left, right = Path(probe, "a"), Path(probe, "b")
        left.mkdir()
        right.mkdir()
        exchange_paths(left, right)
